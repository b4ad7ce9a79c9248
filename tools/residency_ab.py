"""How much of a decode step waits on memory: the same step with its groups streamed and cache-resident.

    python tools/residency_ab.py [--context 32768] [--threads 2] [--blocks 16] [--arith int8|fp32]
                                 [--heads 32/8/128] [--pages 1,8,32,128]

One sequence in a paged pn-mix cache (pnmix/vllm/paged.py, the default config, pages of
group_size tokens in order), one query token. The step runs over the real block table (every group
its own page, read from the last-level cache or memory) and over tables that send every group to
the first N pages that hold a group (N = 1: one page, in L1 and L2 after the first group). The
kernel does the same work either way, on other bytes, so the difference is the time spent waiting
for the state. Calls alternate in blocks (pnmix.bench.timing.time_interleaved); prints each
table's median, 10th percentile and minimum milliseconds. A page holds every KV head's part of one
group; a sequence's block 0 holds no group (the first group ends in block 1), so the resident
tables start at block 1: a table of zeros would time an empty page.
"""

from __future__ import annotations

import argparse

import torch
from core_ab import heads_arg  # (tools/ is the script's folder, first on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=16, help="rounds of interleaved calls")
    parser.add_argument("--arith", default="int8", choices=["fp32", "int8"])
    parser.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head dim")
    parser.add_argument("--pages", default="1,8,32,128", help="distinct pages of the resident tables")
    args = parser.parse_args()
    q_heads, kv_heads, dim = heads_arg(parser, args.heads)
    try:
        resident = [int(x) for x in args.pages.split(",")]
    except ValueError:
        parser.error(f"--pages {args.pages!r}: give N,N,..., e.g. 1,8,32")

    if args.context < 1 or args.threads < 0 or args.blocks < 1:
        parser.error("--context and --blocks must be positive and --threads at least 0 (0: every core)")

    from pnmix.backends.core_ops import CoreOps
    from pnmix.bench.timing import time_interleaved
    from pnmix.config import PnMixConfig
    from pnmix.vllm.paged import PagedLayerCache, PageLayout

    from pnmix.errors import PnMixError

    config = PnMixConfig()
    n = args.context
    try:
        pages = PageLayout(config, kv_heads, dim, config.group_size)
        groups = pages.layout.lengths(n).groups
    except PnMixError as exc:
        parser.error(str(exc))
    if q_heads < 1 or q_heads % kv_heads:
        parser.error(f"--heads {args.heads}: the query heads must be a positive multiple of the KV heads")
    if groups < 2:
        parser.error(f"--context {n}: fewer than two groups of {config.group_size} tokens past the sink and residual")
    blocks = pages.blocks_for(n)
    first = pages.block_of_group(0)
    gen = torch.Generator().manual_seed(0)
    table = torch.arange(blocks, dtype=torch.int32)
    kv_pages = torch.zeros(blocks, kv_heads, pages.head_page_bytes, dtype=torch.uint8)
    ops = CoreOps(args.threads)
    ops.set_arith(args.arith)
    cache = PagedLayerCache(pages, slots=1, ops=ops)
    k = torch.randn(kv_heads, n, dim, generator=gen).half()
    v = torch.randn(kv_heads, n, dim, generator=gen).half()
    cache.append(kv_pages, table, 0, 0, k, v)
    q = torch.randn(1, q_heads, 1, dim, generator=gen).half()
    layout, slot = cache.layout_at(n), cache.slot_state(0)
    tables = {f"streamed ({groups} pages)": table}
    for count in resident:
        if 0 < count < groups:
            tables[f"{count} page{'s' if count > 1 else ''}"] = first + torch.arange(blocks, dtype=torch.int32) % count

    def step(block_table):
        return lambda: ops.attend_paged(q, layout, kv_pages, block_table, pages.block_size, slot, n)

    calls = [step(t) for t in tables.values()]
    for call in calls:
        call()
    timings = time_interleaved(calls, args.blocks, per_round=5)
    print(
        f"{n} tokens, {q_heads}/{kv_heads}/{dim} heads, {args.threads} threads, arith {ops.arith()}, kernel "
        f"{ops.isa()}, page {pages.page_bytes} bytes"
    )
    for name, timing in zip(tables, timings):
        print(
            f"{name}: median {timing.median_s * 1e3:.3f} ms, p10 {timing.percentile_s(10) * 1e3:.3f}, "
            f"min {timing.best_s * 1e3:.3f}"
        )


if __name__ == "__main__":
    main()
