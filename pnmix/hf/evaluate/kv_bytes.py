"""Bytes a cache holds, whatever its class (pn-mix's own count, quanto's packed tensors, dense K/V)."""

from __future__ import annotations

from typing import Any




def _tensor_bytes(t: Any) -> int:
    """Bytes of a tensor, or of the plain tensors inside a tensor subclass (quanto's packed tensors)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def dynamic_cache_bytes(cache) -> int:
    return sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values) for layer in cache.layers)


def quantized_cache_bytes(cache) -> int:
    """Quantized states (codes, scales, shifts) plus the full-precision residual, over layers."""
    return sum(_tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
               + _tensor_bytes(layer.keys) + _tensor_bytes(layer.values) for layer in cache.layers)


def cache_bytes(cache) -> int:
    """Persistent bytes, whatever the cache: pn-mix's own count (docs/METHOD.md section 2), else its tensors."""
    if hasattr(cache, "persistent_bytes"):
        return cache.persistent_bytes()
    if cache.layers and hasattr(cache.layers[0], "_quantized_keys"):
        return quantized_cache_bytes(cache)
    return dynamic_cache_bytes(cache)
