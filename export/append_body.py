"""The ONNX local-function body of PnMixAppend: quantize and append the new K/V into the packed state,
with the group flush and the pair mask on the first append. It follows pnmix/quant.py's bit-exact
rules, so the packed bytes equal ``pnmix.cache.append_reference`` byte for byte. Generated for one
layout; export/ops.py names the op, its inputs and attributes."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from pnmix.format import CacheLayout
from pnmix.model import pair_channels

from .graph import Body, bits_to_bytes, code_bit, to_int8
from .layout_graph import channel_bits, channel_start_bits, pair_high, scalar_lengths
from .ops import APPEND_INPUTS, APPEND_OP, APPEND_OUTPUTS, GROUP_STATE, STATE_ONNX_TYPES, function_proto


def append_function(layout: CacheLayout, opset: int) -> onnx.FunctionProto:
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    g, s, r = layout.max_groups, cfg.sink_tokens, cfg.residual_size
    b = Body("app")
    seq_len, new_len = "seq_len", "new_len"
    end = b.op("Add", seq_len, new_len)
    sink0, groups0, res0 = scalar_lengths(b, seq_len, cfg)
    sink1, groups1, res1 = scalar_lengths(b, end, cfg)
    into_sink = b.op("Sub", sink1, sink0)
    new_groups = b.op("Sub", groups1, groups0)
    axis2 = b.const([2])
    # Only the first new_len tokens are appended (new_len 0: evaluation, nothing changes).
    k_add = b.op("Slice", "k_new", b.const([0]), b.op("Unsqueeze", new_len, b.const([0])), axis2)
    v_add = b.op("Slice", "v_new", b.const([0]), b.op("Unsqueeze", new_len, b.const([0])), axis2)

    # The pair mask: computed from the keys of the first append into an empty cache.
    first = b.and_(b.op("Equal", seq_len, b.const(0)), b.op("Greater", new_len, b.const(0)))
    [mask] = b.if_(first, lambda t: [to_int8(t, _saliency_mask(t, k_add, layout))],
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
        high = pair_high(t, mask, layout)
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
    return function_proto(APPEND_OP, APPEND_INPUTS, APPEND_OUTPUTS, b.nodes, opset)


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
    return bits_to_bytes(b, bits, b.const([bsz, layout.mask_bytes, 8]))


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
    key_bits = channel_bits(b, high, cfg)
    start = channel_start_bits(b, key_bits, layout)  # [B, H, D]
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
    bit = code_bit(b, b.op("Unsqueeze", by_channel, b.const([5])), i)  # [B, H, ng, D, gs, widest]
    stream_shape = b.shape_of(b.const([bsz, h]), ng1, b.const([nbits + 1]))
    empty = b.op("ConstantOfShape", stream_shape, value=numpy_helper.from_array(np.zeros(1, np.int32)))
    stream = b.op("ScatterElements", empty, b.op("Expand", target, updates_shape),
                  b.op("Reshape", bit, updates_shape), axis=3)
    bit = b.op("Slice", stream, b.const([0]), b.const([nbits]), b.const([3]))
    byte_values = bits_to_bytes(b, bit, b.shape_of(b.const([bsz, h]), ng1, b.const([layout.key_group_bytes, 8])))
    squeeze = b.const([3])
    return (to_int8(b, byte_values), b.op("Squeeze", step, squeeze), b.op("Squeeze", offset, squeeze))


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
    bit = code_bit(b, code, b.const(k % bv))
    shape = b.shape_of(b.const([bsz, h]), ng1, b.const([gs, layout.value_token_bytes, 8]))
    squeeze = b.const([5])
    return (to_int8(b, bits_to_bytes(b, bit, shape)), b.op("Squeeze", step, squeeze),
            b.op("Squeeze", offset, squeeze))


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
