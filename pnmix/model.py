"""The diagnostic model (docs/METHOD.md section 4.1): one layer, byte vocabulary, RoPE, GQA.

The token -> q/k/v projection is linear in the embedding, so the model keeps it as three
fp32 tables of 256 rows (``emb.weight @ W.T``), computed once. Every backend (torch, ONNX,
TensorRT) then gathers the very same fp32 numbers and applies RoPE with the same fp32
element-wise arithmetic, so the fp16 K/V that reach the cache are bit-identical everywhere;
a GEMM in another library would round differently and break packed-byte comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from .format import channel_pairs

VOCAB = 256
D_MODEL = 128
Q_HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
ROPE_BASE = 10000.0
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # the seeds torch.manual_seed takes


def rope_tables(max_positions: int, head_dim: int = HEAD_DIM, base: float = ROPE_BASE):
    """fp32 (cos, sin) [max_positions, D/2]; angles in float64 so the table is exact to fp32."""
    pairs = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = base ** (-2.0 * pairs / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64).unsqueeze(-1) * inv_freq
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def pair_channels(head_dim: int, pair_layout: str):
    """(first, second) channel index of each pair."""
    pair_of = channel_pairs(head_dim, pair_layout)
    first = torch.zeros(head_dim // 2, dtype=torch.long)
    second = torch.zeros(head_dim // 2, dtype=torch.long)
    for channel in reversed(range(head_dim)):
        first[pair_of[channel]] = channel
    for channel in range(head_dim):
        second[pair_of[channel]] = channel
    return first, second


@lru_cache(maxsize=None)
def rope_indices(head_dim: int, pair_layout: str):
    """(first, second, order): each pair's channels, and the permutation from [firsts, seconds]
    back to channel order. Cached: the exporter computes them before tracing, so the traced graph
    holds them as constants (torch.export cannot trace pair_channels' indexing)."""
    first, second = pair_channels(head_dim, pair_layout)
    return first, second, torch.argsort(torch.cat((first, second)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pair_layout: str) -> torch.Tensor:
    """x fp32 [..., n, D], cos/sin [n, D/2]: rotate each pair (a, b) by its angle.

    Written as gathers, element-wise ops and one concatenation (no in-place indexing) so that the
    exporter traces this very function into the ONNX file: one definition of the arithmetic."""
    first, second, order = (t.to(x.device) for t in rope_indices(x.shape[-1], pair_layout))
    a, b = x.index_select(-1, first), x.index_select(-1, second)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).index_select(-1, order)


def project(tables, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pair_layout: str) -> "QKV":
    """tokens int64 [B, n] with their positions' cos/sin [n, D/2] -> fp16 q, k, v (head-major).

    The model's whole token-to-cache path; DiagnosticModel.qkv calls it and the exporter traces it."""
    tq, tk, tv = tables
    batch = tokens.shape[0]

    def heads(table, count):
        rows = nn.functional.embedding(tokens, table)  # [B, n, count*D]
        return rows.reshape(batch, -1, count, HEAD_DIM).transpose(1, 2)

    q = apply_rope(heads(tq, Q_HEADS), cos, sin, pair_layout)
    k = apply_rope(heads(tk, KV_HEADS), cos, sin, pair_layout)
    return QKV(q.half(), k.half(), heads(tv, KV_HEADS).half())


@dataclass
class QKV:
    """fp16 projections, head-major: q [B, Hq, n, D], k and v [B, H, n, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class DiagnosticModel(nn.Module):
    def __init__(self, seed: int, pair_layout: str = "adjacent"):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.q_proj = nn.Linear(D_MODEL, Q_HEADS * HEAD_DIM, bias=False)
            self.k_proj = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM, bias=False)
            self.v_proj = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM, bias=False)
            self.o_proj = nn.Linear(Q_HEADS * HEAD_DIM, D_MODEL, bias=False)
        self.pair_layout = pair_layout
        self.requires_grad_(False)

    @torch.no_grad()
    def token_tables(self):
        """fp32 [256, heads*D] q, k, v rows of every byte token."""
        e = self.emb.weight
        return e @ self.q_proj.weight.T, e @ self.k_proj.weight.T, e @ self.v_proj.weight.T

    @torch.no_grad()
    def qkv(self, tokens: torch.Tensor, start: int, tables=None) -> QKV:
        """tokens int64 [B, n] at positions start..start+n-1 -> fp16 q, k, v."""
        tables = tables if tables is not None else self.token_tables()
        cos, sin = rope_tables(start + tokens.shape[1])
        return project(tables, tokens, cos[start:].to(tokens.device), sin[start:].to(tokens.device),
                       self.pair_layout)
