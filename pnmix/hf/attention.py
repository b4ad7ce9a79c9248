"""The `pnmix` attention implementation: attention that reads the packed cache in place.

Registered with transformers' AttentionInterface under ATTENTION_NAME; select it with
``from_pretrained(..., attn_implementation="pnmix")`` or ``model.set_attn_implementation("pnmix")``.
With a PnMixCache, a decode step's update hands over the new tokens only and this function calls
the backend's ``attend`` (queries over the packed cache followed by the new fp16 K/V, docs/METHOD.md
section 2.4), then the layer appends them. No dequantized copy of the cache reaches the model. The
prefill has nothing packed to read: it is SDPA over the prompt's own K/V (full precision), and it
is what puts the layer on the packed path.

The kernels apply causality themselves (the queries are the last positions); the mask transformers
builds (SDPA's mask function, registered under the same name) is only checked: padding is refused.
With any other cache (or none) this is transformers' SDPA attention over the K/V it is given.
"""

from __future__ import annotations

import math

import torch

from ..errors import PnMixError
from ._deps import require_transformers
from .cache import COMPILE_REASON, take_step
from .models import pair_layout_for

ATTENTION_NAME = "pnmix"


@torch.compiler.disable(reason=COMPILE_REASON)  # the kernels run eagerly (PnMixCache.update says why)
def pnmix_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention signature: query [B, Hq, nq, D], key/value [B, H, N, D] ->
    (output [B, nq, Hq, D] in the query's dtype, None)."""
    step = take_step(key)
    if step is not None:
        _check_step(module, step, attention_mask, query.shape[2], kwargs)
        if step.seq_before == 0:
            step.layer.packed_attention = True  # this layer's decode steps hand over the packed cache
    if step is None or not step.pending:
        # A prefill (full precision over the prompt's own K/V: nothing packed to read), another
        # cache's K/V, or a dequantized copy: SDPA with the model's mask.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    head_dim = query.shape[-1]
    # The kernels scale by 1/sqrt(D); a model with another scale gets it folded into the queries.
    if scaling is not None and not math.isclose(scaling * math.sqrt(head_dim), 1.0, rel_tol=1e-6):
        query = query * (scaling * math.sqrt(head_dim))
    out = step.layer.attend_pending(query)  # fp32 [B, Hq, nq, D], the queries rounded to fp16
    if query.dtype != torch.float32:
        out = out.to(query.dtype)
    # [B, nq, Hq, D]: one query's transpose is already contiguous (each torch call costs a decode
    # step's layer microseconds, its code out of the caches after the layer's matrix products)
    out = out.transpose(1, 2)
    return (out if out.shape[1] == 1 else out.contiguous()), None


def _check_step(module, step, attention_mask, nq: int, kwargs) -> None:
    """What the kernels cannot do is refused before the step runs."""
    if kwargs.get("softcap") is not None:
        raise PnMixError("the pnmix attention does not support softcapped attention scores")
    window = kwargs.get("sliding_window")
    if window is not None and step.seq_before + nq > window:
        # Within the window, sliding attention is full causal attention; past it the cache would
        # have to drop tokens, which pn-mix never does.
        raise PnMixError(f"the sequence ({step.seq_before + nq} tokens) is longer than the model's sliding "
                         f"window ({window}): the pnmix attention supports full causal attention only")
    want = pair_layout_for(getattr(module, "config", None))
    if step.layer.config.pair_layout != want:
        raise PnMixError(
            f"PnMixCache pair_layout '{step.layer.config.pair_layout}' contradicts this model's RoPE pairs ('{want}')"
        )
    if attention_mask is None:
        return
    # The kernels apply plain causality over each row's own cache; a mask that hides anything else
    # (padding the cache did not see at the prefill) is refused.
    kv = step.seq_before + nq
    expected = step.layer.expected_mask(kv, nq, attention_mask.device)
    if (attention_mask.dtype != torch.bool or attention_mask.shape[-2:] != expected.shape[-2:]
            or not bool((attention_mask == expected).all())):
        raise PnMixError("the pnmix attention: the attention mask hides more than the causal future and the "
                         "padding of the batch's prefill (padding added later?)")


def register() -> None:
    """Register ATTENTION_NAME with transformers' attention and mask interfaces (idempotent).

    The mask function is SDPA's, so this function sees padding and can refuse it."""
    transformers = require_transformers()
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    transformers.AttentionInterface.register(ATTENTION_NAME, pnmix_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
