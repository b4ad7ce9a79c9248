"""What a layer's update leaves for the attention function (``Step``, handed over on the same
thread), and the batch-row arguments of beam search and batch expansion: the pieces both kinds
of PnMixCache layer share (pnmix/hf/cache.py's PnMixLayer, pnmix/hf/padded.py's RowsLayer)."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Optional

import torch

from ..config import MAX_BATCH
from ..errors import PnMixValueError, PnMixIndexError


def batch_rows(indices: Any, batch: Optional[int], what: str) -> torch.Tensor:
    """The batch rows that reorder_cache / batch_select_indices name, as a 1-D int64 tensor, or a
    one-line error naming the argument: a 1-D integer tensor or a list/tuple of ints (not bools,
    not floats), not empty, each in 0..batch-1 (a negative row is not counted from the end: a
    beam index is never negative). ``batch``: the cache's batch, None before the first update."""
    if isinstance(indices, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            bad = next(i for i in indices if not isinstance(i, int) or isinstance(i, bool))
            raise PnMixValueError(f"{what}: indices must be integers, got {bad!r} ({type(bad).__name__})")
        rows = torch.tensor(list(indices), dtype=torch.int64)
    elif isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise PnMixValueError(f"{what}: indices must be an integer tensor, got dtype {indices.dtype}")
        if indices.dim() != 1:
            raise PnMixValueError(f"{what}: indices must be 1-D (one per batch row), got shape {list(indices.shape)}")
        rows = indices.detach().to(device="cpu", dtype=torch.int64)
    else:
        raise PnMixValueError(f"{what}: indices must be a 1-D integer tensor or a list of ints, "
                              f"got {type(indices).__name__}")
    if rows.numel() == 0:
        raise PnMixValueError(f"{what}: indices name no batch row (an empty batch)")
    if rows.numel() > MAX_BATCH:
        raise PnMixValueError(f"{what}: {rows.numel()} indices, more than the batch limit {MAX_BATCH}")
    if batch is not None:
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= batch:
            raise PnMixIndexError(f"{what}: index {low if low < 0 else high} is out of range for the "
                                  f"cache's batch of {batch} (rows 0..{batch - 1})")
    return rows


def check_repeats(repeats: Any, batch: Optional[int]) -> int:
    """batch_repeat_interleave's count: an int >= 1 whose new batch stays within the limits."""
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise PnMixValueError(f"batch_repeat_interleave: repeats must be a positive integer, got {repeats!r}")
    if repeats < 1:
        raise PnMixValueError(f"batch_repeat_interleave: repeats must be >= 1, got {repeats}")
    if repeats * (batch or 1) > MAX_BATCH:
        raise PnMixValueError(f"batch_repeat_interleave: {repeats} repeats of a batch of {batch or 1} pass the "
                              f"batch limit {MAX_BATCH}")
    return repeats


@dataclasses.dataclass
class Step:
    """What the last update of a layer left for the attention function (see attention.py)."""

    layer: Any  # the PnMixLayer or RowsLayer whose update made it
    key: "weakref.ref[torch.Tensor]"  # what update returned (weak: a dequantized copy must not outlive its layer)
    seq_before: int  # tokens in the packed cache the attention reads
    k_new: torch.Tensor  # K/V of this step's tokens: fp16, or as the model gave them where the backend checks them
    v_new: torch.Tensor
    pending: bool  # the append waits for the attention function
    steady: bool = False  # a steady decode step (SteadyDecode): its shapes passed the checks before


@dataclasses.dataclass
class SteadyDecode:
    """The last decode step a layer's packed path checked in full. A step with K/V of the same
    shapes and dtypes, on the same packed cache with room for it, gets the same answers from
    update's checks (shapes, sizes, backend, capacity), and a query of the same shape and dtype
    from the backend's; they are not made again. A decode step of a model's layer pays each
    check in microseconds, its code out of the caches after the layer's matrix products."""

    packed: Any  # the PackedKVCache checked (a resize, crop into the prefill, reset or new batch makes another)
    kv: tuple  # (k.shape, k.dtype, v.shape, v.dtype) as checked
    limit: int  # the tokens the cache may hold without growing (its slots, max_cache_len)
    query: Optional[tuple] = None  # (q.shape, q.dtype) the backend's checks passed, after the first attention


# The attention function runs right after its layer's update on the same thread.
_last_step = threading.local()


def take_step(key: torch.Tensor) -> Optional[Step]:
    step = getattr(_last_step, "step", None)
    if step is None or step.key() is not key:
        return None
    _last_step.step = None
    return step
