"""The little graph builder the ONNX function bodies of the pn-mix ops are written in
(export/append_body.py, export/attention_body.py), and the integer and bit arithmetic they share.

Only standard ops: no BitShift/BitwiseAnd. Codes come out with Floor/Mul/Sub in fp32, exact for
small integers, and bits are packed with integer Div, Mul and Sub.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class Body:
    """Collects nodes with unique output names; ``op`` returns the output name(s)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: List[onnx.NodeProto] = []
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}_{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str = "", **attrs: Any):
        outs = [self._name(name or op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value: Any, dtype: Any = np.int64, name: str = "c") -> str:
        array = np.asarray(value, dtype=dtype)
        return self.op("Constant", name=name, value=numpy_helper.from_array(array))

    def output(self, source: str, target: str) -> None:
        self.nodes.append(helper.make_node("Identity", [source], [target]))

    def if_(self, cond: str, then_fn: Callable[["Body"], Sequence[str]], else_fn: Callable[["Body"], Sequence[str]],
            types: Sequence[int]) -> List[str]:
        """ONNX If on a bool scalar: each branch builds its outputs (of element ``types``) in its
        own Body, reading this body's names. ONNX Runtime runs only the branch taken, so work
        that most calls do not need (a decode step flushes a group once in group_size calls)
        costs nothing on the others."""
        branches = []
        for tag, build in (("then", then_fn), ("else", else_fn)):
            sub = Body(self._name(tag))
            results = list(build(sub))
            if len(results) != len(types):
                raise ValueError(f"an If branch gave {len(results)} outputs for {len(types)} types")
            declared = []
            for i, (result, elem_type) in enumerate(zip(results, types)):
                name = f"{sub.prefix}_out{i}"
                sub.output(result, name)
                declared.append(helper.make_tensor_value_info(name, elem_type, None))
            branches.append(helper.make_graph(sub.nodes, sub.prefix, [], declared))
        outs = self.op("If", cond, outputs=len(types), then_branch=branches[0], else_branch=branches[1])
        return [outs] if len(types) == 1 else list(outs)

    # small conveniences (named after the ONNX op they emit)
    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", x, to=to)

    def where(self, cond: str, a: str, b: str) -> str:
        return self.op("Where", cond, a, b)

    def and_(self, a: str, b: str) -> str:
        return self.op("And", a, b)

    def mod(self, a: str, m: str) -> str:
        """a % m for non-negative integers as a - (a / m) * m: ONNX Runtime's integer Mod is an
        element-by-element loop, an order of magnitude slower than Div on the unpack path."""
        return self.op("Sub", a, self.op("Mul", self.op("Div", a, m), m))

    def shape_of(self, *parts: str) -> str:
        """Concat 1-D int64 pieces into a shape."""
        return self.op("Concat", *parts, axis=0)


# ---------------------------------------------------------------------------------------
# Bytes and bits
# ---------------------------------------------------------------------------------------


def unsigned(b: Body, codes_int8: str) -> str:
    """INT8 bytes -> int32 0..255 (two's complement read back)."""
    x = b.cast(codes_int8, TensorProto.INT32)
    return b.where(b.op("Less", x, b.const(0, np.int32)), b.op("Add", x, b.const(256, np.int32)), x)


def unsigned_float(b: Body, codes_int8: str) -> str:
    """INT8 bytes -> fp32 0..255 as x - 256 * floor(x / 256), exact. The unpack path is fp32
    because ONNX Runtime's fp32 element-wise ops are vectorized and its int32 Div, Mod and Where
    are loops over elements (about 10x slower, measured on SmolLM2's decode step)."""
    x = b.cast(codes_int8, TensorProto.FLOAT)
    wraps = b.op("Floor", b.op("Mul", x, b.const(1.0 / 256, np.float32)))
    return b.op("Sub", x, b.op("Mul", wraps, b.const(256.0, np.float32)))


def byte_pairs(b: Body, data: str, axis: int, length: int, pad_shape: str) -> str:
    """fp32 bytes 0..255 along ``axis`` (``length`` of them) -> byte[i] + 256 * byte[i+1] (0 past
    the end): the 16-bit window a code that straddles two bytes is read from."""
    pad = b.op("ConstantOfShape", pad_shape, value=numpy_helper.from_array(np.zeros(1, np.float32)))
    after = b.op("Slice", b.op("Concat", data, pad, axis=axis), b.const([1]), b.const([length + 1]), b.const([axis]))
    return b.op("Add", data, b.op("Mul", after, b.const(256.0, np.float32)))


def float_codes(b: Body, scaled_word: str, modulus: str) -> str:
    """floor(word * 2^-shift) mod 2^width from fp32 word * 2^-shift (words are integers below
    2^24): exact (products with powers of two, floors of exact values)."""
    shifted = b.op("Floor", scaled_word)
    above = b.op("Floor", b.op("Div", shifted, modulus))
    return b.op("Sub", shifted, b.op("Mul", above, modulus))


def to_int8(b: Body, byte_values: str) -> str:
    """int32 0..255 -> INT8 with the same bits (explicit, no reliance on a wrapping Cast)."""
    wrapped = b.where(b.op("GreaterOrEqual", byte_values, b.const(128, np.int32)),
                      b.op("Sub", byte_values, b.const(256, np.int32)), byte_values)
    return b.cast(wrapped, TensorProto.INT8)


def bits_to_bytes(b: Body, bits: str, shape_bytes: str) -> str:
    """int32 0/1 bits [..., 8*K] (LSB first) -> int32 byte values [..., K]."""
    grouped = b.op("Reshape", bits, shape_bytes)  # [..., K, 8]
    weighted = b.op("Mul", grouped, b.const([1 << j for j in range(8)], np.int32))
    return b.op("ReduceSum", weighted, b.const([-1]), keepdims=0)


def code_bit(b: Body, code: str, bit_index: str) -> str:
    """bit i of an int32 code: (code / 2^i) % 2, integer arithmetic only."""
    pow2 = b.op("Gather", b.const([1 << j for j in range(8)], np.int32), bit_index)
    return b.mod(b.op("Div", code, pow2), b.const(2, np.int32))
