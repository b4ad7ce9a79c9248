"""The cache layout inside a function body: the token counts of a cache (docs/FORMAT.md section 2),
the pair mask read as high channels (section 3.2) and the key bits per channel with the stream bit
where each channel starts (section 3.3). Both bodies read the state through these."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from pnmix.config import PnMixConfig
from pnmix.format import CacheLayout, channel_pairs

from .graph import Body, code_bit, unsigned


def scalar_lengths(b: Body, n_tokens: str, cfg: PnMixConfig) -> Tuple[str, str, str]:
    """(n_sink, n_groups, n_residual) of a cache of n_tokens (int64 scalar): FORMAT.md section 2."""
    sink = b.op("Min", n_tokens, b.const(cfg.sink_tokens))
    rest = b.op("Sub", n_tokens, sink)
    over = b.op("Max", b.op("Sub", rest, b.const(cfg.residual_size)), b.const(0))
    full = b.op("Add", b.op("Div", over, b.const(cfg.group_size)), b.const(1))
    groups = b.where(b.op("GreaterOrEqual", rest, b.const(cfg.residual_size)), full, b.const(0))
    residual = b.op("Sub", rest, b.op("Mul", groups, b.const(cfg.group_size)))
    return sink, groups, residual


def pair_high(b: Body, pair_mask: str, layout: CacheLayout) -> str:
    """pair_mask INT8 [B, MB] -> bool [B, H, D]: whether each channel's pair is high."""
    h, p, d = layout.kv_heads, layout.pairs, layout.head_dim
    mask = unsigned(b, pair_mask)
    k = np.arange(h * p)
    byte = b.op("Gather", mask, b.const(k // 8), axis=1)  # [B, H*P]
    bit = code_bit(b, byte, b.const(k % 8))
    high_pairs = b.op("Reshape", bit, b.const([layout.batch, h, p]))
    pair_of = channel_pairs(d, layout.config.pair_layout).numpy()
    high_channels = b.op("Gather", high_pairs, b.const(pair_of), axis=2)  # [B, H, D]
    return b.op("Equal", high_channels, b.const(1, np.int32))


def channel_bits(b: Body, high: str, cfg: PnMixConfig) -> str:
    """bool [B, H, D] -> int32 key bits per channel."""
    return b.where(high, b.const(cfg.key_high_bits, np.int32), b.const(cfg.key_low_bits, np.int32))


def channel_start_bits(b: Body, bits: str, layout: CacheLayout) -> str:
    """int32 [B, H, D] bits -> stream bit where each channel's codes start in a key group:
    gs * sum(bits of the channels before it), as a masked sum (no CumSum needed)."""
    d = layout.head_dim
    before = (np.arange(d)[None, :] < np.arange(d)[:, None]).astype(np.int32)  # [c, c']
    spread = b.op("Mul", b.op("Unsqueeze", bits, b.const([2])), b.const(before, np.int32))
    total = b.op("ReduceSum", spread, b.const([-1]), keepdims=0)  # [B, H, D]
    return b.op("Mul", total, b.const(layout.config.group_size, np.int32))
