"""Affine quantization primitives (docs/METHOD.md section 3.4), bit-exact rules.

Three named primitives, the group always being the LAST dimension of the input:
``choose_qparams`` (fit step and offset), ``quantize`` and ``dequantize``. Keys and values,
any bit width, call these same three functions.

The exact arithmetic (every backend follows it to produce the same bytes):
* b >= 2: offset = fp16(min), step = fp16(fp32(max - min) / (2^b - 1)).
* b == 1: mu = fp32(sum_f64(x) / n), a = fp32(sum_f64(fp32(|x - mu|)) / n),
  offset = fp16(mu - a), step = fp16(2a), subtraction and doubling in fp32.
* fp16(.) saturates at +-65504, so finite inputs never give an infinite step or offset.
* q = clamp(round_half_even(fp32(x - offset) / step), 0, 2^b - 1), and q = 0 where step == 0.
* dequantized x = fp32(offset) + fp32(step) * q, in fp32.
"""

from __future__ import annotations

from typing import Tuple

import torch

FP16_MAX = 65504.0


def to_fp16_saturating(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16, rounding to nearest even and saturating at +-65504 (NaN stays NaN)."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def choose_qparams(x: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fit (step, offset), both fp16, over the last dimension of x (fp16 values)."""
    x32 = x.to(torch.float32)
    if bits >= 2:
        lo = x32.amin(dim=-1)
        hi = x32.amax(dim=-1)
        step = to_fp16_saturating((hi - lo) / float(2**bits - 1))
        return step, to_fp16_saturating(lo)
    n = x.shape[-1]
    mu = (x.to(torch.float64).sum(dim=-1) / n).to(torch.float32)
    spread = (x32 - mu.unsqueeze(-1)).abs()
    a = (spread.to(torch.float64).sum(dim=-1) / n).to(torch.float32)
    return to_fp16_saturating(2.0 * a), to_fp16_saturating(mu - a)


def quantize(x: torch.Tensor, step: torch.Tensor, offset: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., n] with step/offset [...] -> uint8 codes [..., n]."""
    step32 = step.to(torch.float32).unsqueeze(-1)
    offset32 = offset.to(torch.float32).unsqueeze(-1)
    q = torch.round((x.to(torch.float32) - offset32) / step32)
    q = q.clamp(0, 2**bits - 1)
    q = torch.where(step32 == 0, torch.zeros_like(q), q)
    return q.to(torch.uint8)


def dequantize(codes: torch.Tensor, step: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] with step/offset [...] -> fp32 [..., n]."""
    return offset.to(torch.float32).unsqueeze(-1) + step.to(torch.float32).unsqueeze(-1) * codes.to(
        torch.float32
    )
