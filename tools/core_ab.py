"""A/B of libpnmix_core builds: the packed attention of each, in ONE process, over the same cache.

    python tools/core_ab.py BUILD_DIR_A[:ISA[:ARITH[:THREADS_ON]]] BUILD_DIR_B[:ISA[:ARITH[:THREADS_ON]]]
                            [--context 32768] [--threads 2] [--blocks 20] [--queries 1] [--heads 32/8/128]
                            [--cold MB] [--layers 1]

Each folder holds a libpnmix_core.so (e.g. the installed pnmix/lib and a `cmake --build build/dev`
of a change); ISA (avx2, avx512, avx512vbmi, scalar; default auto) and ARITH (fp32, int8; default
auto) pick a kernel of that build, so one build's kernels can be compared too (`B:avx2:int8 B:auto:fp32`);
THREADS_ON (torch, pool; default torch) where CoreOps runs the work items: torch's OpenMP threads,
--threads of them as `pnmix bench decode` sets, or the core's own pool (`B::int8:torch B::int8:pool`).
Before 2026-12-07 (docs/BENCHMARKS.md 2.24) CoreOps, and so this tool, ran on the core's pool alone:
`:pool` times what the older commands in docs/BENCHMARKS.md timed. The builds run in alternating
blocks of five calls (pnmix.bench.timing's time_interleaved), so drift of a shared or throttled
machine hits both alike; two separate `pnmix bench decode` runs on a virtual machine can differ by
15-30%, more than most kernel changes. Prints whether the outputs are bitwise equal and
each build's median, 10th percentile and minimum milliseconds per call (batch 1, the default config;
by default the bench decode shape: 32 query / 8 KV heads, head dim 128, one query).
--queries N: a prompt's later chunk instead: N queries over the `context` cached tokens, with their
own N new K/V (causal), the call vLLM's backend makes for it (`--heads 9/3/64`: SmolLM2-135M's).
--cold MB: before each call, untimed, torch sums a tensor of MB megabytes, as a model's weights pass
through the caches between two layers' attention calls (SmolLM2-135M's: about 18 MB a layer in
fp32); the state, the kernel's code and its scratch then come from memory as they do in a model.
--layers L: L copies of the cache for each build, each call on the next (a model's layers, one call
each a step):
with --cold, each state comes from memory while the code and scratch that the calls share may stay
in the last-level cache, as in a model (`--heads 9/3/64 --context 8192 --layers 30 --cold 14`:
SmolLM2-135M's 8K step).
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

BLOCK_CALLS = 5  # calls of one build in a row, before the other's turn


def folder_problem(folder: str) -> str | None:
    """Why a build folder cannot be timed, or None. A folder without the library must be refused:
    the loader would go on searching, find another build and time it under this folder's name."""
    from pnmix._native import library_filename

    if not Path(folder).is_dir():
        return f"{folder}: no such folder"
    if not (Path(folder) / library_filename("pnmix_core")).is_file():
        return f"{folder}: no {library_filename('pnmix_core')} in it"
    return None


def parse_spec(text: str) -> tuple[str, str, str, str]:
    """FOLDER[:ISA[:ARITH[:THREADS_ON]]] as (folder, isa, arith, threads_on): "auto" for an ISA or
    arithmetic not given, "torch" for the threads."""
    folder, isa, arith, threads_on = (text.split(":") + ["", "", ""])[:4]
    return folder, isa or "auto", arith or "auto", threads_on or "torch"


def parse_build(text: str) -> tuple[str, str, str]:
    """FOLDER[:ISA[:ARITH]] as (folder, isa, arith), "auto" for an ISA or arithmetic not given."""
    return parse_spec(text)[:3]


def heads_arg(parser: argparse.ArgumentParser, text: str) -> tuple[int, int, int]:
    """--heads QUERY/KV/DIM as three ints; anything else is the parser's one-line error."""
    try:
        q_heads, kv_heads, dim = (int(x) for x in text.split("/"))
    except ValueError:
        parser.error(f"--heads {text!r}: give QUERY/KV/DIM, e.g. 9/3/64")
    return q_heads, kv_heads, dim


def decode_case(context: int, queries: int, q_heads: int, kv_heads: int, dim: int):
    """The call this tool times (and tools/loop_profile.py profiles): a batch-1 cache of the default
    config holding `context` random fp16 tokens, `queries` fp16 queries, and for a chunk (queries > 1)
    their own new K/V. Returns (q, layout, state, k_new, v_new): ops.attend(q, layout, state,
    context, k_new, v_new)."""
    import torch

    from pnmix.bench.decode import fill_cache
    from pnmix.config import PnMixConfig
    from pnmix.format import CacheLayout

    n, nq = context, queries
    generator = torch.Generator().manual_seed(0)
    layout = CacheLayout(PnMixConfig(), 1, kv_heads, dim, n + nq)
    k, v = (torch.randn(1, kv_heads, n + nq, dim, generator=generator).half() for _ in range(2))
    q = torch.randn(1, q_heads, nq, dim, generator=generator).half()
    state = fill_cache(layout, k[:, :, :n], v[:, :, :n], None)
    k_new, v_new = (k[:, :, n:], v[:, :, n:]) if nq > 1 else (None, None)
    return q, layout, state, k_new, v_new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="folders holding libpnmix_core.so")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--queries", type=int, default=1, help="> 1: a chunk of that many queries and new K/V")
    parser.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head dim")
    parser.add_argument("--layers", type=int, default=1, help="copies of the cache, called in turn")
    parser.add_argument("--cold", type=float, default=0.0, metavar="MB",
                        help="read this many MB before each call (untimed): the caches as a model leaves them")
    args = parser.parse_args()
    q_heads, kv_heads, dim = heads_arg(parser, args.heads)

    import torch

    from pnmix import _native
    from pnmix.backends.core_ops import CoreOps
    from pnmix.bench.timing import time_interleaved
    from pnmix.errors import PnMixError

    for build in args.builds:
        if problem := folder_problem(parse_build(build)[0]):
            parser.error(problem)
        if parse_spec(build)[3] not in ("torch", "pool"):
            parser.error(f"{build}: THREADS_ON must be torch or pool")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if not 1 <= args.layers <= 4096:
        parser.error(f"--layers must be in 1..4096, got {args.layers}")
    if not 0 <= args.cold <= 65536:
        parser.error(f"--cold must be in 0..65536 MB, got {args.cold:g}")
    torch.set_num_threads(args.threads)  # the team CoreOps runs on (bench decode sets it alike)

    n, nq = args.context, args.queries
    q, layout, state, k_new, v_new = decode_case(n, nq, q_heads, kv_heads, dim)
    def copies() -> list:
        # with --layers, every build its own, none finding states the other just read; on huge pages
        # where the machine gives them, as a model's PnMixCache keeps its state
        out = []
        for _ in range(args.layers):
            copy = layout.empty_state(huge_pages=True)
            for name, t in copy.items():
                t.copy_(state[name])
            out.append(copy)
        return out
    libraries: dict[tuple[str, str], CoreOps] = {}
    calls = []
    for build in args.builds:
        folder, isa, arith, threads_on = parse_spec(build)
        if (folder, threads_on) not in libraries:  # forget the loaded library, point the loader at this folder
            _native._loaded.pop("pnmix_core", None)
            os.environ["PNMIX_LIB_DIR"] = folder
            try:
                libraries[folder, threads_on] = CoreOps(args.threads, torch_threads=threads_on == "torch")
            except PnMixError as exc:  # another ABI's build: one line
                parser.error(f"{folder}: {exc}")

        def call(ops=libraries[folder, threads_on], isa=isa, arith=arith, turn=itertools.count(),
                 states=copies() if args.layers > 1 else [state]):
            ops.set_isa(isa)  # the ISA and arithmetic are process-wide
            ops.set_arith(arith)
            return ops.attend(q, layout, states[next(turn) % len(states)], n, k_new, v_new)

        calls.append(call)
    outputs = [call() for call in calls]  # also each one's warm-up
    print("outputs bitwise equal:", all(torch.equal(outputs[0], out) for out in outputs[1:]))
    flood = torch.ones(int(args.cold * 2**20) // 4)  # fp32 elements; empty without --cold

    def evict() -> None:
        flood.sum()

    timings = time_interleaved(calls, args.blocks, per_round=BLOCK_CALLS,
                               before=[evict] * len(calls) if args.cold else None)
    for folder, timing in zip(args.builds, timings):
        print(f"{folder}: median {timing.median_s * 1e3:.3f} ms, p10 {timing.percentile_s(10) * 1e3:.3f}, "
              f"min {timing.best_s * 1e3:.3f} ({timing.count} calls, {args.threads} threads, {n} tokens"
              + (f", {nq} queries" if nq > 1 else "") + (f", {args.layers} caches" if args.layers > 1 else "")
              + (f", {args.cold:g} MB read before each" if args.cold else "")
              + ")")


if __name__ == "__main__":
    main()
