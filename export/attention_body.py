"""The ONNX local-function body of PnMixAttention: attention of q over the packed cache plus the new
fp16 K/V, equal to pnmix.reference's attention. Generated for one layout (shapes such as the group
size are part of the body); export/ops.py names the op, its inputs and attributes."""

from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np
import onnx
from onnx import TensorProto

from pnmix.format import CacheLayout

from .graph import Body, byte_pairs, float_codes, unsigned_float
from .layout_graph import channel_bits, channel_start_bits, pair_high, scalar_lengths
from .ops import ATTENTION_INPUTS, ATTENTION_OP, ATTENTION_OUTPUTS, GROUP_STATE, function_proto


def attention_function(layout: CacheLayout, q_heads: int, opset: int) -> onnx.FunctionProto:
    cfg = layout.config
    bsz, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, cfg.group_size
    s, r = cfg.sink_tokens, cfg.residual_size
    rep = q_heads // h
    b = Body("att")
    f32 = TensorProto.FLOAT
    seq_len, new_len = "seq_len", "new_len"
    n_sink, n_groups, n_residual = scalar_lengths(b, seq_len, cfg)
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

    high = pair_high(b, "pair_mask", layout)
    group_scores = _group_scores(b, layout, q, rep, channel_bits(b, high, cfg), high, used, ng1)
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
    return function_proto(ATTENTION_OP, ATTENTION_INPUTS, ATTENTION_OUTPUTS, b.nodes, opset)


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
    data = unsigned_float(b, used["key_codes"])  # [B, H, ng, KB]
    if _straddles(cfg.key_high_bits, cfg.key_low_bits):
        data = byte_pairs(b, data, 3, layout.key_group_bytes, b.shape_of(b.const([bsz, h]), ng1, b.const([1])))
    byte, inverse_pow2, modulus = (b.op("Reshape", x, per_code) for x in _key_code_positions(b, layout, key_bits, high))
    index = b.op("Expand", byte, b.shape_of(b.const([bsz, h]), ng1, b.const([d * gs])))
    word = b.op("GatherElements", data, index, axis=3)  # [B, H, ng, D*gs]
    codes = float_codes(b, b.op("Mul", word, inverse_pow2), modulus)
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
    start = channel_start_bits(b, key_bits, layout)  # [B, H, D], a multiple of 8
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
        data = unsigned_float(b, used["value_codes"])  # [B, H, ng, gs, VB]
        pairs = byte_pairs(b, data, 4, layout.value_token_bytes, b.shape_of(b.const([bsz, h]), ng1, b.const([gs, 1])))
        word = b.op("Gather", pairs, b.const(bit // 8), axis=4)
        codes = float_codes(b, b.op("Mul", word, b.const(2.0 ** -(bit % 8), np.float32)),
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
