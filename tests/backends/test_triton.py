"""The Triton backend against the PyTorch reference: compiled on a GPU when there is one, else
on the CPU through Triton's interpreter.

Packed bytes must be identical (the same codes, step and offset for every group) and attention
within 1e-3, for several configs and for the odd shapes of a cache: a sequence that is not a
multiple of the kernel's block, one group, only the sink, only the residual.
"""

import os

import pytest
import torch

# The interpreter is chosen when triton and the kernels are imported (conftest.py sets it for
# the whole session on machines without a GPU, before any test module imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'pnmix[triton]')")

from pnmix import reference  # noqa: E402
from pnmix.backends import make_ops  # noqa: E402
from pnmix.cache import PackedKVCache  # noqa: E402
from pnmix.config import PnMixConfig, RunConfig  # noqa: E402
from pnmix.errors import PnMixError  # noqa: E402
from pnmix.format import CacheLayout  # noqa: E402

from pnmix.backends import triton_kernels  # noqa: E402
from pnmix.backends import triton_ops  # noqa: E402
from pnmix.backends.triton_ops import attend_triton, bench_factory  # noqa: E402

if triton_kernels.interpreting() and triton_kernels.interpreter_problem():
    pytest.skip(triton_kernels.interpreter_problem(), allow_module_level=True)
if not triton_kernels.interpreting() and not torch.cuda.is_available():
    pytest.skip("the kernels were compiled for a GPU and there is none: run with TRITON_INTERPRET=1",
                allow_module_level=True)
# where the Triton side runs; the reference always runs on the CPU
DEVICE = "cpu" if triton_kernels.interpreting() else "cuda"

from pnmix.testing import KERNEL_CONFIGS as CONFIGS, SMALL, make_random_kv  # noqa: E402


def layout_for(config, heads=2, dim=32, max_seq_len=512, batch=1):
    return CacheLayout(PnMixConfig(**config), batch, heads, dim, max_seq_len)


def assert_same_state(a, b):
    for name in a:
        assert torch.equal(a[name].cpu(), b[name].cpu()), f"state tensor {name} differs"


# ---------------------------------------------------------------------------------------
# quantize + pack of groups: byte-identical to the reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_key_groups_are_byte_identical(name):
    layout = layout_for(CONFIGS[name])
    gs, d = layout.config.group_size, layout.head_dim
    g = torch.Generator().manual_seed(3)
    keys = (torch.randn(6, gs, d, generator=g) * 2).half()
    keys[0, :, 3] = 1.25  # a constant channel: step 0, codes 0
    keys[1, :, 5] = torch.linspace(-60000, 60000, gs).half()  # step near fp16's limit
    high = torch.zeros(6, layout.pairs, dtype=torch.bool)
    for row in range(6):  # each row its own mask, n_high pairs high
        high[row, torch.randperm(layout.pairs, generator=g)[: layout.config.high_pairs(d)]] = True
    bits = layout.channel_bits(high)
    want = reference.quantize_key_groups(keys, bits, layout)
    got = [t.cpu() for t in triton_kernels.quantize_key_groups(keys.to(DEVICE), bits.to(DEVICE), layout)]
    for part, w, t in zip(("codes", "step", "offset"), want, got):
        assert torch.equal(w, t), f"key {part} differ"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_values_are_byte_identical(name):
    layout = layout_for(CONFIGS[name])
    g = torch.Generator().manual_seed(4)
    values = (torch.randn(2, 2, 3, 7, layout.head_dim, generator=g) * 3).half()
    values[0, 0, 0, 0] = 0.5  # a constant token: step 0
    values[1, 1, 2, 6] = torch.linspace(-65504, 65504, layout.head_dim).half()
    want = reference.quantize_values(values, layout)
    got = [t.cpu() for t in triton_kernels.quantize_values(values.to(DEVICE), layout)]
    for part, w, t in zip(("codes", "step", "offset"), want, got):
        assert torch.equal(w, t), f"value {part} differ"


def run_both(config, chunks, heads=2, dim=32, batch=1, seed=0):
    """Append the same K/V chunks through the reference and the Triton append."""
    caches = [PackedKVCache(PnMixConfig(**config), heads, dim, sum(chunks), batch=batch, device=device, ops=ops)
              for ops, device in ((make_ops("torch"), "cpu"), (make_ops("triton", DEVICE), DEVICE))]
    k, v = make_random_kv(batch, heads, sum(chunks), dim, seed=seed)
    at = 0
    for n in chunks:
        for cache in caches:
            cache.append(k[:, :, at:at + n], v[:, :, at:at + n])
        at += n
    return caches


@pytest.mark.parametrize("name", ["small", "other", "bits_4_1", "straddle"])
def test_cache_state_identical_over_prefill_and_decode(name):
    layout = layout_for(CONFIGS[name])
    cfg = layout.config
    prefill = cfg.sink_tokens + cfg.residual_size + cfg.group_size + 5
    decode = cfg.residual_size - layout.lengths(prefill).residual + 1  # flushes on a decode step
    ref, tri = run_both(CONFIGS[name], [prefill] + [1] * decode, batch=2)
    assert ref.lengths().groups == layout.lengths(prefill).groups + 1 >= 3
    assert_same_state(ref.state, tri.state)


@pytest.mark.parametrize("chunks, groups", [
    ([3], 0),  # only the sink
    ([5 + 16], 0),  # sink and residual, nothing quantized yet
    ([5 + 24], 1),  # exactly one group on the flush
    ([5 + 23, 1], 1),  # the flush on a decode step
])
def test_cache_state_identical_odd_lengths(chunks, groups):
    ref, tri = run_both(SMALL, chunks)
    assert ref.lengths().groups == groups
    assert_same_state(ref.state, tri.state)


# ---------------------------------------------------------------------------------------
# attention over the packed cache: within 1e-3 of the reference
# ---------------------------------------------------------------------------------------


def on_device(state):
    return {name: t.to(DEVICE) for name, t in state.items()}


def filled_cache(config, n, heads=2, dim=32, batch=1, seed=1):
    cache = PackedKVCache(PnMixConfig(**config), heads, dim, max(n, 1) + 8, batch=batch)
    if n:
        k, v = make_random_kv(batch, heads, n, dim, seed=seed)
        cache.append(k, v)
    return cache


def check_attention(cache, q_heads=4, nq=1, n_new=1, dtype=torch.float16, **plan):
    layout = cache.layout
    g = torch.Generator().manual_seed(7)
    q = torch.randn(layout.batch, q_heads, nq, layout.head_dim, generator=g).to(dtype)
    k_new, v_new = make_random_kv(layout.batch, layout.kv_heads, n_new, layout.head_dim, seed=9)
    if not n_new:
        k_new = v_new = None
    want = reference.attend(q, layout, cache.state, cache.seq_len, k_new, v_new)

    def on(t):
        return None if t is None else t.to(DEVICE)

    got = attend_triton(on(q), layout, on_device(cache.state), cache.seq_len, on(k_new), on(v_new), **plan).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.parametrize("n, what", [
    (3, "only the sink"),
    (5 + 20, "sink and residual"),
    (5 + 24, "one group"),
    (5 + 24 + 16 * 3 + 7, "several groups, not a multiple of the block"),
])
def test_attention_decode_matches_reference(n, what):
    check_attention(filled_cache(SMALL, n), nq=1, n_new=1, block_n=16)


def test_attention_only_residual_no_sink():
    config = dict(SMALL, sink_tokens=0)
    cache = filled_cache(config, 11)
    assert cache.lengths() == (0, 0, 11)
    check_attention(cache, nq=1, n_new=0)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_attention_splits_merge(splits):
    """More splits than units leaves some splits empty; the reduction must ignore them."""
    check_attention(filled_cache(SMALL, 77), nq=1, n_new=1, block_n=16, splits=splits)


def test_attention_prefill_from_empty_cache():
    """The prefill: nq queries over their own fp16 K/V, causal, nothing in the cache."""
    check_attention(filled_cache(SMALL, 0), nq=40, n_new=40, block_n=16)


def test_attention_many_queries_per_query_causal_limits():
    """The final evaluation: the last nq cached positions, each seeing keys up to itself."""
    check_attention(filled_cache(SMALL, 90), nq=33, n_new=0, block_n=16, splits=2)


@pytest.mark.parametrize("name", ["other", "bits_4_1", "straddle", "all_high_8"])
def test_attention_configs(name):
    check_attention(filled_cache(CONFIGS[name], 150), nq=2, n_new=2)


@pytest.mark.parametrize("q_heads", [2, 8])
def test_attention_gqa_and_batch(q_heads):
    check_attention(filled_cache(SMALL, 60, batch=2), q_heads=q_heads, nq=3, n_new=1)


def test_attention_bf16_queries_and_odd_head_dim():
    config = dict(SMALL, value_group_size=8)
    check_attention(filled_cache(config, 60, dim=24), dtype=torch.bfloat16, nq=1, n_new=1)


def test_bench_factory_runs_one_decode_step():
    cache = filled_cache(SMALL, 77)
    q = torch.randn(1, 4, 1, 32).half()
    step = bench_factory(cache.layout, on_device(cache.state), cache.seq_len, q.to(DEVICE))
    want = reference.attend(q, cache.layout, cache.state, cache.seq_len)
    assert (step().cpu() - want).abs().max().item() <= 1e-3
    assert (step().cpu() - want).abs().max().item() <= 1e-3  # reusable


# ---------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------


def test_backend_protocol_matches_reference():
    """A short protocol through make_ops('triton'): same packed bytes, outputs within 1e-3."""
    from pnmix.verify import run_seeds

    run = RunConfig(PnMixConfig(**SMALL), prefill_tokens=40, decode_tokens=12)
    ours = run_seeds("triton", run, [42], DEVICE)[0]
    ref = run_seeds("torch", run, [42])[0]
    assert ours.packed == ref.packed
    assert (ours.online - ref.online).abs().max().item() <= 1e-3
    assert (ours.final - ref.final).abs().max().item() <= 1e-3
    assert ours.metrics["saliency_computations"] == 1


def test_make_ops_names_the_backend():
    assert make_ops("triton", DEVICE).name == "triton"


def test_bad_queries_are_one_line_errors():
    cache = filled_cache(SMALL, 20)
    with pytest.raises(PnMixError, match="queries must have shape"):
        attend_triton(torch.zeros(1, 3, 1, 32).half(), cache.layout, cache.state, cache.seq_len)
    with pytest.raises(PnMixError, match="queries but only"):
        attend_triton(torch.zeros(1, 4, 21, 32).half(), cache.layout, cache.state, cache.seq_len)


def test_state_of_another_shape_is_a_one_line_error():
    cache = filled_cache(SMALL, 20)
    state = on_device(cache.state)
    state["residual_k"] = state["residual_k"][:, :, :3]
    q = torch.zeros(1, 4, 1, 32).half().to(DEVICE)
    with pytest.raises(PnMixError, match="state tensor 'residual_k' must be a contiguous"):
        attend_triton(q, cache.layout, state, cache.seq_len)


def test_unknown_device_is_a_one_line_error():
    with pytest.raises(PnMixError, match="runs on cuda or"):
        triton_ops.TritonOps("meta")


# ---------------------------------------------------------------------------------------
# the compiled path, without a GPU: the kernels must compile for sm_90 (H100/H200)
# ---------------------------------------------------------------------------------------

COMPILE_SCRIPT = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from pnmix.backends import triton_kernels as tk

TYPES = {torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8", torch.int32: "*i32"}

def build(kernel, args, constants):
    def kind(value):  # tensors by dtype; other arguments are i32 unless given as a float
        return TYPES[value] if isinstance(value, torch.dtype) else "fp32" if isinstance(value, float) else "i32"

    signature = {name: "constexpr" if name in constants else kind(args.get(name, 0))
                 for name in kernel.arg_names}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

f16, f32, u8, i32 = torch.float16, torch.float32, torch.uint8, torch.int32
ptx = build(tk.key_group_kernel, dict(keys_ptr=f16, bits_ptr=i32, start_ptr=i32, codes_ptr=u8,
            step_ptr=f16, offset_ptr=f16, D=1, KB=1),
            dict(GS=24, GS_P=32, CB=8, SB_P=32, MINMAX=True, MEAN=True))
# the quantizer's division must be the correctly rounded one, never a fast reciprocal
assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx" not in ptx
build(tk.value_fit_kernel, dict(values_ptr=f16, step_ptr=f16, offset_ptr=f16, T=1),
      dict(D=32, VG=16, VG_P=16, NVB=2, NVB_P=2, BITS=1, TB=16))
build(tk.value_pack_kernel, dict(values_ptr=f16, step_ptr=f16, offset_ptr=f16, codes_ptr=u8, T=1),
      dict(D=32, VG=16, NVB=2, VB=12, VB_P=16, BITS=3, TB=16))
args = {name: f16 for name in ("q_ptr", "sink_k", "sink_v", "residual_k", "residual_v", "new_k",
                               "new_v", "key_step", "key_offset", "value_step", "value_offset")}
args.update(key_codes=u8, value_codes=u8, chan_bits=i32, chan_start=i32, part_acc=f32, part_m=f32,
            part_l=f32, scale=1.0)
for block_n in (32, 64):  # groups of 128 (one group per unit) and of 24 (units span groups)
    build(tk.attend_partial_kernel, args, dict(REP=4, D=128, D_P=128, GS=128 if block_n == 32 else 24,
          VB=32, NVB=1, VG=128, BV=2, BLOCK_M=16, BLOCK_N=block_n))
build(tk.attend_reduce_kernel, dict(part_acc=f32, part_m=f32, part_l=f32, out_ptr=f32, nq=1, H=1,
      M_PAD=1, SPLITS=1), dict(REP=4, D=128, D_P=128, BLOCK_M=16))
print("compiled")
"""


@pytest.mark.slow  # ptxas compiles every kernel in a fresh process
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """triton ships ptxas: compile every kernel for sm_90 in a process without the interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(repo), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("this triton build has no ptxas to compile with")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiled" in done.stdout
