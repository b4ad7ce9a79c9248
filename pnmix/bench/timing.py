"""The one timer of every benchmark: warm-up calls that are not timed, then timed calls whose wall
and process CPU seconds are kept as samples (``Timing``), in rounds when several things are timed
against each other.

A shared or throttled machine drifts during a run; the benchmarks guard against it the same two
ways: the median of the samples (a burst of load moves it less than the mean), and rounds that
take the things compared in turn (``round_order``, ``time_interleaved``), so a burst falls on all
of them alike. Process CPU time (all threads) is kept next to the wall time: on a busy machine it
says what a call costs when the wall clock also counts waiting for a core (its mean over the calls,
``Timing.cpu_mean_s``, says why not the median).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")
Sync = Optional[Callable[[], None]]  # waits for queued device work (torch.cuda.synchronize); None on CPU

_wall = time.perf_counter  # module names, so a test can put a fake clock in their place
_cpu = time.process_time


@dataclasses.dataclass(frozen=True)
class Timing:
    """The samples of the timed calls of one thing, in seconds, in call order."""

    samples_s: Tuple[float, ...]
    cpu_samples_s: Tuple[float, ...]

    @property
    def count(self) -> int:
        return len(self.samples_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def cpu_mean_s(self) -> float:
        """The process CPU seconds of a call, as the mean of the calls': Linux adds the time of a
        thread running on another core to the process clock at its scheduler ticks (every few ms),
        so one short call's sample holds a helper thread's work whole or not at all. A median of
        such samples dropped it (a two-thread 1.5 ms call read 1.5 ms of CPU, against 3.1 ms by the
        threads' own counters); the mean spreads the jumps over the calls they came in."""
        return statistics.fmean(self.cpu_samples_s)

    @property
    def best_s(self) -> float:
        """The fastest call: the least disturbed by other load (the machine probes' figure)."""
        return min(self.samples_s)

    @property
    def total_s(self) -> float:
        return sum(self.samples_s)

    def percentile_s(self, percent: int) -> float:
        """The sample `percent` % of the way up the sorted samples (10: the 10th percentile)."""
        return sorted(self.samples_s)[self.count * percent // 100]


class Stopwatch:
    """Collects the samples of one thing, one timed call at a time (``time``), across rounds."""

    def __init__(self, sync: Sync = None):
        self.sync = sync
        self._wall: List[float] = []
        self._cpu: List[float] = []

    def time(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs), its wall and CPU seconds kept as one sample; returns its result."""
        result, wall, cpu = _measure(self.sync, fn, *args, **kwargs)
        self._wall.append(wall)
        self._cpu.append(cpu)
        return result

    def timing(self) -> Timing:
        return Timing(tuple(self._wall), tuple(self._cpu))


def _measure(sync: Sync, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Tuple[T, float, float]:
    if sync is not None:
        sync()
    wall, cpu = _wall(), _cpu()
    result = fn(*args, **kwargs)
    if sync is not None:
        sync()
    return result, _wall() - wall, _cpu() - cpu


def time_once(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Tuple[T, float]:
    """(fn's result, its wall seconds): a single call that is a figure of its own (a fill, a build)."""
    result, wall, _ = _measure(None, fn, *args, **kwargs)
    return result, wall


def time_calls(fn: Callable[[], T], repeats: int, warmup: int = 1, sync: Sync = None,
               slow_s: Optional[float] = None, slow_repeats: int = 3) -> Tuple[Timing, T]:
    """`warmup` untimed calls (caches, thread pool, allocator), then `repeats` timed ones:
    (their Timing, the last call's result). With slow_s, a first warm-up call slower than that
    ends the warm-up and caps the timed calls at slow_repeats: a step of seconds needs fewer."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for index in range(warmup):
        wall = _measure(sync, fn)[1]
        if slow_s is not None and index == 0 and wall >= slow_s:
            repeats = min(repeats, slow_repeats)
            break
    watch = Stopwatch(sync)
    for _ in range(repeats - 1):
        watch.time(fn)
    result = watch.time(fn)
    return watch.timing(), result


def best_seconds(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """The fastest of `runs` timed calls after `warmup` untimed ones (pages touched, threads awake)."""
    return time_calls(fn, runs, warmup)[0].best_s


def round_order(items: Sequence[T], rounds: int, alternate: bool = False) -> Iterator[T]:
    """Every item once per round, for `rounds` rounds; with alternate, every second round goes in
    reverse, so no item is always timed first (just after a setup) or last."""
    for index in range(rounds):
        yield from (items if not alternate or index % 2 == 0 else items[::-1])


def time_interleaved(calls: Sequence[Callable[[], object]], rounds: int, per_round: int = 1,
                     warmup_rounds: int = 0, before: Optional[Sequence[Callable[[], object]]] = None,
                     sync: Sync = None) -> List[Timing]:
    """Each call timed `per_round` times a round, the calls taking turns, for `rounds` rounds after
    `warmup_rounds` untimed ones: one Timing per call. before[i], when given, runs untimed ahead of
    every call of calls[i] (restoring a state, so each timed call does the same work)."""
    watches = [Stopwatch(sync) for _ in calls]
    for round_index in range(warmup_rounds + rounds):
        for index, call in enumerate(calls):
            for _ in range(per_round):
                if before is not None:
                    before[index]()
                if round_index < warmup_rounds:
                    _measure(sync, call)
                else:
                    watches[index].time(call)
    return [watch.timing() for watch in watches]
