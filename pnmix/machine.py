"""The machine a run is on: the CPU's model, and the device a --device option names."""

from __future__ import annotations

import platform

from .errors import PnMixError


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def resolve_device(device: str, allow_auto: bool = False) -> str:
    """A --device value checked (cpu, cuda, cuda:N; auto when allowed: cuda if there is one)."""
    import torch

    if allow_auto and device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        choices = "auto, cpu or cuda" if allow_auto else "cpu or cuda"
        raise PnMixError(f"--device must be {choices}, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PnMixError("--device cuda asked for, but torch sees no CUDA device")
    return device
