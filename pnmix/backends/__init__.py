"""Backends behind one interface (see base.py). ``make_backend`` is the only entry point."""

from __future__ import annotations

from typing import Any

from ..config import PnMixConfig
from ..errors import PnMixError
from .base import Backend, CacheOps, OpsBackend

OPS_BACKENDS = ("torch", "core", "triton", "cuda")
ALL_BACKENDS = OPS_BACKENDS + ("onnx", "engine")


def make_ops(name: str, device: str = "cpu") -> CacheOps:
    if name == "torch":
        from .torch_ops import TorchOps

        return TorchOps()
    if name == "core":
        from .core_ops import CoreOps

        return CoreOps()
    if name == "triton":
        from .triton_ops import TritonOps

        return TritonOps(device)
    if name == "cuda":
        from ..cuda_ops import CudaOps

        return CudaOps(device)
    raise PnMixError(f"unknown backend '{name}'; choose one of {', '.join(OPS_BACKENDS)}")


def make_backend(name: str, config: PnMixConfig, seed: int, max_seq_len: int,
                 device: str = "cpu", **options: Any) -> Backend:
    """Build a backend. options: onnx -> model=PATH; engine -> plan=PATH, plugins=PATH."""
    if name == "onnx":
        from .onnx_backend import OnnxBackend

        return OnnxBackend(config, seed, max_seq_len, device, **options)
    if name == "engine":
        from .trt_backend import TrtBackend

        return TrtBackend(config, seed, max_seq_len, device, **options)
    return OpsBackend(make_ops(name, device), config, seed, max_seq_len, device)


__all__ = ["Backend", "CacheOps", "OpsBackend", "make_backend", "make_ops", "ALL_BACKENDS"]
