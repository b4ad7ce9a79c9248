"""The machine a run is on: the CPU's model, its load, the description every benchmark report
carries (``describe_machine``), and the device a --device option names."""

from __future__ import annotations

import os
import platform
from typing import Any, Dict, List, Optional, Set

from .errors import PnMixError


def cpuinfo_field(name: str) -> Optional[str]:
    """The first value of a /proc/cpuinfo field ("model name", "flags"), or None without one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> Set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    return set((cpuinfo_field("flags") or "").split())


def parse_cache_size(text: str) -> Optional[int]:
    """Bytes of a sysfs cache size ("491520K", "32M", "1024"), or None if it is not one."""
    text = text.strip()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    factor = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if text[-1:].upper() in units else text
    return int(digits) * factor if digits.isdigit() else None


def last_level_cache_bytes(cpu_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> Optional[int]:
    """The largest cache of CPU 0 as Linux's sysfs lists it (its L3 on the machines we target), or
    None where there is no such listing."""
    try:
        entries = os.listdir(cpu_dir)
    except OSError:
        return None
    sizes = []
    for entry in entries:
        try:
            with open(os.path.join(cpu_dir, entry, "size"), encoding="utf-8") as f:
                size = parse_cache_size(f.read())
        except OSError:
            continue
        if size:
            sizes.append(size)
    return max(sizes) if sizes else None


def load_average() -> Optional[List[float]]:
    """The 1, 5 and 15 minute load averages, or None where the system has none: a figure taken on
    a busy machine says so next to it."""
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def describe_machine(device: str = "cpu", threads: Optional[int] = None, onnxruntime: bool = False) -> Dict[str, Any]:
    """The "machine" block of a benchmark report: platform, CPU model and count, the threads the
    run used (default: torch's), torch's version, the device (and its GPU), the load average at the
    call, and onnxruntime's version when the run used it."""
    import torch

    info: Dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device,
        "load_average": load_average(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    if onnxruntime:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
    return info


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


# --threads, wherever it is an option (generate, bench decode, bench generate): more is a typo
# (ONNX Runtime segfaults spawning 100,000 threads after half a minute; the core's and torch's
# thread counts are C ints).
MAX_THREADS = 1024


def check_threads(threads: Optional[int]) -> Optional[int]:
    """A --threads value checked: None (the runtime's own choice) or an integer 1..MAX_THREADS."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise PnMixError(f"--threads must be 1..{MAX_THREADS}, got {threads!r}")
    return threads
