"""Triton kernels of the pn-mix packed cache, and their launchers.

Two jobs, both on the packed bytes of docs/FORMAT.md (sizes and offsets come from
pnmix.format.CacheLayout, never restated here):

* quantize + pack of new groups: keys per channel with the pair mask's mixed bit widths
  (``key_group_kernel``), values per token in blocks of ``vg`` channels (``value_fit_kernel``
  then ``value_pack_kernel``). Byte-identical to pnmix.reference: the fit follows
  pnmix/quant.py's rules (float64 sums for 1-bit codes, a correctly rounded fp32 division,
  saturating fp16 step and offset, round half to even).
* split-K attention over sink + packed groups + residual + new fp16 K/V, reading the codes
  directly (no dequantized copy): ``attend_partial_kernel`` runs an online softmax over its
  share of the keys for a block of (query, head) rows of one KV head; ``attend_reduce_kernel``
  merges the shares. Any number of queries, each with its causal limit; GQA by letting one
  program serve every query head of its KV head.

Runs compiled on a GPU, or on the CPU under ``TRITON_INTERPRET=1`` (set before triton is
imported), where larger blocks keep the interpreter's per-operation overhead down.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ..errors import PnMixError
from ..format import CacheLayout

# 2**23: for 0 <= y < 2**23, (y + 2**23) - 2**23 is y rounded half to even in fp32 (the ulp of
# numbers in [2**23, 2**24) is 1). libdevice.rint would do the same but the interpreter lacks it.
ROUND_MAGIC = tl.constexpr(8388608.0)


def interpreting() -> bool:
    """True when these kernels were built for Triton's CPU interpreter: triton.jit decides
    when this module is imported, from TRITON_INTERPRET=1 in the environment then."""
    return not isinstance(key_group_kernel, triton.runtime.JITFunction)


def interpreter_problem() -> Optional[str]:
    """Why the interpreter cannot run these kernels here, or None."""
    if isinstance(tl.sum, triton.runtime.JITFunction):
        # triton.language's own helpers were built for the compiler: the interpreter cannot
        # call them (TRITON_INTERPRET was set after triton had been imported)
        return "TRITON_INTERPRET=1 must be set before triton is first imported: set it before starting"
    # Triton < 3.7's interpreter turns loop bounds into Python ints in a way NumPy >= 2.4 rejects
    try:
        int(np.array([1]))
    except TypeError:
        if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
            return (f"triton {triton.__version__}'s interpreter does not work with numpy "
                    f"{np.__version__}: install triton>=3.7 for the cpu path")
    return None


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


# ---------------------------------------------------------------------------------------
# Fit and quantize (quant.py's rules, element-wise parts shared by keys and values)
# ---------------------------------------------------------------------------------------


@triton.jit
def _to_fp16_saturating(x):
    # where() keeps NaN (both comparisons are false), as torch's clamp does
    x = tl.where(x > 65504.0, 65504.0, x)
    x = tl.where(x < -65504.0, -65504.0, x)
    return x.to(tl.float16)


@triton.jit
def _fit(x, ok, one_bit, levels, n: tl.constexpr, AXIS: tl.constexpr,
         MINMAX: tl.constexpr, MEAN: tl.constexpr):
    """(step, offset) fp16 over AXIS of x (fp32; ok marks real elements, n of them per group).

    MINMAX / MEAN say which rules some group needs (b >= 2 / b == 1); one_bit picks per group.
    """
    if MEAN:
        # float64 sums: fp16 inputs sum exactly, so the mean does not depend on the order
        mu = (tl.sum(tl.where(ok, x, 0.0).to(tl.float64), axis=AXIS) / n).to(tl.float32)
        spread = tl.where(ok, tl.abs(x - tl.expand_dims(mu, AXIS)), 0.0)
        a = (tl.sum(spread.to(tl.float64), axis=AXIS) / n).to(tl.float32)
        step = _to_fp16_saturating(2.0 * a)
        offset = _to_fp16_saturating(mu - a)
    if MINMAX:
        lo = tl.min(tl.where(ok, x, float("inf")), axis=AXIS)
        hi = tl.max(tl.where(ok, x, float("-inf")), axis=AXIS)
        step_mm = _to_fp16_saturating(tl.math.div_rn(hi - lo, levels))
        offset_mm = _to_fp16_saturating(lo)
        if MEAN:
            step = tl.where(one_bit, step, step_mm)
            offset = tl.where(one_bit, offset, offset_mm)
        else:
            step = step_mm
            offset = offset_mm
    return step, offset


@triton.jit
def _quantize(x, step, offset, levels):
    """Codes (int32) of fp32 x with fp16 step/offset: round((x - offset) / step), clamped."""
    step32 = step.to(tl.float32)
    y = tl.math.div_rn(x - offset.to(tl.float32), tl.where(step32 == 0.0, 1.0, step32))
    # clamping to integer bounds before rounding gives the same code as after, and keeps y
    # inside the range where the magic-number rounding is exact
    y = tl.minimum(tl.maximum(y, 0.0), levels)
    q = ((y + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)
    return tl.where(step32 == 0.0, 0, q)


# ---------------------------------------------------------------------------------------
# Keys: one program per (group row, block of channels)
# ---------------------------------------------------------------------------------------


@triton.jit
def key_group_kernel(
    keys_ptr,  # fp16 [rows, GS, D]: the group's tokens
    bits_ptr,  # int32 [rows, D]: bits of each channel (pair mask)
    start_ptr,  # int32 [rows, D]: byte offset of each channel's stream in the group
    codes_ptr,  # uint8 [rows, KB]
    step_ptr, offset_ptr,  # fp16 [rows, D]
    D, KB,
    GS: tl.constexpr, GS_P: tl.constexpr, CB: tl.constexpr, SB_P: tl.constexpr,
    MINMAX: tl.constexpr, MEAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * CB + tl.arange(0, CB)
    ch_ok = ch < D
    tok = tl.arange(0, GS_P)
    ok = ch_ok[:, None] & (tok < GS)[None, :]
    group = keys_ptr + row * GS * D
    x = tl.load(group + tok[None, :] * D + ch[:, None], mask=ok, other=0.0).to(tl.float32)
    bits = tl.load(bits_ptr + row * D + ch, mask=ch_ok, other=1)
    levels = ((1 << bits) - 1).to(tl.float32)
    step, offset = _fit(x, ok, bits == 1, levels, GS, 1, MINMAX, MEAN)
    tl.store(step_ptr + row * D + ch, step, mask=ch_ok)
    tl.store(offset_ptr + row * D + ch, offset, mask=ch_ok)

    # Pack: byte j of channel c's stream holds stream bits 8j..8j+7, i.e. bit (s % b) of the
    # code of token s // b. The token is re-read and re-quantized where each bit needs it.
    j = tl.arange(0, SB_P)
    k = tl.arange(0, 8)
    stream_bit = j[None, :, None] * 8 + k[None, None, :]  # [1, SB_P, 8]
    b3 = bits[:, None, None]
    n_bytes = (GS * bits) // 8
    in_stream = ch_ok[:, None] & (j[None, :] < n_bytes[:, None])  # [CB, SB_P]
    token = stream_bit // b3
    xs = tl.load(group + token * D + ch[:, None, None], mask=in_stream[:, :, None], other=0.0)
    q = _quantize(xs.to(tl.float32), step[:, None, None], offset[:, None, None], levels[:, None, None])
    byte = tl.sum(((q >> (stream_bit % b3)) & 1) << k[None, None, :], axis=2)
    start = tl.load(start_ptr + row * D + ch, mask=ch_ok, other=0)
    tl.store(codes_ptr + row * KB + start[:, None] + j[None, :], byte.to(tl.uint8), mask=in_stream)


# ---------------------------------------------------------------------------------------
# Values: fit per (token, block of VG channels), then pack each token's stream
# ---------------------------------------------------------------------------------------


@triton.jit
def value_fit_kernel(
    values_ptr,  # fp16 [T, D]
    step_ptr, offset_ptr,  # fp16 [T, NVB]
    T,
    D: tl.constexpr, VG: tl.constexpr, VG_P: tl.constexpr, NVB: tl.constexpr, NVB_P: tl.constexpr,
    BITS: tl.constexpr, TB: tl.constexpr,
):
    tok = (tl.program_id(0) * TB + tl.arange(0, TB)).to(tl.int64)
    blk = tl.arange(0, NVB_P)
    e = tl.arange(0, VG_P)
    ok = (tok < T)[:, None, None] & (blk < NVB)[None, :, None] & (e < VG)[None, None, :]
    ptrs = values_ptr + tok[:, None, None] * D + blk[None, :, None] * VG + e[None, None, :]
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    levels = tl.full([TB, NVB_P], (1 << BITS) - 1, tl.float32)
    step, offset = _fit(x, ok, BITS == 1, levels, VG, 2, BITS >= 2, BITS == 1)
    where = tok[:, None] * NVB + blk[None, :]
    keep = (tok < T)[:, None] & (blk < NVB)[None, :]
    tl.store(step_ptr + where, step, mask=keep)
    tl.store(offset_ptr + where, offset, mask=keep)


@triton.jit
def value_pack_kernel(
    values_ptr,  # fp16 [T, D]
    step_ptr, offset_ptr,  # fp16 [T, NVB] (value_fit_kernel's output)
    codes_ptr,  # uint8 [T, VB]
    T,
    D: tl.constexpr, VG: tl.constexpr, NVB: tl.constexpr, VB: tl.constexpr, VB_P: tl.constexpr,
    BITS: tl.constexpr, TB: tl.constexpr,
):
    tok = (tl.program_id(0) * TB + tl.arange(0, TB)).to(tl.int64)
    j = tl.arange(0, VB_P)
    k = tl.arange(0, 8)
    keep = (tok < T)[:, None] & (j < VB)[None, :]  # [TB, VB_P]
    stream_bit = j[None, :, None] * 8 + k[None, None, :]  # [1, VB_P, 8]
    channel = stream_bit // BITS
    block = channel // VG
    m3 = keep[:, :, None]
    x = tl.load(values_ptr + tok[:, None, None] * D + channel, mask=m3, other=0.0).to(tl.float32)
    step = tl.load(step_ptr + tok[:, None, None] * NVB + block, mask=m3, other=0.0)
    offset = tl.load(offset_ptr + tok[:, None, None] * NVB + block, mask=m3, other=0.0)
    q = _quantize(x, step, offset, (1 << BITS) - 1.0)
    byte = tl.sum(((q >> (stream_bit % BITS)) & 1) << k[None, None, :], axis=2)
    tl.store(codes_ptr + tok[:, None] * VB + j[None, :], byte.to(tl.uint8), mask=keep)


# ---------------------------------------------------------------------------------------
# Launchers for the group quantizers: the signatures of pnmix.reference's, so that
# cache.append_reference can take either (see pnmix.backends.triton_ops.group_kernels)
# ---------------------------------------------------------------------------------------


def quantize_key_groups(keys: torch.Tensor, channel_bits: torch.Tensor, layout: CacheLayout):
    """keys fp16 [R, gs, D], bits [R, D] -> (packed uint8 [R, KB], step, offset fp16 [R, D])."""
    rows, gs, d = keys.shape
    cfg = layout.config
    keys = keys.contiguous()
    bits = channel_bits.to(device=keys.device, dtype=torch.int32).contiguous()
    start = layout.key_channel_offsets(bits).to(torch.int32).contiguous()
    packed = torch.empty(rows, layout.key_group_bytes, dtype=torch.uint8, device=keys.device)
    step = torch.empty(rows, d, dtype=torch.float16, device=keys.device)
    offset = torch.empty_like(step)
    if rows == 0:
        return packed, step, offset
    widths = {cfg.key_high_bits, cfg.key_low_bits}
    max_bits = max(widths)
    # the interpreter pays per operation, not per element: one program per row there
    cb = _pow2(d) if interpreting() else min(8, _pow2(d))
    grid = (rows, triton.cdiv(d, cb))
    key_group_kernel[grid](
        keys, bits, start, packed, step, offset, d, layout.key_group_bytes,
        GS=gs, GS_P=_pow2(gs), CB=cb, SB_P=_pow2(gs * max_bits // 8),
        MINMAX=max_bits >= 2, MEAN=1 in widths,
    )
    return packed, step, offset


def quantize_values(values: torch.Tensor, layout: CacheLayout):
    """values fp16 [..., D] -> (packed uint8 [..., VB], step, offset fp16 [..., D/vg])."""
    lead = values.shape[:-1]
    d = values.shape[-1]
    flat = values.reshape(-1, d).contiguous()
    tokens = flat.shape[0]
    vg, nvb, vb = layout.value_block, layout.value_blocks, layout.value_token_bytes
    bits = layout.config.value_bits
    packed = torch.empty(tokens, vb, dtype=torch.uint8, device=values.device)
    step = torch.empty(tokens, nvb, dtype=torch.float16, device=values.device)
    offset = torch.empty_like(step)
    if tokens:
        tb = min(_pow2(tokens), 256) if interpreting() else 16
        grid = (triton.cdiv(tokens, tb),)
        value_fit_kernel[grid](flat, step, offset, tokens, D=d, VG=vg, VG_P=_pow2(vg), NVB=nvb,
                               NVB_P=_pow2(nvb), BITS=bits, TB=tb)
        value_pack_kernel[grid](flat, step, offset, packed, tokens, D=d, VG=vg, NVB=nvb, VB=vb,
                                VB_P=_pow2(vb), BITS=bits, TB=tb)
    return packed.reshape(*lead, vb), step.reshape(*lead, nvb), offset.reshape(*lead, nvb)


# ---------------------------------------------------------------------------------------
# Attention over the packed cache: split-K partials, then a reduction
# ---------------------------------------------------------------------------------------


@triton.jit
def _read_codes(row_ptr, bit, bits, n_bytes, ok):
    """Codes of `bits` bits starting at stream bit `bit` of the byte rows at row_ptr
    (docs/FORMAT.md 3.1: a code may straddle two bytes; the second exists only inside the row)."""
    byte = bit >> 3
    lo = tl.load(row_ptr + byte, mask=ok, other=0).to(tl.int32)
    hi = tl.load(row_ptr + byte + 1, mask=ok & (byte + 1 < n_bytes), other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit & 7)) & ((1 << bits) - 1)


@triton.jit
def _group_tile(
    first, n_grouped, bh, d, d_ok, chan_bits, chan_start,
    key_codes, key_step, key_offset, value_codes, value_step, value_offset,
    G_CAP, KB, D: tl.constexpr, GS: tl.constexpr, VB: tl.constexpr, NVB: tl.constexpr,
    VG: tl.constexpr, BV: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Dequantized fp32 K and V [BLOCK_N, D_P] of grouped tokens first.. (group-major order)."""
    tok = first + tl.arange(0, BLOCK_N)  # index among all grouped tokens: g * GS + t
    ok = (tok < n_grouped)[:, None] & d_ok[None, :]
    t = (tok % GS)[:, None]
    # keys: channel c's stream starts at byte chan_start[c]; token t's code at bit t * bits(c)
    bit = chan_start[None, :] * 8 + t * chan_bits[None, :]
    if GS % BLOCK_N == 0:  # the unit lies in one group: its key row and parameters are shared
        group = bh * G_CAP + first // GS
        code = _read_codes(key_codes + group * KB, bit, chan_bits[None, :], KB, ok)
        step = tl.load(key_step + group * D + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        offset = tl.load(key_offset + group * D + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    else:
        group = (bh * G_CAP + tok // GS)[:, None]
        code = _read_codes(key_codes + group * KB, bit, chan_bits[None, :], KB, ok)
        step = tl.load(key_step + group * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        offset = tl.load(key_offset + group * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    k = offset + step * code.to(tl.float32)
    # values: one stream of D codes per token; block d // VG has its own step and offset
    token_row = bh * G_CAP * GS + tok.to(tl.int64)
    code = _read_codes(value_codes + token_row[:, None] * VB, d[None, :] * BV, BV, VB, ok)
    params = token_row[:, None] * NVB + (d // VG)[None, :]
    step = tl.load(value_step + params, mask=ok, other=0.0).to(tl.float32)
    offset = tl.load(value_offset + params, mask=ok, other=0.0).to(tl.float32)
    v = offset + step * code.to(tl.float32)
    return k, v


# lengths that change from one decode step to the next: no specialization (a new compile
# whenever one of them becomes 1 or a multiple of 16)
@triton.jit(do_not_specialize=["n_sink", "n_grouped", "n_residual", "n_new", "nq", "units_per_split",
                               "SPLITS"])
def attend_partial_kernel(
    q_ptr,  # [B, Hq, nq, D] contiguous, fp16 or bf16
    sink_k, sink_v, residual_k, residual_v,  # fp16 state [B, H, S_CAP or R_CAP, D]
    new_k, new_v,  # fp16 [B, H, n_new, D] contiguous
    key_codes, key_step, key_offset,  # state [B, H, G_CAP, KB] and [B, H, G_CAP, D]
    value_codes, value_step, value_offset,  # state [B, H, G_CAP, GS, VB] and [..., NVB]
    chan_bits, chan_start,  # int32 [B * H, D]: key bits and stream start of each channel
    part_acc, part_m, part_l,  # fp32 [B * H, SPLITS, M_PAD, D_P], [B * H, SPLITS, M_PAD]
    n_sink, n_grouped, n_residual, n_new, nq, units_per_split, scale,
    H, S_CAP, R_CAP, G_CAP, KB, M_PAD, SPLITS,
    REP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, GS: tl.constexpr,
    VB: tl.constexpr, NVB: tl.constexpr, VG: tl.constexpr, BV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // H
    h = bh % H

    # rows are (query i, head j of this KV head's group), queries outermost: limits grow with r
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = nq * REP
    r_ok = r < m_rows
    i = r // REP
    d = tl.arange(0, D_P)
    d_ok = d < D
    q_row = ((b * H + h) * REP + r % REP) * nq + i  # row of q viewed as [B * Hq * nq, D]
    q = tl.load(q_ptr + q_row[:, None] * D + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)
    n_keys = n_sink + n_grouped + n_residual + n_new
    limit = n_keys - nq + i  # query i sees keys 0..limit
    last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, m_rows) - 1
    block_limit = n_keys - nq + last_row // REP

    bits = tl.load(chan_bits + bh * D + d, mask=d_ok, other=1)
    start = tl.load(chan_start + bh * D + d, mask=d_ok, other=0)

    # units: BLOCK_N keys of one segment (sink, groups, residual, new); this split's share
    u_sink = tl.cdiv(n_sink, BLOCK_N)
    u_groups = u_sink + tl.cdiv(n_grouped, BLOCK_N)
    u_residual = u_groups + tl.cdiv(n_residual, BLOCK_N)
    u_all = u_residual + tl.cdiv(n_new, BLOCK_N)
    u_begin = split * units_per_split
    u_end = tl.minimum(u_begin + units_per_split, u_all)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for nth in range(0, units_per_split):  # a plain-int bound: older interpreters need one
        u = u_begin + nth
        in_groups = u >= u_sink
        in_residual = u >= u_groups
        in_new = u >= u_residual
        seg_unit = tl.where(in_new, u_residual, tl.where(in_residual, u_groups, tl.where(in_groups, u_sink, 0)))
        first = (u - seg_unit) * BLOCK_N  # first key of the unit within its segment
        pos0 = tl.where(in_new, n_keys - n_new, tl.where(in_residual, n_sink + n_grouped,
                                                          tl.where(in_groups, n_sink, 0)))
        seg_len = tl.where(in_new, n_new, tl.where(in_residual, n_residual,
                                                    tl.where(in_groups, n_grouped, n_sink)))
        # skip units past this split's share, and units that every row of the block masks out
        if (u < u_end) & (pos0 + first <= block_limit):
            if in_groups & (u < u_groups):
                k, v = _group_tile(first, n_grouped, bh, d, d_ok, bits, start,
                                   key_codes, key_step, key_offset, value_codes, value_step,
                                   value_offset, G_CAP, KB, D, GS, VB, NVB, VG, BV, BLOCK_N)
            else:
                if u < u_sink:
                    k_rows = sink_k + bh * S_CAP * D
                    v_rows = sink_v + bh * S_CAP * D
                elif u < u_residual:
                    k_rows = residual_k + bh * R_CAP * D
                    v_rows = residual_v + bh * R_CAP * D
                else:
                    k_rows = new_k + bh * n_new * D
                    v_rows = new_v + bh * n_new * D
                tok = first + cols
                ok = (tok < seg_len)[:, None] & d_ok[None, :]
                where = tok[:, None] * D + d[None, :]
                k = tl.load(k_rows + where, mask=ok, other=0.0).to(tl.float32)
                v = tl.load(v_rows + where, mask=ok, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            visible = ((first + cols) < seg_len)[None, :] & ((pos0 + first + cols)[None, :] <= limit[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # rows with nothing visible yet keep m = -inf; exponentiate against 0 to avoid NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new

    part = (bh * SPLITS + split) * M_PAD + r
    tl.store(part_m + part, m_i)
    tl.store(part_l + part, l_i)
    tl.store(part_acc + part[:, None] * D_P + d[None, :], acc)


@triton.jit(do_not_specialize=["nq", "SPLITS"])
def attend_reduce_kernel(
    part_acc, part_m, part_l, out_ptr,  # partials as above; out fp32 [B, Hq, nq, D]
    nq, H, M_PAD, SPLITS,
    REP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Merge the splits' online-softmax partials: weights exp(m_s - m) on l_s and acc_s."""
    bh = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_P)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(0, SPLITS):
        m = tl.maximum(m, tl.load(part_m + (bh * SPLITS + split) * M_PAD + r))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_M], tl.float32)  # the merged softmax denominator
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    for split in range(0, SPLITS):
        part = (bh * SPLITS + split) * M_PAD + r
        w = tl.exp(tl.load(part_m + part) - m_safe)
        denom += tl.load(part_l + part) * w
        acc += tl.load(part_acc + part[:, None] * D_P + d[None, :]) * w[:, None]
    out = acc / denom[:, None]
    b = bh // H
    h = bh % H
    i = r // REP
    out_row = ((b * H + h) * REP + r % REP) * nq + i
    ok = (r < nq * REP)[:, None] & (d < D)[None, :]
    tl.store(out_ptr + out_row[:, None] * D + d[None, :], out, mask=ok)


class AttendPlan:
    """Block sizes, split count and scratch of one attention call's shape (reusable)."""

    def __init__(self, layout: CacheLayout, seq_len: int, q_heads: int, nq: int, n_new: int,
                 device, block_n: Optional[int] = None, splits: Optional[int] = None):
        self.layout = layout
        self.lengths = layout.lengths(seq_len)
        self.rep = q_heads // layout.kv_heads
        self.nq, self.n_new = nq, n_new
        rows = nq * self.rep
        interp = interpreting()
        self.block_n = block_n or (128 if interp else _group_block(layout.config.group_size))
        self.block_m = min(_pow2(rows, 16), 128 if interp else 64)
        self.m_blocks = triton.cdiv(rows, self.block_m)
        n, gs = self.lengths, layout.config.group_size
        units = sum(triton.cdiv(x, self.block_n) for x in (n.sink, n.groups * gs, n.residual, n_new))
        units = max(units, 1)
        if splits is None:
            programs = layout.batch * layout.kv_heads * self.m_blocks
            # the interpreter runs programs one by one: two splits keep both passes exercised
            target = 2 if interp else triton.cdiv(2 * _sm_count(device), programs)
            splits = max(1, min(units, target))
        self.units_per_split = triton.cdiv(units, splits)
        self.splits = triton.cdiv(units, self.units_per_split)
        self.d_p = _pow2(layout.head_dim, 16)
        bh = layout.batch * layout.kv_heads
        m_pad = self.m_blocks * self.block_m
        self.part_acc = torch.empty(bh, self.splits, m_pad, self.d_p, dtype=torch.float32, device=device)
        self.part_m = torch.empty(bh, self.splits, m_pad, dtype=torch.float32, device=device)
        self.part_l = torch.empty_like(self.part_m)


def _group_block(group_size: int, most: int = 64) -> int:
    """Keys per unit on a GPU: a power of two dividing group_size (one group per unit, shared
    parameters) when one of at least 16 exists, else `most` (units then span groups)."""
    block = most
    while block >= 16:
        if group_size % block == 0:
            return block
        block //= 2
    return most


def _sm_count(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _check_state(layout: CacheLayout, state, device) -> None:
    """The kernels index the state tensors as dense arrays of the layout's shapes."""
    for name, shape in layout.state_shapes().items():
        t = state[name]
        if tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
            raise PnMixError(
                f"state tensor '{name}' must be a contiguous {list(shape)} tensor on {device}, "
                f"got {list(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
            )


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    # a zero-size tensor may have no storage to point at; kernels never read it (masks)
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def attend(plan: AttendPlan, q: torch.Tensor, state, channel_bits: torch.Tensor,
           channel_start: torch.Tensor, k_new: Optional[torch.Tensor] = None,
           v_new: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [B, Hq, nq, D]: the op semantics' attention, from the packed state.

    channel_bits / channel_start: int32 [B * H, D], each channel's key bits and stream byte
    offset (from the pair mask; constant for a sequence once the mask exists)."""
    layout, n, cfg = plan.layout, plan.lengths, plan.layout.config
    batch, q_heads, nq, d = q.shape
    _check_state(layout, state, q.device)
    q = q.contiguous()
    if k_new is None or v_new is None or plan.n_new == 0:  # both or neither (check_queries)
        k_new = v_new = state["sink_k"][:, :, :0]
    k_new = _nonempty(k_new.to(torch.float16).contiguous())
    v_new = _nonempty(v_new.to(torch.float16).contiguous())
    if out is None:
        out = torch.empty(batch, q_heads, nq, d, dtype=torch.float32, device=q.device)
    g_cap = layout.max_groups
    s = {name: _nonempty(t) for name, t in state.items()}
    m_pad = plan.m_blocks * plan.block_m
    attend_partial_kernel[(batch * layout.kv_heads, plan.m_blocks, plan.splits)](
        q, s["sink_k"], s["sink_v"], s["residual_k"], s["residual_v"], k_new, v_new,
        s["key_codes"], s["key_step"], s["key_offset"],
        s["value_codes"], s["value_step"], s["value_offset"],
        channel_bits, channel_start, plan.part_acc, plan.part_m, plan.part_l,
        n.sink, n.groups * cfg.group_size, n.residual, plan.n_new, nq, plan.units_per_split,
        1.0 / math.sqrt(d),
        layout.kv_heads, cfg.sink_tokens, cfg.residual_size, g_cap, layout.key_group_bytes,
        m_pad, plan.splits,
        REP=plan.rep, D=d, D_P=plan.d_p, GS=cfg.group_size, VB=layout.value_token_bytes,
        NVB=layout.value_blocks, VG=layout.value_block, BV=cfg.value_bits,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
    )
    attend_reduce_kernel[(batch * layout.kv_heads, plan.m_blocks)](
        plan.part_acc, plan.part_m, plan.part_l, out, nq, layout.kv_heads, m_pad, plan.splits,
        REP=plan.rep, D=d, D_P=plan.d_p, BLOCK_M=plan.block_m,
    )
    return out
