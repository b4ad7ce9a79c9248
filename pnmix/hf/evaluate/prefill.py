"""The full-precision prefill every method starts from, its hand-over into a method's fresh cache
and the one-token decode step that follows (docs/EVAL.md, Protocol)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional, Tuple

import torch

from ...errors import PnMixError


@dataclasses.dataclass
class Prefill:
    """The full-precision prefill every method starts from: per-layer K/V and the last logits."""

    kv: List[Tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor  # [vocab], the distribution after the prefill's last token

    @property
    def tokens(self) -> int:
        return self.kv[0][0].shape[2]


@torch.no_grad()
def run_prefill(model, ids: torch.Tensor, start: Optional[Prefill] = None) -> Prefill:
    """The prefill of ``ids`` [1, n] under a DynamicCache; ``start``: a prefill of the tokens before
    ids (a shared prefix: passkey trials at one depth share the filler before the key)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if start is not None:
        for layer_idx, (k, v) in enumerate(start.kv):
            cache.update(k, v, layer_idx)
    # logits_to_keep=1: the last position's logits only (all of them are 8192 x 49152 fp32 = 1.6 GB
    # for SmolLM2 at 8K).
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return Prefill(_layer_kv(cache), finite_logits(model, out.logits[0, -1].float(), "the prefill"))


def finite_logits(model, logits: torch.Tensor, where: str) -> torch.Tensor:
    """NaN logits are no distribution: every score made from them would be NaN, or an argmax of
    NaN (a passkey answer) would be scored as a wrong answer."""
    if bool(torch.isnan(logits).any()):
        name = getattr(model, "name_or_path", "") or "the model"
        raise PnMixError(f"{name}: {where} gave NaN logits; the model's weights or config are not finite numbers")
    return logits


def _layer_kv(cache) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K/V of a DynamicCache the prefill has filled (transformers types a layer's K/V
    as optional: empty before its first update, and absent from linear-attention layers)."""
    from transformers.cache_utils import DynamicLayer

    kv = []
    for layer_idx, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise PnMixError(f"the prefill left layer {layer_idx} ({type(layer).__name__}) without K/V")
        kv.append((layer.keys, layer.values))
    return kv


def hand_over_prefill(cache, kv: List[Tuple[torch.Tensor, torch.Tensor]], tokens: Optional[int] = None):
    """Fill an empty cache with a prefill's per-layer K/V (its first ``tokens``: the causal prefix of a
    longer prompt has the same K/V), one update per layer as the model's prefill call does; a
    PnMixCache then decodes under the pnmix attention, as a prefill call under it would mark."""
    from ..cache import PnMixCache

    for layer_idx, (k, v) in enumerate(kv):
        if tokens is not None and tokens != k.shape[2]:
            k, v = k[:, :, :tokens].clone(), v[:, :, :tokens].clone()
        cache.update(k, v, layer_idx)
    if isinstance(cache, PnMixCache):
        cache.mark_packed_attention()
    return cache


@contextlib.contextmanager
def attention(model, name: Optional[str]):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name or previous)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def decode_step(model, cache, token: int) -> torch.Tensor:
    """One forward call of one token; the next-token log-probabilities [vocab]."""
    ids = torch.tensor([[token]], dtype=torch.long, device=model.device)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
    return torch.log_softmax(finite_logits(model, logits.float(), "a decode step"), dim=-1)
