"""Every backend, behind one interface (see base.py), and the one registry that names them.

``make_ops(name)`` builds a cache-ops backend, ``make_backend(name)`` any backend,
``default_ops(device)`` the best cache ops this machine has for a device. Each backend lives in
one module (``cuda_ops``, ``core_ops``, ``triton_ops`` + ``triton_kernels``, ``onnxruntime``) or
one subpackage (``tensorrt``); ``native`` is the ctypes glue the two C ABIs share.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import CacheOps
from ..config import PnMixConfig
from ..errors import PnMixError
from .base import Backend, OpsBackend

OPS_BACKENDS = ("torch", "core", "triton", "cuda")
# default_ops's preference per device type; the reference (torch) serves when none of them can.
DEFAULT_PREFERENCE = {"cuda": ("triton",), "cpu": ("core",)}


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
        from .cuda_ops import CudaOps

        return CudaOps(device)
    raise PnMixError(f"unknown backend '{name}'; choose one of {', '.join(OPS_BACKENDS)}")


def default_ops(device: torch.device | str = "cpu") -> CacheOps:
    """The cache ops for `device`: Triton on CUDA devices, the C++ core on CPU, the reference
    when the preferred one is not installed or built here (its constructor says why: a
    PnMixError; any other exception is a bug and propagates)."""
    device = torch.device(device)
    for name in DEFAULT_PREFERENCE.get(device.type, ()):
        try:
            return make_ops(name, str(device))
        except PnMixError:
            continue
    return make_ops("torch", str(device))


def make_backend(name: str, config: PnMixConfig, seed: int, max_seq_len: int,
                 device: str = "cpu", **options: Any) -> Backend:
    """Build a backend. options: onnx -> model=PATH; engine -> plan=PATH, plugins=PATH."""
    if name == "onnx":
        from .onnxruntime.backend import OnnxBackend

        return OnnxBackend(config, seed, max_seq_len, device, **options)
    if name == "engine":
        from .tensorrt.backend import TrtBackend

        return TrtBackend(config, seed, max_seq_len, device, **options)
    return OpsBackend(make_ops(name, device), config, seed, max_seq_len, device)


__all__ = ["Backend", "CacheOps", "OpsBackend", "default_ops", "make_backend", "make_ops", "OPS_BACKENDS"]
