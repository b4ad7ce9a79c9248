"""Will it fit? Sizes are checked against the machine's memory before anything is allocated, so a
size that cannot fit is a one-line PnMixError naming the option, not an allocator's RuntimeError
(or the OOM killer) minutes into a run."""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from .errors import PnMixError

if TYPE_CHECKING:
    import torch


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


HUGE_PAGES_SWITCH = "PNMIX_HUGE_PAGES"  # 1 (the default): long-lived host states on huge pages; 0: torch's pages
LINE_BYTES = 64  # each tensor starts on a cache line, as torch's own allocator places them


def switch_on(name: str) -> bool:
    """An on/off environment switch as a bool (unset: 1); any value but 0 or 1 is a one-line error.
    (PNMIX_HUGE_PAGES here; PNMIX_TORCH_THREADS, backends/core_ops.py, reads the same way.)"""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise PnMixError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def huge_pages_wanted() -> bool:
    """PNMIX_HUGE_PAGES as a bool (unset: 1); any value but 0 or 1 is a one-line error."""
    return switch_on(HUGE_PAGES_SWITCH)


@functools.lru_cache(maxsize=1)
def huge_page_bytes() -> int:
    """The size of a transparent huge page: 2 MiB on x86-64, 512 MiB on arm64 kernels with 64 KiB
    pages (the kernel says; 2 MiB where it does not)."""
    try:
        return int(open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", encoding="ascii").read())
    except (OSError, ValueError):
        return 2 << 20


def zeros_on_huge_pages(specs: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]) -> Optional[Dict[str, torch.Tensor]]:
    """Zeroed host tensors {name: (shape, dtype)} side by side in one anonymous mapping that the
    kernel is asked to back with transparent huge pages (madvise), or None where that cannot be
    asked (not Linux, a Python without MADV_HUGEPAGE, less than one huge page in all, no mapping to
    be had). Whether they are wanted at all (PNMIX_HUGE_PAGES) is the caller's to ask.

    Why: a decode step reads every group of a long cache once, a few KiB from each of several
    tensors, so on 4 KiB pages nearly every read lands on a page the TLB does not hold; a 32K cache's
    19.3 MB state lies on 9 huge pages and a 0.6 MB tail of small ones (docs/BENCHMARKS.md 2.21
    measures the step on both). The mapping starts on a huge page so that every whole huge page
    inside it can be one; the tail is left on small pages rather than rounded up to a whole huge
    page of memory. The tensors keep the mapping alive; it is unmapped with the last. Linux's
    "madvise" mode (the common default) honours the request; "never", or a kernel without huge
    pages, ignores it or refuses it, and the tensors are ordinary pages, as torch.zeros would give.
    Where the kernel's defrag setting is "madvise" too, a first touch may wait for the kernel to
    compact memory into a huge page; PNMIX_HUGE_PAGES=0 opts out."""
    import mmap

    import torch

    offsets, at = {}, 0
    for name, (shape, dtype) in specs.items():
        at = -(-at // LINE_BYTES) * LINE_BYTES
        offsets[name] = at
        at += math.prod(shape) * dtype.itemsize
    huge = huge_page_bytes()
    if at < huge or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        mapping = mmap.mmap(-1, at + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # e.g. the process's mapping count at its limit: torch's allocator may still serve
        return None
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % huge
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, at)
    except OSError:  # a kernel built without huge pages: the mapping is still zeroed memory
        pass
    tensors = {}
    for name, (shape, dtype) in specs.items():
        count = math.prod(shape)
        flat = (torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + offsets[name]) if count
                else torch.zeros(0, dtype=dtype))
        tensors[name] = flat.view(shape)
    return tensors
