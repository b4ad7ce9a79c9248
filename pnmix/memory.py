"""Will it fit? Sizes are checked against the machine's memory before anything is allocated, so a
size that cannot fit is a one-line PnMixError naming the option, not an allocator's RuntimeError
(or the OOM killer) minutes into a run."""

from __future__ import annotations

import os
from typing import Optional

from .errors import PnMixError


def available_bytes() -> Optional[int]:
    """Host memory a new allocation can get: MemAvailable (it counts reclaimable page cache, which
    free pages do not), else the free pages; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gpu_available_bytes(device: str) -> Optional[int]:
    import torch

    try:
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    except Exception:  # no CUDA, or a driver that does not say: the allocation decides
        return None


def human(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:,.0f} {unit}"
    return f"{n} bytes"


# No allocation of this size can succeed anywhere (and torch's size arithmetic may overflow near
# it): refused even where the machine does not say how much memory it has.
ADDRESSABLE_BYTES = 1 << 56


def check_fits(need: int, what: str, hint: str, device: str = "cpu") -> None:
    """Refuse ``what`` (e.g. "--context 1000000") when ``need`` bytes exceed what is available on
    ``device`` (host memory for cpu); ``hint`` says what to change. Every path that allocates from
    sizes it was given (options, configs, file headers, an ONNX file's capacity) calls this first."""
    device = str(device)
    if device.startswith("cuda"):
        have, where = gpu_available_bytes(device), f"{device} memory"
    elif device == "cpu":
        have, where = available_bytes(), "memory"
    else:  # meta tensors and other devices: their allocator decides
        return
    if need > ADDRESSABLE_BYTES:
        have = ADDRESSABLE_BYTES if have is None else min(have, ADDRESSABLE_BYTES)
    if have is not None and need > have:
        raise PnMixError(f"{what} needs about {human(need)} of {where}, {human(have)} is available; {hint}")
