"""Run by tests/backends/test_core_sanitized.py in a child process whose libpnmix_core is built with
AddressSanitizer: caches whose every group slot is full (so the last group's key codes end their
buffer, where the kernels' wide loads must not reach past), in several layouts, attended with one and
several queries on every kernel this CPU has, in fp32 and int8 (the last token goes in through
pnmix_attend_append, as a model's decode step does). A read outside a buffer aborts the
process with the sanitizer's report; otherwise it prints one line per case and "done"."""

import torch

from pnmix.backends.core_ops import CoreOps
from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig

LAYOUTS = {  # (config, kv heads, query heads, head dim)
    "bench shape": (PnMixConfig(), 8, 32, 128),
    "SmolLM2 shape": (PnMixConfig(pair_layout="half"), 3, 9, 64),
    "odd pairs": (PnMixConfig(high_ratio=0.3, pair_layout="half"), 2, 4, 64),
    "wide keys": (PnMixConfig(key_high_bits=5, group_size=64, residual_size=64), 2, 4, 128),
    "small groups": (PnMixConfig(group_size=32, residual_size=32, sink_tokens=4, value_group_size=32), 2, 6, 32),
}


def main() -> None:
    ops = CoreOps(threads=2)
    generator = torch.Generator().manual_seed(0)
    for name, (config, kv_heads, q_heads, head_dim) in LAYOUTS.items():
        tokens = config.sink_tokens + 6 * config.group_size  # the residual flushed: every slot holds a group
        for arith in ("fp32", "int8"):
            ops.set_arith(arith)
            cache = PackedKVCache(config, kv_heads, head_dim, tokens, ops=ops)
            kv = torch.randn(2, 1, kv_heads, tokens, head_dim, generator=generator)
            cache.append(kv[0, :, :, :-1], kv[1, :, :, :-1])
            # the last token as a decode step in one call (fp32 K/V rounded there): it flushes the last group
            q = torch.randn(1, q_heads, 1, head_dim, generator=generator).half()
            cache.attend_append_prechecked(q, kv[0, :, :, -1:], kv[1, :, :, -1:])
            for isa in ops.each_kernel():
                for queries in (1, 5):
                    q = torch.randn(1, q_heads, queries, head_dim, generator=generator).half()
                    out = cache.attend(q)
                    assert bool(torch.isfinite(out).all()), (name, arith, isa, queries)
                print(f"{name}: {ops.arith_for(cache.layout)} on {isa}, {cache.lengths()}")
    ops.set_arith("auto")
    print("done")


if __name__ == "__main__":
    main()
