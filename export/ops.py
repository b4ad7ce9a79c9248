"""The two pn-mix custom ops: names, attributes and their ONNX local-function bodies.

``PnMixAttention`` (attention of q over the packed cache plus new fp16 K/V) runs BEFORE
``PnMixAppend`` (quantize/append the new K/V into the packed state, with flush and the pair
mask on the first append). Both live in domain ``pnmix``; TensorRT maps them to plugins of the
same names, ONNX Runtime inlines the local functions shipped in the file.

The attributes are the config fields of ``pnmix.config.CONFIG_FIELDS`` under their own names
plus ``plugin_version`` and ``plugin_namespace``: ``op_attributes()`` is the one table.
``export/pnmix_ops.json`` is its generated copy for readers outside Python (``python3 -m
pnmix.export.ops --write``; a test keeps it current, and tests/backends/test_trt_fields.py checks it
against the plugins' own field list). The plugins compile the names, version and input positions
from plugins/include/pnmix/generated.h (pnmix/codegen.py writes it from this module).

The function bodies use only standard ops (no BitShift/BitwiseAnd: codes come out with
floor/Mul/Sub in fp32, exact for small integers, and bits are packed with integer Div, Mul and
Sub) and follow pnmix/quant.py's bit-exact rules, so the packed bytes equal
``pnmix.cache.append_reference`` byte for byte. A body is generated for the config written in
the node's attributes (shapes such as the group size are part of the body); the exporter writes
both from the same config.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from pnmix.config import CONFIG_FIELDS, PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import STATE_DTYPES, STATE_NAMES, CacheLayout, channel_pairs
from pnmix.model import pair_channels

DOMAIN = "pnmix"
DOMAIN_VERSION = 1
ATTENTION_OP = "PnMixAttention"
APPEND_OP = "PnMixAppend"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""
TABLE_JSON = Path(__file__).with_name("pnmix_ops.json")

# ONNX element types of the state tensors: codes and mask are INT8 (same bytes as uint8).
# The ONNX (and TensorRT) type of each state tensor: format.STATE_DTYPES, with the uint8 codes and
# mask carried as INT8 bytes.
_ONNX_OF_DTYPE = {torch.float16: TensorProto.FLOAT16, torch.uint8: TensorProto.INT8}
STATE_ONNX_TYPES: Dict[str, int] = {name: _ONNX_OF_DTYPE[STATE_DTYPES[name]] for name in STATE_NAMES}
# The state tensors with a group-slot axis: what a group flush writes.
GROUP_STATE = ("key_codes", "key_step", "key_offset", "value_codes", "value_step", "value_offset")
LENGTH_INPUTS = ("seq_len", "new_len")
ATTENTION_INPUTS = ("q", "k_new", "v_new") + LENGTH_INPUTS + STATE_NAMES
ATTENTION_OUTPUTS = ("attention",)
APPEND_INPUTS = ("k_new", "v_new") + LENGTH_INPUTS + STATE_NAMES
APPEND_OUTPUTS = tuple(f"present_{name}" for name in STATE_NAMES)

_ATTR_KIND = {float: ("float", onnx.AttributeProto.FLOAT), int: ("int", onnx.AttributeProto.INT),
              str: ("string", onnx.AttributeProto.STRING)}


# ---------------------------------------------------------------------------------------
# The attribute table (one place; the plugins read the generated JSON)
# ---------------------------------------------------------------------------------------


def op_attributes() -> List[Dict[str, str]]:
    """[{name, type, config_field}] for every attribute of both ops, in a fixed order."""
    defaults = PnMixConfig()
    rows = []
    for field in CONFIG_FIELDS:
        kind = _ATTR_KIND[type(getattr(defaults, field))][0]
        rows.append({"name": field, "type": kind, "config_field": field})
    rows.append({"name": "plugin_version", "type": "string", "config_field": ""})
    rows.append({"name": "plugin_namespace", "type": "string", "config_field": ""})
    return rows


def op_table() -> Dict[str, Any]:
    """The whole contract the TensorRT plugins share with the exporter (pnmix_ops.json)."""
    return {
        "domain": DOMAIN,
        "domain_version": DOMAIN_VERSION,
        "plugin_version": PLUGIN_VERSION,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "attributes": op_attributes(),
        "ops": {
            ATTENTION_OP: {"inputs": list(ATTENTION_INPUTS), "outputs": list(ATTENTION_OUTPUTS)},
            APPEND_OP: {"inputs": list(APPEND_INPUTS), "outputs": list(APPEND_OUTPUTS)},
        },
        "state_types": {name: onnx.helper.tensor_dtype_to_string(t).replace("TensorProto.", "")
                        for name, t in STATE_ONNX_TYPES.items()},
    }


def fp32_ratio(config: PnMixConfig) -> float:
    """high_ratio as the FLOAT attribute carries it; the exporter refuses a config whose n_high
    would change through that rounding (a plugin computes n_high from the attribute)."""
    return float(np.float32(config.high_ratio))


def node_attributes(config: PnMixConfig) -> Dict[str, Any]:
    values: Dict[str, Any] = {}
    for row in op_attributes():
        name = row["name"]
        if name == "plugin_version":
            values[name] = PLUGIN_VERSION
        elif name == "plugin_namespace":
            values[name] = PLUGIN_NAMESPACE
        elif name == "high_ratio":
            values[name] = fp32_ratio(config)
        else:
            values[name] = getattr(config, name)
    return values


def config_from_attributes(node: onnx.NodeProto) -> PnMixConfig:
    """The PnMixConfig a pn-mix node's attributes describe (errors name the attribute)."""
    given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    fields = {}
    for row in op_attributes():
        name = row["name"]
        if name not in given:
            raise PnMixError(f"ONNX node {node.op_type} has no attribute '{name}'")
        value = given[name]
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if row["config_field"]:
            fields[name] = value
        elif name == "plugin_version" and value != PLUGIN_VERSION:
            raise PnMixError(f"ONNX node {node.op_type} has plugin_version {value!r}, this pnmix reads {PLUGIN_VERSION!r}")
    return PnMixConfig.from_mapping(fields)


def _onnx_type(name: str) -> str:
    if name in STATE_ONNX_TYPES:
        return f"tensor({helper.tensor_dtype_to_np_dtype(STATE_ONNX_TYPES[name]).name})"
    if name.startswith("present_"):
        return _onnx_type(name[len("present_"):])
    if name in LENGTH_INPUTS:
        return "tensor(int64)"
    return "tensor(float)" if name == "attention" else "tensor(float16)"


def op_schema(op: str) -> "onnx.defs.OpSchema":
    """An OpSchema of one op from the table (not registered with onnx: the file's local function
    defines the op; this is what a graph builder such as onnxscript's tracer needs to emit a node)."""
    from onnx.defs import OpSchema

    spec = op_table()["ops"][op]
    kinds = {"float": OpSchema.AttrType.FLOAT, "int": OpSchema.AttrType.INT, "string": OpSchema.AttrType.STRING}
    return OpSchema(
        op, DOMAIN, DOMAIN_VERSION,
        inputs=[OpSchema.FormalParameter(name, _onnx_type(name)) for name in spec["inputs"]],
        outputs=[OpSchema.FormalParameter(name, _onnx_type(name)) for name in spec["outputs"]],
        attributes=[OpSchema.Attribute(row["name"], kinds[row["type"]], required=True) for row in op_attributes()],
    )


# ---------------------------------------------------------------------------------------
# A tiny builder for function bodies
# ---------------------------------------------------------------------------------------


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


def _scalar_lengths(b: Body, n_tokens: str, cfg: PnMixConfig) -> Tuple[str, str, str]:
    """(n_sink, n_groups, n_residual) of a cache of n_tokens (int64 scalar): FORMAT.md section 2."""
    sink = b.op("Min", n_tokens, b.const(cfg.sink_tokens))
    rest = b.op("Sub", n_tokens, sink)
    over = b.op("Max", b.op("Sub", rest, b.const(cfg.residual_size)), b.const(0))
    full = b.op("Add", b.op("Div", over, b.const(cfg.group_size)), b.const(1))
    groups = b.where(b.op("GreaterOrEqual", rest, b.const(cfg.residual_size)), full, b.const(0))
    residual = b.op("Sub", rest, b.op("Mul", groups, b.const(cfg.group_size)))
    return sink, groups, residual


def _unsigned(b: Body, codes_int8: str) -> str:
    """INT8 bytes -> int32 0..255 (two's complement read back)."""
    x = b.cast(codes_int8, TensorProto.INT32)
    return b.where(b.op("Less", x, b.const(0, np.int32)), b.op("Add", x, b.const(256, np.int32)), x)


def _unsigned_float(b: Body, codes_int8: str) -> str:
    """INT8 bytes -> fp32 0..255 as x - 256 * floor(x / 256), exact. The unpack path is fp32
    because ONNX Runtime's fp32 element-wise ops are vectorized and its int32 Div, Mod and Where
    are loops over elements (about 10x slower, measured on SmolLM2's decode step)."""
    x = b.cast(codes_int8, TensorProto.FLOAT)
    wraps = b.op("Floor", b.op("Mul", x, b.const(1.0 / 256, np.float32)))
    return b.op("Sub", x, b.op("Mul", wraps, b.const(256.0, np.float32)))


def _byte_pairs(b: Body, data: str, axis: int, length: int, pad_shape: str) -> str:
    """fp32 bytes 0..255 along ``axis`` (``length`` of them) -> byte[i] + 256 * byte[i+1] (0 past
    the end): the 16-bit window a code that straddles two bytes is read from."""
    pad = b.op("ConstantOfShape", pad_shape, value=numpy_helper.from_array(np.zeros(1, np.float32)))
    after = b.op("Slice", b.op("Concat", data, pad, axis=axis), b.const([1]), b.const([length + 1]), b.const([axis]))
    return b.op("Add", data, b.op("Mul", after, b.const(256.0, np.float32)))


def _float_codes(b: Body, scaled_word: str, modulus: str) -> str:
    """floor(word * 2^-shift) mod 2^width from fp32 word * 2^-shift (words are integers below
    2^24): exact (products with powers of two, floors of exact values)."""
    shifted = b.op("Floor", scaled_word)
    above = b.op("Floor", b.op("Div", shifted, modulus))
    return b.op("Sub", shifted, b.op("Mul", above, modulus))


def _to_int8(b: Body, byte_values: str) -> str:
    """int32 0..255 -> INT8 with the same bits (explicit, no reliance on a wrapping Cast)."""
    wrapped = b.where(b.op("GreaterOrEqual", byte_values, b.const(128, np.int32)),
                      b.op("Sub", byte_values, b.const(256, np.int32)), byte_values)
    return b.cast(wrapped, TensorProto.INT8)


def _bits_to_bytes(b: Body, bits: str, shape_bytes: str) -> str:
    """int32 0/1 bits [..., 8*K] (LSB first) -> int32 byte values [..., K]."""
    grouped = b.op("Reshape", bits, shape_bytes)  # [..., K, 8]
    weighted = b.op("Mul", grouped, b.const([1 << j for j in range(8)], np.int32))
    return b.op("ReduceSum", weighted, b.const([-1]), keepdims=0)


def _code_bit(b: Body, code: str, bit_index: str) -> str:
    """bit i of an int32 code: (code / 2^i) % 2, integer arithmetic only."""
    pow2 = b.op("Gather", b.const([1 << j for j in range(8)], np.int32), bit_index)
    return b.mod(b.op("Div", code, pow2), b.const(2, np.int32))


def _pair_high(b: Body, pair_mask: str, layout: CacheLayout) -> str:
    """pair_mask INT8 [B, MB] -> bool [B, H, D]: whether each channel's pair is high."""
    h, p, d = layout.kv_heads, layout.pairs, layout.head_dim
    mask = _unsigned(b, pair_mask)
    k = np.arange(h * p)
    byte = b.op("Gather", mask, b.const(k // 8), axis=1)  # [B, H*P]
    bit = _code_bit(b, byte, b.const(k % 8))
    high_pairs = b.op("Reshape", bit, b.const([layout.batch, h, p]))
    pair_of = channel_pairs(d, layout.config.pair_layout).numpy()
    high_channels = b.op("Gather", high_pairs, b.const(pair_of), axis=2)  # [B, H, D]
    return b.op("Equal", high_channels, b.const(1, np.int32))


def _channel_bits(b: Body, high: str, cfg: PnMixConfig) -> str:
    """bool [B, H, D] -> int32 key bits per channel."""
    return b.where(high, b.const(cfg.key_high_bits, np.int32), b.const(cfg.key_low_bits, np.int32))


def _channel_start_bits(b: Body, bits: str, layout: CacheLayout) -> str:
    """int32 [B, H, D] bits -> stream bit where each channel's codes start in a key group:
    gs * sum(bits of the channels before it), as a masked sum (no CumSum needed)."""
    d = layout.head_dim
    before = (np.arange(d)[None, :] < np.arange(d)[:, None]).astype(np.int32)  # [c, c']
    spread = b.op("Mul", b.op("Unsqueeze", bits, b.const([2])), b.const(before, np.int32))
    total = b.op("ReduceSum", spread, b.const([-1]), keepdims=0)  # [B, H, D]
    return b.op("Mul", total, b.const(layout.config.group_size, np.int32))


# ---------------------------------------------------------------------------------------
# Affine fit and quantize (pnmix/quant.py's rules)
# ---------------------------------------------------------------------------------------


def _clip_fp16_range(b: Body, x32: str) -> str:
    """Saturating fp16 is Clip then Cast; this is the Clip (see _fit)."""
    return b.op("Clip", x32, b.const(-65504.0, np.float32), b.const(65504.0, np.float32))


def _fit(b: Body, x32: str, bits: int, axis: int, count: int) -> Tuple[str, str]:
    """(step, offset) over ``axis`` (kept, size 1) of fp32 values x32, as fp32 values clipped
    to the fp16 range but not yet rounded: callers select between fits in fp32 and then cast
    once (ONNX Runtime has no fp16 Where on CPU; around one it inserts casts and then drops
    the fp16 rounding as a redundant cast pair)."""
    axes = b.const([axis])
    if bits >= 2:
        lo = b.op("ReduceMin", x32, axes, keepdims=1)
        hi = b.op("ReduceMax", x32, axes, keepdims=1)
        step = b.op("Div", b.op("Sub", hi, lo), b.const(float(2 ** bits - 1), np.float32))
        return _clip_fp16_range(b, step), _clip_fp16_range(b, lo)
    x64 = b.cast(x32, TensorProto.DOUBLE)
    n = b.const(float(count), np.float64)
    mu = b.cast(b.op("Div", b.op("ReduceSum", x64, axes, keepdims=1), n), TensorProto.FLOAT)
    spread = b.cast(b.op("Abs", b.op("Sub", x32, mu)), TensorProto.DOUBLE)
    a = b.cast(b.op("Div", b.op("ReduceSum", spread, axes, keepdims=1), n), TensorProto.FLOAT)
    step = b.op("Mul", b.const(2.0, np.float32), a)
    return _clip_fp16_range(b, step), _clip_fp16_range(b, b.op("Sub", mu, a))


def _quantize(b: Body, x32: str, step16: str, offset16: str, max_code: str) -> str:
    """int32 codes: clamp(round_half_even(fp32(x - offset) / step), 0, max), 0 where step == 0."""
    step = b.cast(step16, TensorProto.FLOAT)
    offset = b.cast(offset16, TensorProto.FLOAT)
    q = b.op("Round", b.op("Div", b.op("Sub", x32, offset), step))
    q = b.op("Min", b.op("Max", q, b.const(0.0, np.float32)), max_code)
    q = b.where(b.op("Equal", step, b.const(0.0, np.float32)), b.const(0.0, np.float32), q)
    return b.cast(q, TensorProto.INT32)


# ---------------------------------------------------------------------------------------
# PnMixAttention
# ---------------------------------------------------------------------------------------


def attention_function(layout: CacheLayout, q_heads: int, opset: int) -> onnx.FunctionProto:
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    s, r = cfg.sink_tokens, cfg.residual_size
    rep = q_heads // h
    b = Body("att")
    f32 = TensorProto.FLOAT
    seq_len, new_len = "seq_len", "new_len"
    n_sink, n_groups, n_residual = _scalar_lengths(b, seq_len, cfg)
    n = b.op("Gather", b.op("Shape", "k_new"), b.const(2), axis=0)  # scalar
    q = b.op("Reshape", b.cast("q", f32), b.shape_of(b.const([bsz, h, rep]), b.op("Unsqueeze", n, b.const([0])), b.const([d])))

    # Slots in cache order: sink, groups, residual, new tokens. Only the n_groups group slots in
    # use are unpacked (the work follows the context, not the capacity), and every one of them
    # holds a token; the fp16 segments have unused rows, which may hold anything (even NaN).
    ng1 = b.op("Unsqueeze", n_groups, b.const([0]))
    used = {name: b.op("Slice", name, b.const([0]), ng1, b.const([2])) for name in GROUP_STATE}
    sink_slot, residual_slot = b.const(np.arange(s)), b.const(np.arange(r))
    new_slot = b.op("Range", b.const(0), n, b.const(1))
    dense = {"sink": ("sink_k", "sink_v", b.op("Less", sink_slot, n_sink)),
             "residual": ("residual_k", "residual_v", b.op("Less", residual_slot, n_residual)),
             "new": ("k_new", "v_new", b.op("Less", new_slot, new_len))}

    def dense_scores(segment: str) -> str:
        keys = b.op("Unsqueeze", b.cast(dense[segment][0], f32), b.const([2]))  # [B, H, 1, T, D]
        return b.op("MatMul", q, b.op("Transpose", keys, perm=[0, 1, 2, 4, 3]))

    def dense_values(segment: str) -> str:  # unused rows zeroed, so 0 * garbage cannot leak in
        rows = b.op("Unsqueeze", dense[segment][2], b.const([1]))  # [T, 1]
        return b.where(rows, b.cast(dense[segment][1], f32), b.const(0.0, np.float32))

    high = _pair_high(b, "pair_mask", layout)
    group_scores = _group_scores(b, layout, q, rep, _channel_bits(b, high, cfg), high, used, ng1)
    scores = b.op("Concat", dense_scores("sink"), group_scores, dense_scores("residual"), dense_scores("new"), axis=-1)
    values = b.op("Concat", dense_values("sink"), _dequantize_values(b, layout, used, ng1), dense_values("residual"),
                  dense_values("new"), axis=2)

    group_tokens = b.op("Mul", n_groups, b.const(gs))
    group_slot = b.op("Range", b.const(0), group_tokens, b.const(1))
    valid = b.op("Concat", dense["sink"][2], b.op("Less", group_slot, group_tokens),  # every used group slot
                 dense["residual"][2], dense["new"][2], axis=0)
    residual_base = b.op("Add", b.const(s), group_tokens)
    position = b.op("Concat", sink_slot, b.op("Add", group_slot, b.const(s)),
                    b.op("Add", residual_slot, residual_base), b.op("Add", new_slot, seq_len), axis=0)
    # Query i sits at seq_len + new_len - n + i and sees valid slots at positions <= its own.
    first_query = b.op("Sub", b.op("Add", seq_len, new_len), n)
    query_pos = b.op("Unsqueeze", b.op("Add", new_slot, first_query), b.const([1]))  # [n, 1]
    allowed = b.and_(b.op("Unsqueeze", valid, b.const([0])),
                     b.op("LessOrEqual", b.op("Unsqueeze", position, b.const([0])), query_pos))

    # GQA: query head hq = kv_head * rep + j reads kv_head.
    scores = b.op("Mul", scores, b.const(1.0 / math.sqrt(d), np.float32))
    scores = b.where(allowed, scores, b.const(-np.inf, np.float32))
    probs = b.op("Softmax", scores, axis=-1)
    out = b.op("MatMul", probs, b.op("Unsqueeze", values, b.const([2])))  # [B, H, rep, n, D]
    out = b.op("Reshape", out, b.shape_of(b.const([bsz, q_heads]), b.op("Unsqueeze", n, b.const([0])), b.const([d])))
    b.output(out, "attention")
    return _function(ATTENTION_OP, ATTENTION_INPUTS, ATTENTION_OUTPUTS, b, opset)


def _group_scores(b: Body, layout: CacheLayout, q: str, rep: int, key_bits: str, high: str, used: Dict[str, str],
                  ng1: str) -> str:
    """q [B, H, rep, n, D] . the used groups' keys -> scores [B, H, rep, n, ng*gs] in slot order.

    The keys are unpacked channel-major, as they are stored ([B, H, ng, D, gs]), and q multiplies
    each group without a transpose of the keys; only the small scores are transposed. The bit
    pattern is the same in every group, so code positions, shifts and moduli are computed once at
    [B, H, 1, D*gs] and broadcast along the group axis (ONNX Runtime's broadcast loop is fast
    along a long last axis, slow along a short one)."""
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    f32 = TensorProto.FLOAT
    per_code = b.const([bsz, h, 1, d * gs])
    data = _unsigned_float(b, used["key_codes"])  # [B, H, ng, KB]
    if _straddles(cfg.key_high_bits, cfg.key_low_bits):
        data = _byte_pairs(b, data, 3, layout.key_group_bytes, b.shape_of(b.const([bsz, h]), ng1, b.const([1])))
    byte, inverse_pow2, modulus = (b.op("Reshape", x, per_code) for x in _key_code_positions(b, layout, key_bits, high))
    index = b.op("Expand", byte, b.shape_of(b.const([bsz, h]), ng1, b.const([d * gs])))
    word = b.op("GatherElements", data, index, axis=3)  # [B, H, ng, D*gs]
    codes = _float_codes(b, b.op("Mul", word, inverse_pow2), modulus)
    codes = b.op("Reshape", codes, b.shape_of(b.const([bsz, h]), ng1, b.const([d, gs])), allowzero=1)  # [B, H, ng, D, gs]
    step, offset = (b.op("Unsqueeze", b.cast(used[name], f32), b.const([4])) for name in ("key_step", "key_offset"))
    keys = b.op("Add", offset, b.op("Mul", step, codes))
    rows = b.op("Slice", b.op("Shape", q), b.const([2]), b.const([4]))  # [rep, n]
    q_rows = b.op("Reshape", q, b.const([bsz, h, 1, -1, d]))  # [B, H, 1, rep*n, D]
    scores = b.op("MatMul", q_rows, keys)  # [B, H, ng, rep*n, gs]
    scores = b.op("Transpose", scores, perm=[0, 1, 3, 2, 4])  # [B, H, rep*n, ng, gs]
    tokens = b.op("Mul", ng1, b.const([gs]))  # allowzero: ng may be 0, and 0 must not copy a dimension
    return b.op("Reshape", scores, b.shape_of(b.const([bsz, h]), rows, tokens), allowzero=1)


def _key_code_positions(b: Body, layout: CacheLayout, key_bits: str, high: str) -> Tuple[str, str, str]:
    """For key code (c, t) of a group [B, H, D, gs]: the byte it starts in (int32), 2^-(its bit in
    that byte) and 2^bits(c) (fp32), from its stream bit start(c) + t * bits(c).

    group_size is a multiple of 8 (a config rule), so every channel's codes start on a whole byte
    (start(c) = gs * the bits of the channels before it) and the shift and in-channel byte depend
    on t and the channel's width only: two constant rows per quantity, blended by the high/low flag
    in fp32 (exact: 0/1 weights, small integers and powers of two). ONNX Runtime runs these
    broadcasts along the token axis as vector loops, where integer Div/Mod and a table Gather per
    code are loops over elements."""
    cfg = layout.config
    gs = cfg.group_size
    f32 = TensorProto.FLOAT
    t = np.arange(gs)
    high_f = b.op("Unsqueeze", b.cast(high, f32), b.const([3]))  # [B, H, D, 1]

    def blend(low_row: np.ndarray, high_row: np.ndarray) -> str:
        return b.op("Add", b.const(low_row, np.float32), b.op("Mul", high_f, b.const(high_row - low_row, np.float32)))

    rows = {w: (t * w // 8, 2.0 ** -(t * w % 8)) for w in (cfg.key_low_bits, cfg.key_high_bits)}
    lo, hi = rows[cfg.key_low_bits], rows[cfg.key_high_bits]
    start = _channel_start_bits(b, key_bits, layout)  # [B, H, D], a multiple of 8
    start_byte = b.op("Unsqueeze", b.cast(b.op("Div", start, b.const(8, np.int32)), f32), b.const([3]))
    byte = b.cast(b.op("Add", start_byte, blend(lo[0], hi[0])), TensorProto.INT32)
    modulus = blend(np.full(gs, 2.0 ** cfg.key_low_bits), np.full(gs, 2.0 ** cfg.key_high_bits))
    return byte, blend(lo[1], hi[1]), modulus


def _byte_codes_table(bits: int) -> np.ndarray:
    """[256, 8/bits] fp32: the codes of a byte, lowest bits first. Indexed by the signed INT8
    byte itself: ONNX Gather reads a negative index from the end, row 256 + x, which is the
    unsigned value of the byte (no conversion of the codes first)."""
    byte = np.arange(256)[:, None]
    return ((byte >> (np.arange(8 // bits)[None, :] * bits)) & ((1 << bits) - 1)).astype(np.float32)


def _straddles(*widths: int) -> bool:
    """Whether a code of one of these widths can span two bytes (streams start on whole bytes)."""
    return any(8 % w for w in widths)


def _dequantize_values(b: Body, layout: CacheLayout, used: Dict[str, str], ng1: str) -> str:
    """The used groups' value_codes/step/offset -> fp32 [B, H, ng*gs, D]; value code positions
    are static."""
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    bv, nvb, vg = cfg.value_bits, layout.value_blocks, layout.value_block
    if _straddles(bv):
        bit = np.arange(d) * bv
        data = _unsigned_float(b, used["value_codes"])  # [B, H, ng, gs, VB]
        pairs = _byte_pairs(b, data, 4, layout.value_token_bytes, b.shape_of(b.const([bsz, h]), ng1, b.const([gs, 1])))
        word = b.op("Gather", pairs, b.const(bit // 8), axis=4)
        codes = _float_codes(b, b.op("Mul", word, b.const(2.0 ** -(bit % 8), np.float32)),
                             b.const(float(1 << bv), np.float32))
    else:  # 8 / bv whole codes per byte, in channel order: one table row per byte
        codes = b.op("Gather", b.const(_byte_codes_table(bv), np.float32),
                     b.cast(used["value_codes"], TensorProto.INT32), axis=0)  # [B, H, ng, gs, VB, 8/bv]
    blocks = b.shape_of(b.const([bsz, h]), ng1, b.const([gs, nvb, vg]))
    codes = b.op("Reshape", codes, blocks)
    step = b.op("Unsqueeze", b.cast(used["value_step"], TensorProto.FLOAT), b.const([5]))
    offset = b.op("Unsqueeze", b.cast(used["value_offset"], TensorProto.FLOAT), b.const([5]))
    deq = b.op("Add", offset, b.op("Mul", step, codes))
    tokens = b.op("Mul", ng1, b.const([gs]))  # no -1: the shape must be exact when ng is 0
    return b.op("Reshape", deq, b.shape_of(b.const([bsz, h]), tokens, b.const([d])))


# ---------------------------------------------------------------------------------------
# PnMixAppend
# ---------------------------------------------------------------------------------------


def append_function(layout: CacheLayout, opset: int) -> onnx.FunctionProto:
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    g, s, r = layout.max_groups, cfg.sink_tokens, cfg.residual_size
    b = Body("app")
    seq_len, new_len = "seq_len", "new_len"
    end = b.op("Add", seq_len, new_len)
    sink0, groups0, res0 = _scalar_lengths(b, seq_len, cfg)
    sink1, groups1, res1 = _scalar_lengths(b, end, cfg)
    into_sink = b.op("Sub", sink1, sink0)
    new_groups = b.op("Sub", groups1, groups0)
    axis2 = b.const([2])
    # Only the first new_len tokens are appended (new_len 0: evaluation, nothing changes).
    k_add = b.op("Slice", "k_new", b.const([0]), b.op("Unsqueeze", new_len, b.const([0])), axis2)
    v_add = b.op("Slice", "v_new", b.const([0]), b.op("Unsqueeze", new_len, b.const([0])), axis2)

    # The pair mask: computed from the keys of the first append into an empty cache.
    first = b.and_(b.op("Equal", seq_len, b.const(0)), b.op("Greater", new_len, b.const(0)))
    [mask] = b.if_(first, lambda t: [_to_int8(t, _saliency_mask(t, k_add, layout))],
                   lambda e: ["pair_mask"], [TensorProto.INT8])
    b.output(mask, "present_pair_mask")

    # Every state tensor is rebuilt as a Gather from [old rows ; new rows] along the token or
    # group axis with computed row indices: static shapes, data-dependent positions.
    sink_idx = _select_rows(b, np.arange(s), sink0, sink1, b.const(s), sink0)
    for name, new in (("sink_k", k_add), ("sink_v", v_add)):
        b.output(b.op("Gather", b.op("Concat", name, new, axis=2), sink_idx, axis=2), f"present_{name}")

    # The residual stream: what the residual holds, then the new tokens past the sink.
    def stream_source(t: Body, pos: str) -> str:
        from_new = t.op("Add", t.op("Sub", pos, res0), t.op("Add", t.const(r), into_sink))
        return t.where(t.op("Less", pos, res0), pos, from_new)

    residual_slot = b.const(np.arange(r))
    kept = b.op("Add", residual_slot, b.op("Mul", new_groups, b.const(gs)))
    residual_idx = b.where(b.op("Less", residual_slot, res1), stream_source(b, kept), residual_slot)
    streams = {}
    for kind, new in (("k", k_add), ("v", v_add)):
        streams[kind] = b.op("Concat", f"residual_{kind}", new, axis=2)
        b.output(b.op("Gather", streams[kind], residual_idx, axis=2), f"present_residual_{kind}")

    def flush_groups(t: Body) -> List[str]:
        """The groups this call completes, quantized into their slots."""
        group_pos = t.op("Range", t.const(0), t.op("Mul", new_groups, t.const(gs)), t.const(1))
        group_idx = stream_source(t, group_pos)
        ng1 = t.op("Unsqueeze", new_groups, t.const([0]))
        group_shape = t.shape_of(t.const([bsz, h]), ng1, t.const([gs, d]))
        keys, values = (t.cast(t.op("Reshape", t.op("Gather", streams[kind], group_idx, axis=2), group_shape),
                               TensorProto.FLOAT) for kind in ("k", "v"))  # [B, H, ng, gs, D]
        high = _pair_high(t, mask, layout)
        new_state = dict(zip(GROUP_STATE[:3], _quantize_keys(t, layout, keys, high, ng1)))
        new_state.update(zip(GROUP_STATE[3:], _quantize_values(t, layout, values, ng1)))
        slot_idx = _select_rows(t, np.arange(g), groups0, groups1, t.const(g), groups0)
        return [t.op("Gather", t.op("Concat", name, new_state[name], axis=2), slot_idx, axis=2) for name in GROUP_STATE]

    # Most calls complete no group (a decode step flushes one every group_size tokens): the
    # quantizer runs only in the calls that do.
    group_types = [STATE_ONNX_TYPES[name] for name in GROUP_STATE]
    merged = b.if_(b.op("Greater", new_groups, b.const(0)), flush_groups, lambda e: list(GROUP_STATE), group_types)
    for name, value in zip(GROUP_STATE, merged):
        b.output(value, f"present_{name}")
    return _function(APPEND_OP, APPEND_INPUTS, APPEND_OUTPUTS, b, opset)


def _select_rows(b: Body, slots: np.ndarray, lo: str, hi: str, new_base: str, new_first: str) -> str:
    """Row index into [old ; new]: slot i in [lo, hi) takes new row i - new_first, else old row i."""
    slot = b.const(slots)
    inside = b.and_(b.op("GreaterOrEqual", slot, lo), b.op("Less", slot, hi))
    from_new = b.op("Add", new_base, b.op("Sub", slot, new_first))
    return b.where(inside, from_new, slot)


def _saliency_mask(b: Body, keys16: str, layout: CacheLayout) -> str:
    """fp16 keys [B, H, n, D] -> pair_mask byte values (int32) [B, MB]: the n_high pairs of
    largest float64 energy, ties to the lower pair index (a rank count, not TopK, whose ties are
    unspecified); a NaN energy ranks lowest."""
    cfg = layout.config
    bsz, h, p = layout.batch, layout.kv_heads, layout.pairs
    k64 = b.cast(keys16, TensorProto.DOUBLE)
    squares = b.op("ReduceSum", b.op("Mul", k64, k64), b.const([2]), keepdims=0)  # [B, H, D]
    first, second = pair_channels(layout.head_dim, cfg.pair_layout)
    energy = b.op("Add", b.op("Gather", squares, b.const(first.numpy()), axis=2),
                  b.op("Gather", squares, b.const(second.numpy()), axis=2))  # [B, H, P]
    energy = b.where(b.op("IsNaN", energy), b.const(-np.inf, np.float64), energy)
    mine = b.op("Unsqueeze", energy, b.const([3]))  # [B, H, P, 1]: pair p
    other = b.op("Unsqueeze", energy, b.const([2]))  # [B, H, 1, P]: pair q
    lower = (np.arange(p)[None, :] < np.arange(p)[:, None])  # [p, q]: q < p
    ahead = b.op("Or", b.op("Greater", other, mine),
                 b.and_(b.op("Equal", other, mine), b.const(lower, np.bool_)))
    rank = b.op("ReduceSum", b.cast(ahead, TensorProto.INT32), b.const([3]), keepdims=0)
    high = b.cast(b.op("Less", rank, b.const(cfg.high_pairs(layout.head_dim), np.int32)), TensorProto.INT32)
    bits = b.op("Reshape", high, b.const([bsz, h * p]))
    spare = layout.mask_bytes * 8 - h * p
    if spare:
        bits = b.op("Concat", bits, b.const(np.zeros((bsz, spare)), np.int32), axis=1)
    return _bits_to_bytes(b, bits, b.const([bsz, layout.mask_bytes, 8]))


def _quantize_keys(b: Body, layout: CacheLayout, keys: str, high: str, ng1: str):
    """fp32 keys [B, H, ng, gs, D] -> (INT8 codes [B,H,ng,KB], fp16 step, offset [B,H,ng,D])."""
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    high5 = b.op("Reshape", high, b.const([bsz, h, 1, 1, d]))
    fits = {}
    for bits in {cfg.key_high_bits, cfg.key_low_bits}:
        fits[bits] = _fit(b, keys, bits, axis=3, count=gs)
    step = b.cast(b.where(high5, fits[cfg.key_high_bits][0], fits[cfg.key_low_bits][0]), TensorProto.FLOAT16)
    offset = b.cast(b.where(high5, fits[cfg.key_high_bits][1], fits[cfg.key_low_bits][1]), TensorProto.FLOAT16)
    max_code = b.where(high5, b.const(float(2 ** cfg.key_high_bits - 1), np.float32),
                       b.const(float(2 ** cfg.key_low_bits - 1), np.float32))
    codes = _quantize(b, keys, step, offset, max_code)  # [B, H, ng, gs, D]
    by_channel = b.op("Transpose", codes, perm=[0, 1, 2, 4, 3])  # [B, H, ng, D, gs]
    # Scatter every bit i of code (c, t) to stream bit start(c) + t * bits(c) + i. Bits past a
    # channel's width (i >= bits(c)) are 0 and all go to one spare slot past the end, which is
    # dropped: the cost follows the new groups, not the stream length.
    key_bits = _channel_bits(b, high, cfg)
    start = _channel_start_bits(b, key_bits, layout)  # [B, H, D]
    widest = max(cfg.key_high_bits, cfg.key_low_bits)
    nbits = layout.key_group_bytes * 8
    i = b.const(np.arange(widest, dtype=np.int32)[None, None, None, None, :], np.int32)
    t = b.const(np.arange(gs, dtype=np.int32)[None, None, None, :, None], np.int32)
    start5 = b.op("Reshape", start, b.const([bsz, h, d, 1, 1]))
    bits5 = b.op("Reshape", key_bits, b.const([bsz, h, d, 1, 1]))
    target = b.op("Add", b.op("Add", start5, b.op("Mul", t, bits5)), i)  # [B, H, D, gs, widest]
    target = b.where(b.op("Less", i, bits5), target, b.const(nbits, np.int32))
    target = b.op("Reshape", b.cast(target, TensorProto.INT64), b.const([bsz, h, 1, d * gs * widest]))
    updates_shape = b.shape_of(b.const([bsz, h]), ng1, b.const([d * gs * widest]))
    bit = _code_bit(b, b.op("Unsqueeze", by_channel, b.const([5])), i)  # [B, H, ng, D, gs, widest]
    stream_shape = b.shape_of(b.const([bsz, h]), ng1, b.const([nbits + 1]))
    empty = b.op("ConstantOfShape", stream_shape, value=numpy_helper.from_array(np.zeros(1, np.int32)))
    stream = b.op("ScatterElements", empty, b.op("Expand", target, updates_shape),
                  b.op("Reshape", bit, updates_shape), axis=3)
    bit = b.op("Slice", stream, b.const([0]), b.const([nbits]), b.const([3]))
    byte_values = _bits_to_bytes(b, bit, b.shape_of(b.const([bsz, h]), ng1, b.const([layout.key_group_bytes, 8])))
    squeeze = b.const([3])
    return (_to_int8(b, byte_values), b.op("Squeeze", step, squeeze), b.op("Squeeze", offset, squeeze))


def _quantize_values(b: Body, layout: CacheLayout, values: str, ng1: str):
    """fp32 values [B, H, ng, gs, D] -> (INT8 codes [B,H,ng,gs,VB], fp16 step, offset [B,H,ng,gs,NVB])."""
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    bv, nvb, vg = cfg.value_bits, layout.value_blocks, layout.value_block
    blocks = b.op("Reshape", values, b.shape_of(b.const([bsz, h]), ng1, b.const([gs, nvb, vg])))
    step, offset = (b.cast(x, TensorProto.FLOAT16) for x in _fit(b, blocks, bv, axis=5, count=vg))
    codes = _quantize(b, blocks, step, offset, b.const(float(2 ** bv - 1), np.float32))
    codes = b.op("Reshape", codes, b.shape_of(b.const([bsz, h]), ng1, b.const([gs, d])))
    k = np.arange(d * bv)
    code = b.op("Gather", codes, b.const(k // bv), axis=4)  # [B, H, ng, gs, D*bv]
    bit = _code_bit(b, code, b.const(k % bv))
    shape = b.shape_of(b.const([bsz, h]), ng1, b.const([gs, layout.value_token_bytes, 8]))
    squeeze = b.const([5])
    return (_to_int8(b, _bits_to_bytes(b, bit, shape)), b.op("Squeeze", step, squeeze),
            b.op("Squeeze", offset, squeeze))


# ---------------------------------------------------------------------------------------
# Function protos
# ---------------------------------------------------------------------------------------


def _function(name: str, inputs: Sequence[str], outputs: Sequence[str], b: Body, opset: int) -> onnx.FunctionProto:
    # Attributes are declared so the nodes may carry them; the body is generated for their
    # values (the exporter writes both from one config).
    return helper.make_function(
        DOMAIN, name, list(inputs), list(outputs), b.nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[row["name"] for row in op_attributes()],
    )


def write_table(path: Path = TABLE_JSON) -> Path:
    from pnmix.io import write_json_atomic

    return write_json_atomic(path, op_table())


if __name__ == "__main__":  # python3 -m pnmix.export.ops --write
    if "--write" in sys.argv[1:]:
        print(write_table())
    else:
        print(json.dumps(op_table(), indent=2))
