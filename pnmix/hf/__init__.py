"""pn-mix in Hugging Face transformers 5.x (docs/HF.md).

* ``PnMixCache``: transformers' Cache with one packed pn-mix cache per layer; pass it to
  ``model.generate(..., cache=PnMixCache())`` or to forward calls (``past_key_values=``, the older
  name, warns from transformers 5.25 on).
* the ``pnmix`` attention implementation (registered on import): reads the packed cache through
  the backend kernels instead of a dequantized copy.
* ``pnmix eval`` (pnmix.hf.evaluate.command): KV-cache methods (pn-mix, KIVI, uniform, quanto) on a real model,
  scored against full precision: KL, perplexity, top-1, passkey retrieval (docs/EVAL.md).
"""

from .attention import ATTENTION_NAME, pnmix_attention_forward, register
from .cache import PnMixCache, PnMixLayer
from .models import pair_layout_for

register()

__all__ = ["PnMixCache", "PnMixLayer", "ATTENTION_NAME", "pnmix_attention_forward", "pair_layout_for", "register"]
