"""The KV-cache methods `pnmix eval` compares: one table (METHODS), each method's cache and its
pn-mix config, and a method's fresh cache holding the shared prefill (docs/EVAL.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from ...config import PnMixConfig, read_json_file
from ...errors import PnMixError
from .._deps import quanto_unavailable_reason
from ..models import ModelDims, resolve_config
from .prefill import Prefill, hand_over_prefill


@dataclasses.dataclass(frozen=True)
class Method:
    """A KV-cache method: which cache class, with which settings.

    cache: "dynamic" (transformers' DynamicCache), "pnmix" (PnMixCache; ``settings`` are pn-mix
    config fields laid over the manifest's) or "quanto" (QuantizedCache; ``settings`` are its
    keyword arguments)."""

    name: str
    cache: str
    about: str
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def kivi(bits: int, group: int) -> Dict[str, Any]:
    """KIVI (Liu et al. 2024) as a pn-mix config: keys per channel over G-token groups, values per
    token in blocks of G channels, an fp16 residual of 128 tokens, no sink, one key bit width."""
    return {"sink_tokens": 0, "key_high_bits": bits, "key_low_bits": bits, "value_bits": bits,
            "group_size": group, "value_group_size": group, "residual_size": 128}


REFERENCE = "fp16"
CONFIG_METHOD = "config"  # the name of the --config FILE method
METHODS: Dict[str, Method] = {m.name: m for m in (
    Method(REFERENCE, "dynamic", "transformers' DynamicCache in the model's dtype: the reference"),
    Method("pnmix", "pnmix", "PnMixCache, the manifest's config (3/1-bit keys by pair energy, 2-bit values, "
                             "32-token sink)"),
    Method("uniform2", "pnmix", "PnMixCache with 2-bit keys everywhere (same bytes, no saliency mixing)",
           {"key_high_bits": 2, "key_low_bits": 2}),
    Method("kivi2-g128", "pnmix", "KIVI 2-bit, group 128, as a pn-mix config", kivi(2, 128)),
    Method("kivi2-g32", "pnmix", "KIVI 2-bit, group 32, as a pn-mix config", kivi(2, 32)),
    Method("kivi4-g128", "pnmix", "KIVI 4-bit, group 128, as a pn-mix config", kivi(4, 128)),
    Method("quanto2", "quanto", "transformers' QuantizedCache, quanto backend, 2-bit", {"nbits": 2}),
    Method("quanto4", "quanto", "transformers' QuantizedCache, quanto backend, 4-bit", {"nbits": 4}),
)}


def parse_methods(text: Optional[str], config_path: Optional[Path]) -> List[Method]:
    """--methods (comma list; default every preset this machine can run) plus --config FILE.
    The reference always runs first: every other method is scored against it."""
    if text is None:
        names = [n for n, m in METHODS.items() if m.cache != "quanto" or quanto_unavailable_reason() is None]
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise PnMixError("--methods is empty: name at least one method (--methods list shows them)")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise PnMixError(f"unknown method {unknown[0]!r} in --methods; known: {', '.join(METHODS)}")
    if any(METHODS[n].cache == "quanto" for n in names):
        reason = quanto_unavailable_reason()
        if reason is not None:
            raise PnMixError(f"the quanto methods need optimum-quanto: {reason}")
    methods = [METHODS[REFERENCE]] + [METHODS[n] for n in dict.fromkeys(names) if n != REFERENCE]
    if config_path is not None:
        fields = read_json_file(config_path, "config")
        if not isinstance(fields, dict):
            raise PnMixError(f"config file {config_path} must hold a JSON object of pn-mix config fields")
        PnMixConfig.from_mapping(fields, base=PnMixConfig(pair_layout="half"))  # field errors now, not after loading
        methods.append(Method(CONFIG_METHOD, "pnmix", f"PnMixCache with {config_path}", fields))
    return methods


def pnmix_config(method: Method, model_config: Any) -> PnMixConfig:
    base = resolve_config(None, {}, model_config)
    config = resolve_config(PnMixConfig.from_mapping(dict(method.settings), base=base), {}, model_config)
    config.check_head_dim(ModelDims.from_config(model_config).head_dim)
    return config


def make_cache(method: Method, model_config: Any):
    from transformers import DynamicCache, QuantizedCache

    from ..cache import PnMixCache

    if method.cache == "dynamic":
        return DynamicCache(config=model_config)
    if method.cache == "pnmix":
        return PnMixCache(pnmix_config(method, model_config), model_config=model_config)
    return QuantizedCache(backend="quanto", config=model_config, **method.settings)


def attention_for(method: Method) -> Optional[str]:
    """PnMixCache decodes under the pnmix attention (the packed path); the rest under the model's own."""
    return "pnmix" if method.cache == "pnmix" else None


def methods_table() -> str:
    lines = [f"{m.name:<12} {m.about}" for m in METHODS.values()]
    lines.append(f"{CONFIG_METHOD:<12} --config FILE: PnMixCache with that file's pn-mix config fields")
    return "\n".join(lines)


def seeded_cache(method: Method, model_config: Any, prefill: Prefill):
    """A fresh cache of the method holding the prefill, as if the prefill had run with it."""
    cache = hand_over_prefill(make_cache(method, model_config), prefill.kv)
    if method.cache == "quanto":
        for layer in cache.layers:
            layer._dequantize = DequantizeOnce(layer._dequantize)
    return cache


class DequantizeOnce:
    """transformers' quantized layer dequantizes its whole quantized K/V at every decode step (9 s
    a step for SmolLM2 at 4K on two cores), though those tensors change only when the residual is
    flushed (every residual_length steps). Once ``reuse`` is on, an unchanged quantized tensor's
    dequantized copy is reused: bit-identical results, timed steps excepted (see kl.QUANTO_TIMED_STEPS)."""

    def __init__(self, dequantize: Callable):
        self.dequantize = dequantize
        self.reuse = False
        self.memo: Dict[int, Tuple[Any, torch.Tensor]] = {}

    def __call__(self, quantized: Any) -> torch.Tensor:
        if not self.reuse:
            return self.dequantize(quantized)
        hit = self.memo.get(id(quantized))
        if hit is not None and hit[0] is quantized:
            return hit[1]
        if len(self.memo) >= 2:  # a flush replaced the keys' and the values' tensors
            self.memo.clear()
        out = self.dequantize(quantized)
        self.memo[id(quantized)] = (quantized, out)
        return out


def reuse_dequantized(cache, on: bool = True) -> None:
    for layer in cache.layers:
        if isinstance(getattr(layer, "_dequantize", None), DequantizeOnce):
            layer._dequantize.reuse = on
