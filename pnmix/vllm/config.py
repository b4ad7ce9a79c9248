"""The pn-mix config a vLLM engine runs with, and the start-up checks (docs/VLLM.md section 4).

No vLLM import here: the plugin, the backend and the tests share these functions.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..config import PnMixConfig, read_json_file
from ..errors import PnMixError
from ..hf.models import SUPPORTED_MODEL_TYPES, resolve_config
from .paged import PageLayout

BACKEND_NAME = "pn-mix"  # how errors name the backend (vLLM selects it as CUSTOM: plugin.py)
CONFIG_ENV = "PNMIX_VLLM_CONFIG"  # a JSON file of config fields, as `pnmix verify --config` takes


def file_fields(path: Optional[str] = None) -> dict:
    """The config fields of the file named by ``path`` or $PNMIX_VLLM_CONFIG ({} when neither)."""
    path = path if path is not None else os.environ.get(CONFIG_ENV) or None
    if path is None:
        return {}
    fields = read_json_file(path, "pn-mix config")
    if not isinstance(fields, dict):
        raise PnMixError(f"pn-mix config file {path} must hold a JSON object of config fields")
    return dict(fields)


def engine_config(model_config: Any = None, path: Optional[str] = None) -> PnMixConfig:
    """PnMixCache's config for this model (the manifest's values, the model's pair layout), with the
    file's fields laid over it."""
    return resolve_config(None, file_fields(path), model_config)


def check_engine(*, model_type: Optional[str], kv_cache_dtype: str, prefix_caching: bool,
                 sliding_window: Any = None, alibi: bool = False, logits_soft_cap: Any = None,
                 sinks: bool = False) -> None:
    """What the backend cannot serve, refused at start-up (before any KV memory is allocated)."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PnMixError(f"the {BACKEND_NAME} backend serves {', '.join(SUPPORTED_MODEL_TYPES)} models, "
                         f"not {model_type!r}")
    if kv_cache_dtype != "auto":
        raise PnMixError(f"--kv-cache-dtype {kv_cache_dtype} contradicts the {BACKEND_NAME} backend, which "
                         f"stores its own 2-bit format: leave it at auto")
    if prefix_caching:
        raise PnMixError(f"the {BACKEND_NAME} backend does not share blocks between sequences (a flushed "
                         f"block's bytes depend on its sequence's pair mask): pass --no-enable-prefix-caching")
    for what, present in (("sliding-window attention", sliding_window is not None),
                          ("ALiBi", alibi), ("logit soft-capping", bool(logits_soft_cap)),
                          ("attention sinks", sinks)):
        if present:
            raise PnMixError(f"the {BACKEND_NAME} backend does not support {what}")


def layer_pages(model_config: Any, *, num_kv_heads: int, head_size: int, block_size: int, kv_cache_dtype: str,
                prefix_caching: bool, sliding_window: Any = None, alibi: bool = False, logits_soft_cap: Any = None,
                sinks: bool = False, kv_sharing: bool = False) -> PageLayout:
    """Every start-up check of one attention layer (what the backend's layer constructor runs, before
    vLLM allocates KV memory), then the layer's page layout: the engine's refusals, KV sharing, the
    config against the head dim, the engine's block size against group_size."""
    check_engine(model_type=getattr(model_config, "model_type", None), kv_cache_dtype=kv_cache_dtype,
                 prefix_caching=prefix_caching, sliding_window=sliding_window, alibi=alibi,
                 logits_soft_cap=logits_soft_cap, sinks=sinks)
    if kv_sharing:
        raise PnMixError(f"the {BACKEND_NAME} backend does not share KV caches between layers")
    return PageLayout(engine_config(model_config), num_kv_heads, head_size, block_size)
