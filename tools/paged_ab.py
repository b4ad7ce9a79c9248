"""A decode step of the vLLM backend's attention, pages read in place against pages gathered first.

    python tools/paged_ab.py [--context 4096] [--threads 0] [--rounds 200] [--arith fp32|int8] [--torch-threads N]
                             [--sequences N]

One sequence of `context` tokens in a paged pn-mix cache (pnmix/vllm/paged.py) with SmolLM2-135M's
shapes (3 KV heads, 9 query heads, head dim 64, PnMixCache's default config, blocks of group_size
tokens on a shuffled block table), one query token and its own K/V. Times, in one process and in
alternating blocks (pnmix.bench.timing.time_interleaved), the core's paged entry point
(CoreOps.attend_paged: what PagedLayerCache.attend calls) against the gather that preceded it
(PagedLayerCache.state: index_select of the group pages into a contiguous state) plus
CoreOps.attend on the copy, the gather alone, and CoreOps.attend on a copy gathered once (the
kernel over a contiguous state, no gather). Prints whether the two outputs are bitwise equal
and each one's median, 10th percentile and minimum microseconds per call.

With --sequences N (> 1): a decode step of one layer for N such sequences (a vLLM step), as the
backend ran it before (PagedLayerCache.attend and append per sequence) against one batched call
(attend_decode: pnmix_attend_paged_batch; append_decode: one indexed copy), attention and append
timed apart (the appends write the same token at the same place every call: no flush at these
lengths), with the largest difference of the two attentions' outputs.
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
    parser.add_argument("--sequences", type=int, default=1, help="> 1: a step of that many sequences, batched or not")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.sequences > 1:
        return batch_step(args)

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


def batch_step(args) -> None:
    from pnmix.backends.core_ops import CoreOps
    from pnmix.bench.timing import time_interleaved
    from pnmix.config import PnMixConfig
    from pnmix.vllm.paged import PagedLayerCache, PageLayout

    config = PnMixConfig(pair_layout="half")
    heads, q_heads, dim, n, count = 3, 9, 64, args.context, args.sequences
    pages = PageLayout(config, heads, dim, config.group_size)
    blocks = pages.blocks_for(n + 1)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(count * blocks, generator=gen).to(torch.int32).reshape(count, blocks)
    kv_pages = torch.zeros(count * blocks, heads, pages.head_page_bytes, dtype=torch.uint8)
    ops = CoreOps(args.threads)
    ops.set_arith(args.arith)
    cache = PagedLayerCache(pages, slots=count, ops=ops)
    for s in range(count):
        cache.append(kv_pages, tables[s], s, 0, torch.randn(heads, n, dim, generator=gen).half(),
                     torch.randn(heads, n, dim, generator=gen).half())
    q = torch.randn(count, q_heads, dim, generator=gen)
    k_new, v_new = torch.randn(count, heads, dim, generator=gen), torch.randn(count, heads, dim, generator=gen)
    slots, lens, scale = list(range(count)), [n] * count, dim ** -0.5

    def attend_each():
        return torch.cat([cache.attend(kv_pages, tables[s], s, n, q[s:s + 1], k_new[s, :, None], v_new[s, :, None],
                                       scale) for s in range(count)])

    def attend_batched():
        return cache.attend_decode(kv_pages, tables, slots, lens, q, k_new, v_new, scale)

    def append_each():
        for s in range(count):
            cache.append(kv_pages, tables[s], s, n, k_new[s, :, None], v_new[s, :, None])

    def append_batched():
        cache.append_decode(kv_pages, tables, slots, lens, k_new, v_new)

    diff = (attend_each() - attend_batched()).abs().max().item()
    timings = time_interleaved([attend_each, attend_batched, append_each, append_batched], args.rounds,
                               per_round=5, warmup_rounds=2)
    print(f"{count} sequences of {n} tokens, arith {ops.arith()}, kernel {ops.isa()}, core threads "
          f"{args.threads or 'all usable'}, torch threads {torch.get_num_threads()}; max |each - batched| {diff:.2e}")
    names = ["attention, one call per sequence", "attention, one batched call", "append, per sequence",
             "append, batched"]
    for name, timing in zip(names, timings):
        print(f"{name}: median {timing.median_s * 1e3:.3f} ms a layer ({timing.median_s / count * 1e6:.1f} us a "
              f"sequence), p10 {timing.percentile_s(10) * 1e3:.3f}, min {timing.best_s * 1e3:.3f}")


if __name__ == "__main__":
    main()
