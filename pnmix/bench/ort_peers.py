"""ONNX Runtime's GroupQueryAttention (com.microsoft, CPU) as decode-attention peers of `pnmix bench decode`.

Each peer is a one-node graph built in memory with onnx.helper: one query token attending over a
BNSH cache of N tokens. The cache is a buffer of N positions shared by ``past_key`` and
``present_key`` through IO binding (ORT's past/present buffer sharing, what a generation loop
does), so a step writes the new token in place instead of copying the cache; the new token is the
cache's last one (``seqlens_k = N - 1``), so the step attends over exactly the N cached tokens.

Modes (``MODES``): a dense fp32 or fp16 cache, and ORT's quantized KV caches: int8 (signed,
symmetric) or int4 (two codes per byte, low nibble first, stored as code + 8), with one scale per
tensor or per (KV head, channel). The scales are fit here to the cache's K/V (max |x| / qmax).
A mode that ONNX Runtime cannot build or run is reported as skipped with its reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from pnmix.errors import describe


@dataclasses.dataclass(frozen=True)
class OrtMode:
    query: str             # "float32" or "float16": the query and output element type
    cache: str             # cache element type: float32, float16, int8 or uint8 (int4 pairs)
    bits: Optional[int] = None   # kv_cache_bit_width of a quantized cache
    quant: Optional[str] = None  # PER_TENSOR or PER_CHANNEL

    @property
    def codes_per_byte(self) -> int:
        return 2 if self.bits == 4 else 1


MODES = {
    "ort_gqa_fp32": OrtMode("float32", "float32"),
    "ort_gqa_fp16": OrtMode("float16", "float16"),
    "ort_gqa_int8": OrtMode("float32", "int8", 8, "PER_CHANNEL"),
    "ort_gqa_int4": OrtMode("float32", "uint8", 4, "PER_CHANNEL"),
    "ort_gqa_int8_tensor": OrtMode("float32", "int8", 8, "PER_TENSOR"),
    "ort_gqa_int4_tensor": OrtMode("float32", "uint8", 4, "PER_TENSOR"),
}
DENSE = ("ort_gqa_fp32", "ort_gqa_fp16")


class Unavailable(Exception):
    """The mode cannot run here (no onnx/onnxruntime, or the kernel refuses it), with the reason."""


def cache_bytes(mode: OrtMode, batch: int, kv_heads: int, seq_len: int, head_dim: int) -> int:
    """K and V cache bytes, plus the fp32 scales of a quantized cache."""
    codes = 2 * batch * kv_heads * seq_len * head_dim * np.dtype(mode.cache).itemsize // mode.codes_per_byte
    if mode.quant is None:
        return codes
    scales = 1 if mode.quant == "PER_TENSOR" else kv_heads * head_dim
    return codes + 2 * 4 * scales


def _scale_shape(mode: OrtMode, kv_heads: int, head_dim: int) -> list:
    return [1] if mode.quant == "PER_TENSOR" else [1, kv_heads, 1, head_dim]


def _graph(mode: OrtMode, batch: int, q_heads: int, kv_heads: int, seq_len: int, head_dim: int) -> bytes:
    from onnx import TensorProto, helper

    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int8": TensorProto.INT8,
            "uint8": TensorProto.UINT8}
    q_type, c_type = elem[mode.query], elem[mode.cache]
    cache_dim = head_dim // mode.codes_per_byte

    def tensor(name, kind, shape):
        return helper.make_tensor_value_info(name, kind, shape)

    inputs = [tensor("query", q_type, [batch, 1, q_heads * head_dim]),
              tensor("key", q_type, [batch, 1, kv_heads * head_dim]),
              tensor("value", q_type, [batch, 1, kv_heads * head_dim]),
              tensor("past_key", c_type, [batch, kv_heads, seq_len, cache_dim]),
              tensor("past_value", c_type, [batch, kv_heads, seq_len, cache_dim]),
              tensor("seqlens_k", TensorProto.INT32, [batch]),
              tensor("total_sequence_length", TensorProto.INT32, [])]
    names = [i.name for i in inputs]
    attrs: Dict[str, Any] = dict(num_heads=q_heads, kv_num_heads=kv_heads)
    if mode.quant:
        attrs.update(k_quant_type=mode.quant, v_quant_type=mode.quant, kv_cache_bit_width=mode.bits)
        shape = _scale_shape(mode, kv_heads, head_dim)
        inputs += [tensor("k_scale", TensorProto.FLOAT, shape), tensor("v_scale", TensorProto.FLOAT, shape)]
        # the optional inputs between total_sequence_length and k_scale stay empty
        names += ["", "", "", "", "", "k_scale", "v_scale"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", **attrs)
    outputs = [tensor("output", q_type, None), tensor("present_key", c_type, None),
               tensor("present_value", c_type, None)]
    model = helper.make_model(helper.make_graph([node], "gqa_decode", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9  # what every supported onnxruntime reads
    return model.SerializeToString()


def _quantize(mode: OrtMode, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [B, H, N, D] fp32 -> (codes as ORT stores them, scales of _scale_shape)."""
    qmax = 127 if mode.bits == 8 else 7
    axes = (0, 1, 2, 3) if mode.quant == "PER_TENSOR" else (0, 2)
    scale = (np.abs(x).max(axis=axes, keepdims=True) / qmax).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(x / scale), -qmax, qmax).astype(np.int16)
    if mode.bits == 8:
        codes = q.astype(np.int8)
    else:
        nibbles = (q + 8).astype(np.uint8)
        codes = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(codes), scale.reshape(-1 if mode.quant == "PER_TENSOR" else scale.shape)


def make_step(name: str, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, threads: int) -> Callable[[], torch.Tensor]:
    """The zero-argument decode step of peer ``name`` over k, v [B, H, N, D] and q [B, Hq, 1, D]
    (CPU); it returns the output [B, Hq, 1, D] as fp32. Raises Unavailable with the reason."""
    mode = MODES[name]
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise Unavailable(f"onnxruntime is not importable ({describe(exc)})") from None
    from pnmix.backends.onnxruntime.session import open_session, session_options
    batch, kv_heads, seq_len, head_dim = k.shape
    q_heads = q.shape[1]
    try:
        graph = _graph(mode, batch, q_heads, kv_heads, seq_len, head_dim)
        session = open_session(graph, session_options(threads, inter_op_threads=1))
    except Exception as exc:  # no onnx, or this onnxruntime lacks the op / mode
        raise Unavailable(f"onnxruntime {getattr(ort, '__version__', '?')} cannot build it: {describe(exc)}") from None
    kf, vf = k.float().numpy(), v.float().numpy()
    binding = session.io_binding()
    feeds = {"query": q.reshape(batch, 1, q_heads * head_dim), "key": k[:, :, -1].reshape(batch, 1, -1),
             "value": v[:, :, -1].reshape(batch, 1, -1)}
    for key, t in feeds.items():
        binding.bind_cpu_input(key, np.ascontiguousarray(t.float().numpy().astype(mode.query)))
    caches = []
    for side, x in (("key", kf), ("value", vf)):
        if mode.quant:
            codes, scale = _quantize(mode, x)
            binding.bind_cpu_input(f"{side[0]}_scale", scale)
        else:
            codes = np.ascontiguousarray(x.astype(mode.cache))
        cache = ort.OrtValue.ortvalue_from_numpy(codes)
        caches.append((codes, cache))  # the numpy array owns the buffer: keep it alive
        binding.bind_ortvalue_input(f"past_{side}", cache)
        binding.bind_ortvalue_output(f"present_{side}", cache)
    binding.bind_cpu_input("seqlens_k", np.full([batch], seq_len - 1, np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(seq_len, np.int32))
    binding.bind_output("output")

    def step() -> torch.Tensor:
        session.run_with_iobinding(binding)
        out = binding.get_outputs()[-1].numpy()
        return torch.from_numpy(out.astype(np.float32)).reshape(batch, q_heads, 1, head_dim)

    step.keep_alive = caches  # type: ignore[attr-defined]
    try:
        step()
    except Exception as exc:
        raise Unavailable(f"onnxruntime {ort.__version__}'s CPU kernel refuses it: {describe(exc)}") from None
    return step
