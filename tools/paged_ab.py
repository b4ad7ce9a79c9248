"""A decode step of the vLLM backend's attention, pages read in place against pages gathered first.

    python tools/paged_ab.py [--context 4096] [--threads 0] [--rounds 200] [--arith fp32|int8] [--torch-threads N]

One sequence of `context` tokens in a paged pn-mix cache (pnmix/vllm/paged.py) with SmolLM2-135M's
shapes (3 KV heads, 9 query heads, head dim 64, PnMixCache's default config, blocks of group_size
tokens on a shuffled block table), one query token and its own K/V. Times, in one process and in
alternating blocks (pnmix.bench.timing.time_interleaved), the core's paged entry point
(CoreOps.attend_paged: what PagedLayerCache.attend calls) against the gather that preceded it
(PagedLayerCache.state: index_select of the group pages into a contiguous state) plus
CoreOps.attend on the copy, the gather alone, and CoreOps.attend on a copy gathered once (the
kernel over a contiguous state, no gather). Prints whether the two outputs are bitwise equal
and each one's median, 10th percentile and minimum microseconds per call.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--arith", default="fp32", choices=["fp32", "int8"])
    parser.add_argument("--torch-threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    from pnmix.backends.core_ops import CoreOps
    from pnmix.bench.timing import time_interleaved
    from pnmix.config import PnMixConfig
    from pnmix.vllm.paged import PagedLayerCache, PageLayout

    config = PnMixConfig(pair_layout="half")
    heads, q_heads, dim, n = 3, 9, 64, args.context
    pages = PageLayout(config, heads, dim, config.group_size)
    blocks = pages.blocks_for(n + 1)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks].to(torch.int32)  # vLLM's block ids are int32
    kv_pages = torch.zeros(2 * blocks, heads, pages.head_page_bytes, dtype=torch.uint8)
    ops = CoreOps(args.threads)
    ops.set_arith(args.arith)
    cache = PagedLayerCache(pages, slots=1, ops=ops)
    k = torch.randn(heads, n + 1, dim, generator=gen).half()
    v = torch.randn(heads, n + 1, dim, generator=gen).half()
    cache.append(kv_pages, table, 0, 0, k[:, :n], v[:, :n])
    q = torch.randn(1, q_heads, 1, dim, generator=gen).half()
    k_new, v_new = k[None, :, n:], v[None, :, n:]
    layout, slot = cache.layout_at(n), cache.slot_state(0)

    def paged():
        return ops.attend_paged(q, layout, kv_pages, table, pages.block_size, slot, n, k_new, v_new)

    def gathered():
        lay, state = cache.state(kv_pages, table, 0, n)
        return ops.attend(q, lay, state, n, k_new, v_new)

    def gather_only():
        return cache.state(kv_pages, table, 0, n)

    copy_layout, copy = cache.state(kv_pages, table, 0, n)

    def on_copy():  # the kernel alone over a contiguous state gathered once
        return ops.attend(q, copy_layout, copy, n, k_new, v_new)

    print("outputs bitwise equal:", torch.equal(paged(), gathered()))
    names = ["paged (in place)", "gathered + attend", "gather alone", "attend on a copy gathered once"]
    timings = time_interleaved([paged, gathered, gather_only, on_copy], args.rounds, per_round=5, warmup_rounds=2)
    group_bytes = layout.lengths(n).groups * pages.page_bytes
    print(f"{n} tokens, {layout.lengths(n).groups} groups ({group_bytes} bytes of pages), arith {ops.arith()}, "
          f"kernel {ops.isa()}, torch threads {torch.get_num_threads()}")
    for name, timing in zip(names, timings):
        print(f"{name}: median {timing.median_s * 1e6:.1f} us, p10 {timing.percentile_s(10) * 1e6:.1f}, "
              f"min {timing.best_s * 1e6:.1f} ({timing.count} calls)")


if __name__ == "__main__":
    main()
