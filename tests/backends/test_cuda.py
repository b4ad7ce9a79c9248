"""The CUDA kernels (libpnmix_cuda) against the PyTorch reference.

On a GPU: packed bytes identical to cache.append_reference after every append (prefill, decode
steps, chunks that flush several groups at once), attention within 1e-3 of reference.attend
(decode with a new token, prefill, evaluation queries, fp16 and bf16 queries, GQA, many splits),
for several configs and odd lengths. Without a GPU, the tests that need one skip with the
reason; the C ABI's argument checks still run wherever the library is built (they return
before touching a device).
"""

import ctypes

import pytest
import torch

from pnmix import reference
from pnmix.backends import cuda_ops
from pnmix.cache import append_reference
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import STATE_NAMES, CacheLayout

LIB_OK, LIB_WHY = cuda_ops.library_status()
needs_lib = pytest.mark.skipif(not LIB_OK, reason=f"libpnmix_cuda is not built: {LIB_WHY}")
needs_gpu = pytest.mark.skipif(
    not (LIB_OK and torch.cuda.is_available()),
    reason=("no CUDA device (torch.cuda.is_available() is False)" if not torch.cuda.is_available()
            else f"libpnmix_cuda is not built: {LIB_WHY}"),
)

from pnmix.testing import KERNEL_CONFIGS as CONFIGS, SMALL, make_random_kv  # noqa: E402


def layout_for(config, heads=2, dim=32, max_seq_len=512, batch=1):
    return CacheLayout(PnMixConfig(**config), batch, heads, dim, max_seq_len)


def layout_kv(layout, n, seed, scale=1.0):
    """n tokens of random fp16 (k, v) in the layout's batch, heads and head size."""
    return make_random_kv(layout.batch, layout.kv_heads, n, layout.head_dim, seed=seed, scale=scale)


def to_gpu(state):
    return {name: t.cuda() for name, t in state.items()}


def assert_same_state(gpu_state, cpu_state, where):
    for name in STATE_NAMES:
        got, want = gpu_state[name].cpu(), cpu_state[name]
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()[0].tolist()
            pytest.fail(f"{where}: state tensor '{name}' differs first at byte index {bad}")


def fill(layout, chunks, seed=0):
    """Append the chunks (token counts) through the reference on CPU and the kernels on GPU,
    comparing every byte after each append. Returns (cpu state, gpu state, seq_len)."""
    ops = cuda_ops.CudaOps()
    cpu = layout.empty_state()
    gpu = to_gpu(cpu)
    seq_len = 0
    for i, n in enumerate(chunks):
        k, v = layout_kv(layout, n, seed=seed + i)
        append_reference(layout, cpu, seq_len, k, v)
        ops.append(layout, gpu, seq_len, k.cuda(), v.cuda())
        seq_len += n
        assert_same_state(gpu, cpu, f"after appending {chunks[:i + 1]}")
    return cpu, gpu, seq_len


# ---------------------------------------------------------------------------------------
# append: bytes identical to the reference
# ---------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_append_bytes_match_reference(name):
    layout = layout_for(CONFIGS[name])
    # prefill of an odd length, single decode steps across flushes, a chunk flushing several groups
    fill(layout, [37, 1, 1, 1, 29, 1, 120, 3, 1])


@needs_gpu
@pytest.mark.parametrize("chunks", [[1], [3, 2], [5, 24, 1], [200], [4, 1, 1, 1, 1, 1]])
def test_append_odd_lengths(chunks):
    fill(layout_for(SMALL, batch=2, heads=3, dim=16), chunks)


@needs_gpu
def test_append_at_model_size_with_16_byte_paths():
    # head_dim 128 and the manifest's groups: the vectorized copies and the residual shift
    layout = layout_for({}, heads=8, dim=128, max_seq_len=1024, batch=2)
    fill(layout, [300, 1, 100, 1, 257])


@needs_gpu
def test_mask_comes_from_the_first_append_only():
    layout = layout_for(SMALL)
    ops = cuda_ops.CudaOps()
    gpu = to_gpu(layout.empty_state())
    k, v = layout_kv(layout, 6, seed=1)
    ops.append(layout, gpu, 0, k.cuda(), v.cuda())
    first_mask = gpu["pair_mask"].clone()
    assert first_mask.any()  # SMALL keeps half the pairs high
    # later, much larger keys must not move the mask (it is computed once, from the prefill)
    k2, v2 = layout_kv(layout, 40, seed=2, scale=100.0)
    ops.append(layout, gpu, 6, k2.cuda(), v2.cuda())
    assert torch.equal(first_mask, gpu["pair_mask"])


# ---------------------------------------------------------------------------------------
# attention: within 1e-3 of the reference over the same packed state
# ---------------------------------------------------------------------------------------


def check_attend(layout, cpu, gpu, seq_len, q_heads, nq, n_new, dtype=torch.float16, seed=7):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(layout.batch, q_heads, nq, layout.head_dim, generator=g).to(dtype)
    k_new = v_new = None
    if n_new:
        k_new, v_new = layout_kv(layout, n_new, seed=seed + 1)
    want = reference.attend(q.half() if dtype == torch.float16 else q.float(), layout, cpu, seq_len, k_new, v_new)
    got = cuda_ops.CudaOps().attend(q.cuda(), layout, gpu, seq_len,
                                    None if k_new is None else k_new.cuda(), None if v_new is None else v_new.cuda())
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.cpu() - want).abs().max().item()
    assert err <= 1e-3, f"max abs error {err:.3g} (seq_len {seq_len}, nq {nq}, n_new {n_new})"


@pytest.fixture(params=["tensor_cores", "simt"])
def kernel_path(request, monkeypatch):
    """Both group paths of the attention kernel: mma.m16n8k16 where the shapes allow, and SIMT."""
    if request.param == "simt":
        monkeypatch.setenv("PNMIX_CUDA_SIMT", "1")
    else:
        monkeypatch.delenv("PNMIX_CUDA_SIMT", raising=False)
    return request.param


# Shapes the tensor-core path takes (head_dim a multiple of 64, groups of 64..256 tokens, codes
# of at most 4 bits, a warp's channels inside one value block); each also runs on the SIMT path.
TENSOR_CORE_CASES = {
    "other_d64": (CONFIGS["other"], 64, 2),
    "group64_d128": (dict(group_size=64, residual_size=64, sink_tokens=3), 128, 1),
    "group256_vg32": (dict(group_size=256, residual_size=300, sink_tokens=32, value_group_size=32), 128, 2),
    "bits_4_1_d256": (dict(key_high_bits=4, key_low_bits=1, value_bits=1, value_group_size=64), 256, 1),
    "bits_2_2_v3": (dict(key_high_bits=2, key_low_bits=2, value_bits=3, high_ratio=0.75), 64, 1),
}


@needs_gpu
@pytest.mark.parametrize("name", sorted(TENSOR_CORE_CASES))
def test_attention_on_both_kernel_paths(name, kernel_path):
    config, dim, batch = TENSOR_CORE_CASES[name]
    layout = layout_for(config, heads=2, dim=dim, max_seq_len=1100, batch=batch)
    cpu, gpu, seq_len = fill(layout, [613, 1, 90])
    check_attend(layout, cpu, gpu, seq_len, q_heads=8, nq=1, n_new=1)
    check_attend(layout, cpu, gpu, seq_len, q_heads=4, nq=2, n_new=3)
    check_attend(layout, cpu, gpu, seq_len, q_heads=2, nq=5, n_new=0, dtype=torch.bfloat16)
    check_attend(layout, cpu, gpu, seq_len, q_heads=16, nq=1, n_new=0)


@needs_gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_attention_matches_reference(name):
    layout = layout_for(CONFIGS[name])
    cpu, gpu, seq_len = fill(layout, [150, 1, 1])
    check_attend(layout, cpu, gpu, seq_len, q_heads=4, nq=1, n_new=1)   # decode step: new token
    check_attend(layout, cpu, gpu, seq_len, q_heads=2, nq=9, n_new=0)   # evaluation, no GQA
    check_attend(layout, cpu, gpu, seq_len, q_heads=8, nq=3, n_new=5)   # queries among new tokens


@needs_gpu
@pytest.mark.parametrize("seq_len", [1, 4, 5, 20, 29, 45])
def test_attention_only_sink_only_residual_one_group(seq_len):
    layout = layout_for(SMALL, batch=2, heads=2, dim=16)
    cpu, gpu, n = fill(layout, [seq_len])
    check_attend(layout, cpu, gpu, n, q_heads=4, nq=1, n_new=0)
    check_attend(layout, cpu, gpu, n, q_heads=4, nq=min(n, 3), n_new=2)


@needs_gpu
def test_prefill_attention_on_an_empty_cache_is_causal():
    layout = layout_for(SMALL, heads=2, dim=32)
    cpu = layout.empty_state()
    check_attend(layout, cpu, to_gpu(cpu), 0, q_heads=4, nq=37, n_new=37)


@needs_gpu
def test_bf16_queries():
    layout = layout_for({}, heads=2, dim=64, max_seq_len=1024)
    cpu, gpu, seq_len = fill(layout, [700])
    check_attend(layout, cpu, gpu, seq_len, q_heads=8, nq=1, n_new=1, dtype=torch.bfloat16)


@needs_gpu
def test_many_splits_at_model_size(kernel_path):
    # 32 query heads on 8 KV heads, head_dim 128, a few thousand tokens: many splits per head
    layout = layout_for({}, heads=8, dim=128, max_seq_len=4096, batch=1)
    cpu, gpu, seq_len = fill(layout, [3001, 1])
    check_attend(layout, cpu, gpu, seq_len, q_heads=32, nq=1, n_new=0)
    check_attend(layout, cpu, gpu, seq_len, q_heads=32, nq=1, n_new=1, dtype=torch.bfloat16)


@needs_gpu
def test_head_dim_256_and_no_gqa():
    layout = layout_for(dict(value_group_size=64), heads=2, dim=256, max_seq_len=600)
    cpu, gpu, seq_len = fill(layout, [290])
    check_attend(layout, cpu, gpu, seq_len, q_heads=2, nq=2, n_new=1)


@needs_gpu
def test_bench_factory_runs_one_decode_step():
    layout = layout_for({}, heads=8, dim=128, max_seq_len=2048)
    cpu, gpu, seq_len = fill(layout, [1500])
    q = torch.randn(1, 32, 1, 128, generator=torch.Generator().manual_seed(3)).half()
    step = cuda_ops.bench_factory(layout, gpu, seq_len, q.cuda())
    first = step().clone()
    torch.cuda.synchronize()
    want = reference.attend(q, layout, cpu, seq_len)
    assert (first.cpu() - want).abs().max().item() <= 1e-3
    assert torch.equal(step(), first)  # repeatable, whether graphed or not


# ---------------------------------------------------------------------------------------
# bad input: one-line errors
# ---------------------------------------------------------------------------------------


@needs_gpu
def test_cpu_tensors_are_refused():
    layout = layout_for(SMALL)
    gpu = to_gpu(layout.empty_state())
    k, v = layout_kv(layout, 3, seed=0)
    with pytest.raises(PnMixError, match="keys is on cpu"):
        cuda_ops.CudaOps().append(layout, gpu, 0, k, v)
    with pytest.raises(PnMixError, match="CUDA device"):
        cuda_ops.CudaOps().append(layout, layout.empty_state(), 0, k.cuda(), v.cuda())


@needs_lib
def test_c_abi_checks_arguments_before_touching_the_device():
    lib = cuda_ops.cuda_library()
    layout = layout_for(SMALL)
    lay = cuda_ops.c_layout(layout)
    empty = cuda_ops.CState()
    assert lib.pnmix_cuda_append(None, None, 0, None, None, 0, 0, None, 0, None) != 0
    assert b"layout is null" in lib.pnmix_cuda_last_error()
    status = lib.pnmix_cuda_append(ctypes.byref(lay), ctypes.byref(empty), 0, None, None, 1, 0, None, 0, None)
    assert status != 0 and b"'sink_k'" in lib.pnmix_cuda_last_error()
    bad = cuda_ops.c_layout(layout)
    bad.config.group_size = 12
    assert lib.pnmix_cuda_append(ctypes.byref(bad), ctypes.byref(empty), 0, None, None, 0, 0, None, 0, None) != 0
    assert b"group_size" in lib.pnmix_cuda_last_error()
    size = ctypes.c_int64(0)
    assert lib.pnmix_cuda_append_workspace_bytes(ctypes.byref(lay), 500, 13, ctypes.byref(size)) != 0
    assert b"capacity" in lib.pnmix_cuda_last_error()


@needs_lib
@pytest.mark.parametrize("q_heads, nq, n_new, message", [
    (3, 1, 0, b"multiple of kv_heads"),
    (4, 11, 0, b"nq must be"),
    (4, 0, 0, b"nq must be"),
])
def test_attention_shapes_are_checked(q_heads, nq, n_new, message):
    lib = cuda_ops.cuda_library()
    lay = cuda_ops.c_layout(layout_for(SMALL))
    size = ctypes.c_int64(0)
    assert lib.pnmix_cuda_attend_workspace_bytes(ctypes.byref(lay), 10, q_heads, nq, n_new, ctypes.byref(size),
                                                 None) != 0
    assert message in lib.pnmix_cuda_last_error()


@needs_lib
def test_head_dim_over_256_is_refused_by_the_attention_kernel():
    lib = cuda_ops.cuda_library()
    lay = cuda_ops.c_layout(layout_for({}, dim=512))
    size = ctypes.c_int64(0)
    assert lib.pnmix_cuda_attend_workspace_bytes(ctypes.byref(lay), 10, 2, 1, 0, ctypes.byref(size), None) != 0
    assert b"head_dim must be <= 256" in lib.pnmix_cuda_last_error()


@needs_lib
@pytest.mark.parametrize("seq_len, nq, n_new", [(0, 1, 1), (45, 1, 0), (300, 4, 2)])
def test_bytes_read_are_the_used_state_plus_queries_and_new_tokens(seq_len, nq, n_new):
    layout = layout_for(SMALL, batch=2)
    q_heads = 4
    expected = (layout.persistent_bytes(seq_len)["persistent_cache_bytes"]
                + 2 * layout.batch * q_heads * nq * layout.head_dim
                + 2 * 2 * layout.batch * layout.kv_heads * n_new * layout.head_dim)
    assert cuda_ops.bytes_read(layout, seq_len, q_heads, nq, n_new) == expected
