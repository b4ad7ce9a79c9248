"""PyTorch reference kernels: saliency, quantize+pack a group, unpack+dequantize, attention.

Clear code first: every other backend (Triton, the C++ core, CUDA, ONNX, TensorRT) is
compared with these functions byte for byte (packed state) and within a tolerance (attention).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from . import quant
from .format import CacheLayout, channel_pairs
from .packing import unpack_pair_mask

State = Dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------
# Saliency
# ---------------------------------------------------------------------------------------


def pair_energy(keys: torch.Tensor, pair_layout: str) -> torch.Tensor:
    """keys fp16 [B, H, n, D] -> float64 [B, H, P]: sum over tokens of both channels squared."""
    head_dim = keys.shape[-1]
    squares = keys.to(torch.float64).square().sum(dim=2)  # [B, H, D]
    pair_of = channel_pairs(head_dim, pair_layout).to(keys.device)
    energy = torch.zeros(*squares.shape[:-1], head_dim // 2, dtype=torch.float64, device=keys.device)
    return energy.index_add_(-1, pair_of, squares)


def saliency_mask(keys: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """bool [B, H, P]: the n_high pairs of largest energy, ties to the lower pair index."""
    energy = pair_energy(keys, layout.config.pair_layout)
    # NaN energy (non-finite keys) ranks lowest so the choice stays deterministic.
    energy = torch.nan_to_num(energy, nan=-math.inf)
    order = torch.argsort(energy, dim=-1, descending=True, stable=True)
    n_high = layout.config.high_pairs(layout.head_dim)
    high = torch.zeros_like(energy, dtype=torch.bool)
    return high.scatter_(-1, order[..., :n_high], True)


# ---------------------------------------------------------------------------------------
# Keys: one code group per (KV head, channel) over a group's tokens
# ---------------------------------------------------------------------------------------


def quantize_key_groups(
    keys: torch.Tensor, channel_bits: torch.Tensor, layout: CacheLayout
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys fp16 [R, gs, D] (R rows of groups), bits [R, D] ->
    (packed uint8 [R, key_group_bytes], step fp16 [R, D], offset fp16 [R, D])."""
    by_channel = keys.transpose(-1, -2)  # [R, D, gs]: a channel's group is the last dim
    step = torch.zeros(by_channel.shape[:-1], dtype=torch.float16, device=keys.device)
    offset = torch.zeros_like(step)
    codes = torch.zeros(by_channel.shape, dtype=torch.uint8, device=keys.device)
    for bits in torch.unique(channel_bits).tolist():
        select = channel_bits == bits
        s, o = quant.choose_qparams(by_channel[select], bits)
        step[select], offset[select] = s, o
        codes[select] = quant.quantize(by_channel[select], s, o, bits)
    return layout.pack_key_group(codes, channel_bits), step, offset


def dequantize_key_groups(
    packed: torch.Tensor, step: torch.Tensor, offset: torch.Tensor, channel_bits: torch.Tensor,
    layout: CacheLayout,
) -> torch.Tensor:
    """Inverse of quantize_key_groups -> fp32 [R, gs, D]."""
    codes = layout.unpack_key_group(packed, channel_bits)  # [R, D, gs]
    return quant.dequantize(codes, step, offset).transpose(-1, -2)


# ---------------------------------------------------------------------------------------
# Values: one code group per (token, KV head, block of vg channels)
# ---------------------------------------------------------------------------------------


def quantize_values(values: torch.Tensor, layout: CacheLayout):
    """values fp16 [..., D] -> (packed uint8 [..., VB], step, offset fp16 [..., D/vg])."""
    blocks = values.reshape(*values.shape[:-1], layout.value_blocks, layout.value_block)
    bits = layout.config.value_bits
    step, offset = quant.choose_qparams(blocks, bits)
    codes = quant.quantize(blocks, step, offset, bits).reshape(values.shape)
    return layout.pack_value_tokens(codes), step, offset


def dequantize_values(packed, step, offset, layout: CacheLayout) -> torch.Tensor:
    codes = layout.unpack_value_tokens(packed)
    blocks = codes.reshape(*codes.shape[:-1], layout.value_blocks, layout.value_block)
    return quant.dequantize(blocks, step, offset).reshape(codes.shape)


# ---------------------------------------------------------------------------------------
# The whole cache, dequantized (for metrics and the reference attention)
# ---------------------------------------------------------------------------------------


def state_channel_bits(layout: CacheLayout, state: State) -> torch.Tensor:
    """int32 [B, H, D] key bits per channel from the stored pair mask."""
    high = unpack_pair_mask(state["pair_mask"], layout.kv_heads, layout.pairs)
    return layout.channel_bits(high)


def dequantize_cache(layout: CacheLayout, state: State, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(K, V) fp32 [B, H, seq_len, D] in cache order: sink, groups (oldest first), residual."""
    n = layout.lengths(seq_len)
    b, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, layout.config.group_size
    parts_k = [state["sink_k"][:, :, : n.sink].float()]
    parts_v = [state["sink_v"][:, :, : n.sink].float()]
    if n.groups:
        bits = state_channel_bits(layout, state)  # [B, H, D]
        rows_bits = bits.unsqueeze(2).expand(b, h, n.groups, d).reshape(-1, d)
        k = dequantize_key_groups(
            state["key_codes"][:, :, : n.groups].reshape(-1, layout.key_group_bytes),
            state["key_step"][:, :, : n.groups].reshape(-1, d),
            state["key_offset"][:, :, : n.groups].reshape(-1, d),
            rows_bits, layout,
        )
        v = dequantize_values(
            state["value_codes"][:, :, : n.groups], state["value_step"][:, :, : n.groups],
            state["value_offset"][:, :, : n.groups], layout,
        )
        parts_k.append(k.reshape(b, h, n.groups * gs, d))
        parts_v.append(v.reshape(b, h, n.groups * gs, d))
    parts_k.append(state["residual_k"][:, :, : n.residual].float())
    parts_v.append(state["residual_v"][:, :, : n.residual].float())
    return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------


def attention_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_probs: bool = False
):
    """Causal GQA attention in fp32. q [B, Hq, nq, D]; k, v [B, H, N, D].

    The nq queries are the LAST nq positions of the N keys: query i sits at N - nq + i and sees
    keys 0..N - nq + i. Returns fp32 [B, Hq, nq, D] (and the probabilities if asked).
    """
    batch, q_heads, nq, head_dim = q.shape
    kv_heads, n_keys = k.shape[1], k.shape[2]
    repeat = q_heads // kv_heads
    k32 = k.float().repeat_interleave(repeat, dim=1)
    v32 = v.float().repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q.float(), k32.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))
    positions = torch.arange(n_keys - nq, n_keys, device=q.device).unsqueeze(-1)
    visible = torch.arange(n_keys, device=q.device).unsqueeze(0) <= positions
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v32)
    return (out, probs) if return_probs else out


def attend(
    q: torch.Tensor,
    layout: CacheLayout,
    state: State,
    seq_len: int,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    return_probs: bool = False,
):
    """Attention of q over the packed cache (seq_len tokens) followed by new fp16 K/V.

    This is the op semantics every backend implements: the cache is read as stored (sink and
    residual in fp16, groups dequantized) and the new tokens, not yet appended, in fp16. For a
    prefill the cache is empty and this is full-precision causal attention over the prompt.
    """
    k_cache, v_cache = dequantize_cache(layout, state, seq_len)
    if k_new is not None and v_new is not None and k_new.shape[2]:  # both or neither (check_queries)
        k_cache = torch.cat([k_cache, k_new.float()], dim=2)
        v_cache = torch.cat([v_cache, v_new.float()], dim=2)
    return attention_dense(q, k_cache, v_cache, return_probs=return_probs)
