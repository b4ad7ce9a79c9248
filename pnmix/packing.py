"""Bit packing, dense and LSB-first (docs/FORMAT.md section 3.1): code i of a b-bit stream occupies
stream bits [i*b, (i+1)*b), and stream bit k is bit (k % 8) of byte k // 8; a code may straddle two
bytes (b = 3, 5, 6, 7). The pair mask is a 1-bit stream: bit ``h * P + p`` set when pair p of KV
head h is high (section 3.2). pnmix.format lays these streams out in the state tensors."""

from __future__ import annotations

import math

import torch

from .errors import PnMixError


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes [..., n] (each < 2**bits) into uint8 [..., n * bits / 8]."""
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise PnMixError(f"cannot pack {n} codes of {bits} bits densely into whole bytes")
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., n, bits]
    stream = stream.reshape(*codes.shape[:-1], n * bits // 8, 8)
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [..., n * bits / 8] -> uint8 codes [..., n]."""
    if packed.shape[-1] * 8 != n * bits:
        raise PnMixError(
            f"packed stream of {packed.shape[-1]} bytes does not hold {n} codes of {bits} bits"
        )
    raw = packed.to(torch.int32)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((raw.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], n, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.uint8)


def pack_pair_mask(high_pairs: torch.Tensor) -> torch.Tensor:
    """bool [B, H, P] -> uint8 [B, ceil(H*P/8)], bit h*P + p LSB-first."""
    batch = high_pairs.shape[0]
    flat = high_pairs.reshape(batch, -1).to(torch.uint8)
    nbits = flat.shape[1]
    padded = torch.zeros(batch, math.ceil(nbits / 8) * 8, dtype=torch.uint8, device=flat.device)
    padded[:, :nbits] = flat
    return pack_codes(padded, 1)


def unpack_pair_mask(mask_bytes: torch.Tensor, kv_heads: int, pairs: int) -> torch.Tensor:
    """uint8 [B, ceil(H*P/8)] -> bool [B, H, P]."""
    bits = unpack_codes(mask_bytes, 1, mask_bytes.shape[-1] * 8)
    return bits[:, : kv_heads * pairs].reshape(-1, kv_heads, pairs).bool()
