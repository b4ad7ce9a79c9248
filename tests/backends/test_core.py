"""libpnmix_core (the C++ core) against the PyTorch reference: bytes, attention, bad input.

Skips with the reason when the library is not built (build: cmake -S plugins -B build/dev &&
cmake --build build/dev, or pip install .).
"""

import copy
import ctypes
import math
import os
import threading

import pytest
import torch

from pnmix import dump, packing
from pnmix import format as fmt
from pnmix import reference
from pnmix._native import library_status
from pnmix.cache import append_reference
from pnmix.config import CONFIG_FIELDS, PnMixConfig
from pnmix.machine import cpu_flags
from pnmix.errors import PnMixError
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.testing import RUNNER, TASK, make_random_kv, reverse_order_runner

available, reason = library_status("pnmix_core")
if not available:
    pytest.skip(f"libpnmix_core not available: {reason}", allow_module_level=True)

from pnmix.backends import core_ops, native  # noqa: E402  (needs the library)
from pnmix.backends.core_ops import CoreOps  # noqa: E402

CONFIGS = {
    "manifest": PnMixConfig(),
    "other": PnMixConfig(pair_layout="half", key_high_bits=4, key_low_bits=2, value_bits=4,
                         group_size=64, residual_size=96, sink_tokens=8, high_ratio=0.25),
    # odd widths straddle bytes; value blocks narrower than a vector; no sink; R > gs + 8
    "odd": PnMixConfig(key_high_bits=5, key_low_bits=7, value_bits=3, value_group_size=8, group_size=24,
                       residual_size=40, sink_tokens=0, high_ratio=0.7),
    "eight": PnMixConfig(key_high_bits=8, key_low_bits=6, value_bits=8, group_size=16, residual_size=16,
                         sink_tokens=3, high_ratio=1.0),
    # widths whose 16-code chunks span more than 64 bits (the AVX-512 kernel's two-word decode)
    "wide": PnMixConfig(key_high_bits=7, key_low_bits=5, value_bits=5, group_size=32, residual_size=32,
                        sink_tokens=2, high_ratio=0.5),
    "one_bit": PnMixConfig(key_high_bits=1, key_low_bits=1, value_bits=1, group_size=32, residual_size=48,
                           sink_tokens=5, high_ratio=0.0, value_group_size=16),
}


def run_schedule(ops_append, layout, chunks, k, v):
    state = layout.empty_state()
    seq_len = 0
    for n in chunks:
        ops_append(layout, state, seq_len, k[:, :, seq_len:seq_len + n], v[:, :, seq_len:seq_len + n])
        seq_len += n
    return state, seq_len


@pytest.fixture(scope="module")
def ops():
    return CoreOps()


def test_ctypes_structs_match_the_compiled_c_structs():
    """The ctypes mirrors (backends/native.py) against offsetof/sizeof as the C compiler laid out
    params.h's and pnmix_core.h's structs (from generated.h): a field of the wrong type, order
    or name fails here."""
    lib = core_ops.core_library()
    assert [name for name, _ in core_ops.CConfig._fields_] == list(CONFIG_FIELDS)
    for struct, c_name in ((core_ops.CConfig, b"pnmix_config"), (core_ops.CLayout, b"pnmix_layout"),
                           (core_ops.CState, b"pnmix_state"), (core_ops.CPagedState, b"pnmix_paged_state"),
                           (core_ops.CPagedSequence, b"pnmix_paged_sequence"),
                           (core_ops.COpenMPTeam, b"pnmix_openmp_team")):
        assert lib.pnmix_core_struct_offset(c_name, None) == ctypes.sizeof(struct), c_name
        for name, _ in struct._fields_:
            assert lib.pnmix_core_struct_offset(c_name, name.encode()) == getattr(struct, name).offset, (c_name, name)
    assert lib.pnmix_core_struct_offset(b"pnmix_config", b"no_such_field") == -1
    assert lib.pnmix_core_struct_offset(b"no_such_struct", None) == -1


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunks", [[300], [1] * 90, [37, 1, 1, 64, 5, 130, 2], [7, 200, 1, 1, 1]])
def test_append_bytes_identical_to_reference(ops, name, chunks):
    config = CONFIGS[name]
    total = sum(chunks)
    layout = CacheLayout(config, 2, 3, 16, total)
    k, v = make_random_kv(2, 3, total, 16, seed=total + len(chunks))
    ours, n = run_schedule(ops.append, layout, chunks, k, v)
    ref, _ = run_schedule(append_reference, layout, chunks, k, v)
    for key in STATE_NAMES:
        assert torch.equal(ours[key], ref[key]), f"{key} differs ({name}, {chunks})"
    assert dump.dump_state(layout, ours, n) == dump.dump_state(layout, ref, n)


@pytest.mark.parametrize("name", ["manifest", "other", "one_bit"])
def test_append_bytes_identical_with_a_head_dim_past_whole_vectors(ops, name):
    """head_dim 18: the last two key channels (and value blocks of 18) take the scalar path beside
    the four-lane one."""
    config = CONFIGS[name].replace(value_bits=4, value_group_size=128)
    layout = CacheLayout(config, 1, 2, 18, 300)
    k, v = make_random_kv(1, 2, 300, 18, seed=17)
    ours, _ = run_schedule(ops.append, layout, [300], k, v)
    ref, _ = run_schedule(append_reference, layout, [300], k, v)
    for key in STATE_NAMES:
        assert torch.equal(ours[key], ref[key]), key


def test_append_edge_values_identical(ops):
    """Constant channels (step 0), huge values (saturating fp16 steps), subnormals, zeros of both
    signs where they are a block's minimum or maximum, NaN."""
    config = PnMixConfig(group_size=16, residual_size=16, sink_tokens=0)
    layout = CacheLayout(config, 1, 2, 16, 64)
    k, v = make_random_kv(1, 2, 64, 16, seed=3)
    k[:, :, :, 0] = 1.5  # constant channel -> step 0 -> codes 0
    k[:, 0, :8, 3] = 65504.0
    k[:, 0, 8:16, 3] = -65504.0  # max - min overflows fp16: step saturates
    v[:, 1, :, 4:8] = torch.tensor(6e-8).half()  # subnormal fp16
    v[:, 1, 5, :] = 0.0
    v[:, 0, 9, :] = v[:, 0, 9, :].abs()  # a token whose minimum is a zero, -0.0 before +0.0
    v[:, 0, 9, 2], v[:, 0, 9, 6] = -0.0, 0.0
    v[:, 0, 10, :] = -v[:, 0, 10, :].abs()  # and one whose maximum is, +0.0 before -0.0
    v[:, 0, 10, 3], v[:, 0, 10, 11] = 0.0, -0.0
    k[:, 1, 20:24, 5] = 0.0  # a channel's minimum among zeros of both signs
    k[:, 1, 21, 5] = -0.0
    k[:, 1, 16:32, 6] = k[:, 1, 16:32, 6].abs()
    k[:, 1, 18, 6], k[:, 1, 19, 6] = -0.0, 0.0
    k[:, 1, 40, 7] = float("nan")  # NaN propagates into the group's step and offset
    v[:, 1, 41, 9] = float("nan")
    ours, _ = run_schedule(ops.append, layout, [64], k, v)
    ref, _ = run_schedule(append_reference, layout, [64], k, v)
    for key in STATE_NAMES:  # as bytes: NaN is not equal to itself
        assert torch.equal(ours[key].view(torch.uint8), ref[key].view(torch.uint8)), key


@pytest.mark.parametrize("name", ["manifest", "other", "odd", "wide", "eight", "one_bit"])
def test_attention_within_tolerance_of_reference(ops, name):
    config = CONFIGS[name]
    seq_len, n_new = 700, 5
    layout = CacheLayout(config, 2, 2, 32, seq_len)
    k, v = make_random_kv(2, 2, seq_len + n_new, 32, seed=11)
    state, _ = run_schedule(append_reference, layout, [500, 1, 199], k[:, :, :seq_len], v[:, :, :seq_len])
    k_new, v_new = k[:, :, seq_len:], v[:, :, seq_len:]
    q = torch.randn(2, 8, 4, 32, generator=torch.Generator().manual_seed(5)).half()
    expected = reference.attend(q, layout, state, seq_len, k_new, v_new)
    for isa in ops.each_kernel():
        for threads in (1, 3):
            ops.threads = threads
            got = ops.attend(q, layout, state, seq_len, k_new, v_new)
            assert (got - expected).abs().max().item() <= 1e-3, (isa, threads)
        # decode shape: one query, no new tokens; fp32 query
        got = ops.attend(q[:, :, -1:].float(), layout, state, seq_len, None, None)
        want = reference.attend(q[:, :, -1:].float(), layout, state, seq_len)
        assert (got - want).abs().max().item() <= 1e-3, isa
    ops.threads = 0


@pytest.mark.parametrize("arith_name", ["fp32", "int8"])
def test_a_decode_step_in_one_call_is_bit_identical_to_attend_then_append(ops, arith_name):
    """attend_append (one set of checks and C structs) against attend and then append, step by
    step across flushes, on every kernel: the same output and the same state bytes."""
    layout = CacheLayout(CONFIGS["other"], 2, 2, 32, 520)
    k, v = make_random_kv(2, 2, 520, 32, seed=3)
    q = torch.randn(2, 8, 1, 32, generator=torch.Generator().manual_seed(6)).half()
    try:
        for isa in ops.each_kernel():
            ops.set_arith(arith_name if isa != "scalar" else "fp32")
            apart, seq_len = run_schedule(ops.append, layout, [300], k, v)
            together = {name: t.clone() for name, t in apart.items()}
            for t in range(seq_len, 520):
                new_k, new_v = k[:, :, t:t + 1], v[:, :, t:t + 1]
                want = ops.attend(q, layout, apart, t, new_k, new_v)
                ops.append(layout, apart, t, new_k, new_v)
                assert torch.equal(ops.attend_append(q, layout, together, t, new_k, new_v), want), (isa, t)
            assert dump.dump_state(layout, apart, 520) == dump.dump_state(layout, together, 520), isa
    finally:
        ops.set_arith("auto")


def test_a_decode_step_of_fp32_kv_rounds_them_as_the_cache_does(ops):
    """attend_append of the model's fp32 K/V (rounded in the C call) equals it on the same K/V
    rounded to fp16 by torch, bit for bit: output and state."""
    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 400)
    k, v = make_random_kv(1, 2, 400, 32, seed=8, dtype=torch.float32)
    k[0, 0, 390, :4] = torch.tensor([65519.0, -65520.0 + 16, 2.0 ** -25, 3e-8])  # edges of fp16's rounding
    q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(2))
    as_fp32, _ = run_schedule(ops.append, layout, [384], k, v)
    as_fp16 = {name: t.clone() for name, t in as_fp32.items()}
    for t in range(384, 400):
        new_k, new_v = k[:, :, t:t + 1], v[:, :, t:t + 1]
        got = ops.attend_append(q, layout, as_fp32, t, new_k, new_v)
        want = ops.attend_append(q, layout, as_fp16, t, new_k.half(), new_v.half())
        assert torch.equal(got, want), t
    assert dump.dump_state(layout, as_fp32, 400) == dump.dump_state(layout, as_fp16, 400)


def test_fp32_queries_rounded_in_the_call_equal_the_fp16_cast(ops):
    """attend_append_checked(query_as_fp16=True) on fp32 queries (rounded in the C call, the
    encoding PNMIX_QUERY_FP32_AS_FP16) against the same step on the queries cast to fp16 by torch:
    bit for bit, output and state, on every kernel and both arithmetics; without the flag the
    fp32 queries are used as they are."""
    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 420)
    k, v = make_random_kv(1, 2, 420, 32, seed=9, dtype=torch.float32)
    q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(3))
    q[0, 0, 0, :4] = torch.tensor([65519.0, 2.0 ** -25, 1.0 + 2.0 ** -11, 3e-8])  # fp16's rounding edges
    try:
        for isa in ops.each_kernel():
            for arith_name in (("fp32", "int8") if isa != "scalar" else ("fp32",)):
                ops.set_arith(arith_name)
                rounded, _ = run_schedule(ops.append, layout, [384], k, v)
                cast = {name: t.clone() for name, t in rounded.items()}
                for t in range(384, 420):
                    new_k, new_v = k[:, :, t:t + 1], v[:, :, t:t + 1]
                    got = ops.attend_append_checked(q, layout, rounded, t, new_k, new_v, query_as_fp16=True)
                    want = ops.attend_append_checked(q.half(), layout, cast, t, new_k, new_v)
                    assert torch.equal(got, want), (isa, arith_name, t)
                assert dump.dump_state(layout, rounded, 420) == dump.dump_state(layout, cast, 420), isa
        exact = ops.attend(q, layout, rounded, 420)
        assert not torch.equal(exact, ops.attend(q.half(), layout, rounded, 420))  # fp32 used as it is
        new_k, new_v = k[:, :, -1:], v[:, :, -1:]  # and by attend_append_checked without the flag
        as_is = ops.attend_append_checked(q, layout, {n: t.clone() for n, t in rounded.items()}, 419, new_k, new_v)
        assert not torch.equal(as_is, ops.attend_append_checked(q.half(), layout, cast, 419, new_k, new_v))
    finally:
        ops.set_arith("auto")


def test_an_unknown_query_encoding_is_refused(ops):
    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 64)
    state = layout.empty_state()
    q = torch.zeros(1, 4, 1, 32)
    out = torch.empty(1, 4, 1, 32)
    lay, st = native.call_structs(layout, state, core_ops._on_cpu)
    for encoding in (-1, 3):
        status = ops.lib.pnmix_attend(lay, st, 0, q.data_ptr(), encoding, 4, 1, q.nbytes, None, None, 0, 0,
                                      out.data_ptr(), out.nbytes, 1)
        assert status == 2  # PNMIX_ERR_CONFIG
        assert b"query encodings are 0 (fp16), 1 (fp32) and 2" in ops.lib.pnmix_last_error()
        # a paged batch checks it once, before its sequences: an empty batch too
        assert ops.lib.pnmix_attend_paged_batch(lay, None, 0, encoding, 4, 1) == 2
        assert ops.lib.pnmix_last_error().startswith(b"q_is_fp32")


def test_a_decode_step_of_any_float_kv_equals_the_caches_fp16(ops):
    """bf16, fp64, a mix of dtypes and non-contiguous K/V through attend_append: the output and
    bytes of the same step given fp16_kv's fp16 K/V."""
    from pnmix.cache import fp16_kv

    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 400)
    k, v = make_random_kv(1, 2, 390, 32, seed=4, dtype=torch.float64)
    q = torch.randn(1, 4, 1, 32).half()
    base, seq_len = run_schedule(ops.append, layout, [384], k.half(), v.half())
    new_k, new_v = k[:, :, seq_len:seq_len + 1], v[:, :, seq_len:seq_len + 1]
    strided = torch.randn(1, 1, 2, 32, dtype=torch.float64).transpose(1, 2)  # [1, 2, 1, 32], not dense
    for key, value in [(new_k.bfloat16(), new_v.bfloat16()), (new_k, new_v), (new_k.half(), new_v.float()),
                       (strided, new_v.float()), (new_k.float(), strided.bfloat16())]:
        state = {name: t.clone() for name, t in base.items()}
        want_state = {name: t.clone() for name, t in base.items()}
        got = ops.attend_append(q, layout, state, seq_len, key, value)
        want = ops.attend_append(q, layout, want_state, seq_len, *fp16_kv(key, value, key.device, seq_len))
        assert torch.equal(got, want), (key.dtype, value.dtype)
        assert all(torch.equal(state[name], want_state[name]) for name in STATE_NAMES), (key.dtype, value.dtype)


NON_FINITE = [("keys", float("nan")), ("values", float("inf")), ("keys", -float("inf"))]


@pytest.mark.parametrize("dtype, which, value", [(torch.float16, *case) for case in NON_FINITE] +
                         [(torch.float32, *case) for case in NON_FINITE + [("values", 70000.0)]])
def test_a_decode_step_with_non_finite_kv_is_refused_and_writes_nothing(ops, dtype, which, value):
    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 400)
    k, v = make_random_kv(1, 2, 390, 32, seed=8, dtype=torch.float32)
    state, seq_len = run_schedule(ops.append, layout, [384, 1], k, v)
    before = {name: t.clone() for name, t in state.items()}
    new_k, new_v = (t[:, :, seq_len:seq_len + 2].clone() for t in (k, v))
    (new_k if which == "keys" else new_v)[0, 1, 1, 5] = value
    q = torch.randn(1, 4, 2, 32)
    with pytest.raises(PnMixError, match=f"new {which} hold non-finite values .* at tokens 385..386"):
        ops.attend_append(q, layout, state, seq_len, new_k.to(dtype), new_v.to(dtype))
    assert all(torch.equal(before[name], state[name]) for name in STATE_NAMES)


def test_attention_prefill_and_causality(ops):
    """Empty cache: causal attention over the new tokens alone; each query sees only its past."""
    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 64)
    state = layout.empty_state()
    k, v = make_random_kv(1, 2, 40, 32, seed=2)
    q = torch.randn(1, 4, 40, 32).half()
    got = ops.attend(q, layout, state, 0, k, v)
    assert (got - reference.attend(q, layout, state, 0, k, v)).abs().max().item() <= 1e-3
    # the first query sees only key 0: its output is exactly value 0
    assert torch.allclose(got[0, 0, 0], v[0, 0, 0].float(), atol=1e-6)


def test_fp16_conversions_exhaustive(ops):
    lib = ops.lib
    every_half = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    as_float = torch.empty(65536, dtype=torch.float32)
    core_ops.check(lib, lib.pnmix_half_to_float(every_half.data_ptr(), as_float.data_ptr(), 65536))
    expected = every_half.view(torch.float16).float()
    same = (as_float == expected) | (as_float.isnan() & expected.isnan())
    assert bool(same.all())
    g = torch.Generator().manual_seed(0)
    floats = torch.cat([
        torch.randn(200000, generator=g) * 10.0 ** torch.randint(-9, 6, (200000,), generator=g),
        expected[~expected.isnan()],  # exact halves
        (expected[~expected.isnan() & expected.isfinite()].double() * (1 + 2.0 ** -11)).float(),  # ties
        torch.tensor([65504.0, 65519.0, 65520.0, 1e9, -1e9, math.inf, -math.inf, 2.0 ** -25, 2.0 ** -26]),
    ])
    for saturating in (0, 1):
        out = torch.empty(floats.numel(), dtype=torch.int16)
        core_ops.check(lib, lib.pnmix_float_to_half(floats.data_ptr(), out.data_ptr(), floats.numel(), saturating))
        want = (floats.clamp(-65504, 65504) if saturating else floats).to(torch.float16).view(torch.int16)
        assert torch.equal(out, want), f"saturating={saturating}"


# ---- the .pnkv dump through the C decoder ---------------------------------------------------


def make_cache(config=CONFIGS["other"], seq_len=300):
    layout = CacheLayout(config, 2, 2, 32, seq_len)
    k, v = make_random_kv(2, 2, seq_len, 32, seed=9)
    state, n = run_schedule(append_reference, layout, [seq_len - 3, 1, 2], k, v)
    return layout, state, n


def test_dump_write_and_read_match_python():
    layout, state, n = make_cache()
    blob = dump.dump_state(layout, state, n)
    assert core_ops.dump_state(layout, state, n) == blob
    lay2, state2, n2 = core_ops.load_state(blob)
    assert (n2, lay2.config, lay2.batch, lay2.kv_heads, lay2.head_dim) == (n, layout.config, 2, 2, 32)
    assert dump.dump_state(lay2, state2, n2) == blob


def _corrupt(blob: bytes, offset: int, data: bytes) -> bytes:
    return blob[:offset] + data + blob[offset + len(data):]


@pytest.mark.parametrize("mutation, message", [
    (lambda b: b[:40], "too short"),
    (lambda b: b[:-1], "size mismatch"),
    (lambda b: b + b"\0", "size mismatch"),
    (lambda b: _corrupt(b, 0, b"PNKX"), "magic"),
    (lambda b: _corrupt(b, 4, b"\x02\x00"), "version"),
    (lambda b: _corrupt(b, 27, b"\x07"), "pair_layout"),
    (lambda b: _corrupt(b, 8, (12).to_bytes(4, "little")), "group_size"),  # not a multiple of 8
    (lambda b: _corrupt(b, 52, (301).to_bytes(8, "little")), "size mismatch"),  # seq_len vs sections
    (lambda b: _corrupt(b, 28, (3).to_bytes(4, "little")), "size mismatch"),  # batch vs sections
    (lambda b: _corrupt(b, 52, (1 << 50).to_bytes(8, "little")), "implausible"),
    (lambda b: _corrupt(b, 36, (31).to_bytes(4, "little")), "head_dim"),
    (lambda b: _corrupt(b, 40, b"\x01"), "reserved header fields"),
    (lambda b: _corrupt(b, 60, b"\x00\x00\x00\x80"), "reserved header fields"),
    (lambda b: _corrupt(b, 16, (1 << 20 | 8).to_bytes(4, "little")), "sink_tokens' must be <= 1048576"),
    (lambda b: _corrupt(b, 20, (1 << 31).to_bytes(4, "little")), "value_group_size.*int32"),
    # sink rows of 2^20 tokens for 1024 sequences: a 2^38-byte state from a 64-byte header
    (lambda b: _corrupt(_corrupt(b, 16, (1 << 20).to_bytes(4, "little")), 28, (1024).to_bytes(4, "little")),
     "implausible"),
    (lambda b: b[:-1] + b"\xff", "pair_mask marks"),  # the last byte: 8 high pairs in KV head 1
])
def test_dump_with_inconsistent_header_fails_cleanly(mutation, message):
    layout, state, n = make_cache()
    bad = mutation(dump.dump_state(layout, state, n))
    with pytest.raises(PnMixError, match=message):
        core_ops.load_state(bad)
    with pytest.raises(PnMixError):  # format.load_state refuses it too (FORMAT.md 6's reader rules)
        dump.load_state(bad)


def test_dump_value_group_size_takes_pythons_limit():
    """value_group_size is any int32 >= 1 (vg = min(value_group_size, D)), in both decoders."""
    layout, state, n = make_cache(CONFIGS["other"].replace(value_group_size=(1 << 31) - 1), seq_len=200)
    blob = dump.dump_state(layout, state, n)
    lay2, state2, n2 = core_ops.load_state(blob)
    assert lay2.config.value_group_size == (1 << 31) - 1 and dump.dump_state(lay2, state2, n2) == blob


def test_limits_agree_with_python():
    """params.h and pnmix/config.py (and format.py's dump slack) state the same limits."""
    from pnmix import config

    lib = core_ops.core_library()
    lib.pnmix_core_limit.argtypes, lib.pnmix_core_limit.restype = [ctypes.c_char_p], ctypes.c_int64
    python = {"max_tokens_field": config.MAX_TOKENS_FIELD, "max_int_field": config.MAX_INT_FIELD,
              "max_batch": config.MAX_BATCH, "max_kv_heads": config.MAX_KV_HEADS,
              "max_head_dim": config.MAX_HEAD_DIM, "max_seq_len": config.MAX_SEQ_LEN,
              "max_state_tensor_bytes": config.MAX_STATE_TENSOR_BYTES, "dump_slack_bytes": dump.DUMP_SLACK_BYTES}
    assert {name: lib.pnmix_core_limit(name.encode()) for name in python} == python
    assert lib.pnmix_core_limit(b"no_such_limit") == -1 and lib.pnmix_core_limit(None) == -1


@pytest.mark.parametrize("sink, layout_args, accepted", [
    (32, (1 << 20, 1, 4, 1), True), (32, ((1 << 20) + 1, 1, 4, 1), False),
    (32, (1, 4096, 4096, 1), True), (32, (1, 4097, 4, 1), False), (32, (1, 1, 4098, 1), False),
    (32, (1, 1, 4, 1 << 40), True), (32, (1, 1, 4, (1 << 40) + 1), False),
    (32, (1 << 20, 4096, 4096, 1), True),  # sink_k [2^20, 4096, 32, 4096] fp16: 2^50 bytes exactly
    (33, (1 << 20, 4096, 4096, 1), False),  # one sink row more: past 2^50
])
def test_layout_limits_agree_with_python(sink, layout_args, accepted):
    config = PnMixConfig(group_size=8, residual_size=8, sink_tokens=sink, value_group_size=2)
    try:
        CacheLayout(config, *layout_args)
        python_accepts = True
    except PnMixError:
        python_accepts = False
    assert python_accepts == accepted
    fields = config.to_dict()
    fields["pair_layout"] = 0
    lay = core_ops.CLayout(core_ops.CConfig(**fields), *layout_args)
    lib = core_ops.core_library()
    assert (lib.pnmix_state_bytes(ctypes.byref(lay), (ctypes.c_int64 * 11)()) == 0) == accepted, lib.pnmix_last_error()


def test_attend_and_append_refuse_a_state_with_a_wrong_pair_mask(ops):
    """Key offsets come from the mask: a wrong high-pair count must not reach the kernels."""
    layout, state, n = make_cache()  # high_ratio 0.25: 4 of 16 pairs per head
    q = torch.randn(2, 4, 1, 32).half()
    k, v = make_random_kv(2, 2, 1, 32, seed=3)
    good = state["pair_mask"].clone()
    for bad, needle in ((torch.full_like(good, 0xFF), "marks 16 high pairs"),
                        (torch.zeros_like(good), "marks 0 high pairs")):
        state["pair_mask"].copy_(bad)
        with pytest.raises(PnMixError, match=needle):
            ops.attend(q, layout, state, n)
        with pytest.raises(PnMixError, match=needle):
            ops.append(layout, state, n - 1, k, v)
    state["pair_mask"].copy_(good)
    ops.attend(q, layout, state, n)


# ---- bad input through the raw C ABI ---------------------------------------------------------


@pytest.fixture
def abi():
    lib = core_ops.core_library()
    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 400)
    state = layout.empty_state()
    return lib, layout, core_ops.c_layout(layout), state, core_ops.c_state(state)


def _error(lib, status):
    assert status != 0
    message = lib.pnmix_last_error().decode()
    assert message and "\n" not in message
    return status, message


def test_a_calls_structs_are_built_once_and_again_when_a_tensor_is_replaced():
    layout = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 400)
    state = layout.empty_state()
    shared = native.state_struct(state, core_ops._on_cpu)
    assert native.state_struct(state, core_ops._on_cpu) is shared  # a decode step's calls: no checks, no copy
    copy_ = core_ops.c_state(state)
    assert copy_ is not shared and bytes(copy_) == bytes(shared)  # c_state: a copy the caller may change
    name = STATE_NAMES[0]
    state[name] = state[name].clone()  # a cache that changes its state replaces the tensor
    rebuilt = native.state_struct(state, core_ops._on_cpu)
    assert rebuilt is not shared and rebuilt.data[0] == state[name].data_ptr()
    state[name] = state[name].double()  # the replacement is checked before any struct is kept
    with pytest.raises(PnMixError, match=f"'{name}' must be a contiguous"):
        native.state_struct(state, core_ops._on_cpu)
    with pytest.raises(PnMixError, match=f"'{name}' must be a contiguous"):
        native.state_struct(state, core_ops._on_cpu)  # refused again, not found in a cache
    state[name] = state[name].float()  # (an fp32 copy of the uint8 tensor: refused alike)
    good = layout.empty_state()
    native.state_struct(good, core_ops._on_cpu)
    del good[STATE_NAMES[1]]  # the same dict, a tensor gone: refused, not served the struct of before
    with pytest.raises(PnMixError, match=f"missing tensor '{STATE_NAMES[1]}'"):
        native.state_struct(good, core_ops._on_cpu)
    good.clear()
    with pytest.raises(PnMixError, match="missing tensor"):
        native.state_struct(good, core_ops._on_cpu)
    assert native.layout_struct(layout) is native.layout_struct(layout)
    other = CacheLayout(CONFIGS["manifest"], 1, 2, 32, 800)
    assert native.layout_struct(other).max_seq_len == 800 and native.layout_struct(layout).max_seq_len == 400


def test_null_pointers_rejected(abi):
    lib, layout, lay, state, st = abi
    k, v = make_random_kv(1, 2, 4, 32, seed=0)
    code, msg = _error(lib, lib.pnmix_append(None, ctypes.byref(st), 0, k.data_ptr(), v.data_ptr(), 4, k.numel() * 2))
    assert code == 1 and "layout" in msg
    code, msg = _error(lib, lib.pnmix_append(ctypes.byref(lay), None, 0, k.data_ptr(), v.data_ptr(), 4, k.numel() * 2))
    assert code == 1 and "state" in msg
    code, msg = _error(lib, lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), 0, None, v.data_ptr(), 4, k.numel() * 2))
    assert code == 1
    st.data[4] = None
    code, msg = _error(lib, lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), 0, k.data_ptr(), v.data_ptr(), 4, k.numel() * 2))
    assert code == 1 and "key_codes" in msg
    out = torch.empty(1, 4, 1, 32)
    code, _ = _error(lib, lib.pnmix_attend(ctypes.byref(lay), ctypes.byref(core_ops.c_state(state)), 4, None, 0, 4, 1,
                                           4 * 32 * 2, None, None, 0, 0, out.data_ptr(), out.numel() * 4, 1))
    assert code == 1
    code, _ = _error(lib, lib.pnmix_dump_header(None, 64, ctypes.byref(lay), None))
    assert code == 1


def test_wrong_sizes_rejected(abi):
    lib, layout, lay, state, st = abi
    k, v = make_random_kv(1, 2, 4, 32, seed=0)
    code, msg = _error(lib, lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), 0, k.data_ptr(), v.data_ptr(), 4, k.numel() * 2 - 2))
    assert code == 3 and "bytes" in msg
    st.nbytes[0] -= 2
    code, msg = _error(lib, lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), 0, k.data_ptr(), v.data_ptr(), 4, k.numel() * 2))
    assert code == 3 and "sink_k" in msg
    st = core_ops.c_state(state)
    q = torch.randn(1, 4, 1, 32).half()
    out = torch.empty(1, 4, 1, 32)
    args = dict(seq_len=0, q_heads=4, nq=1, q_bytes=q.numel() * 2, n_new=0, new_bytes=0, out_bytes=out.numel() * 4)

    def attend(**changes):
        a = {**args, **changes}
        return lib.pnmix_attend(ctypes.byref(lay), ctypes.byref(st), a["seq_len"], q.data_ptr(), 0, a["q_heads"],
                                a["nq"], a["q_bytes"], None, None, a["n_new"], a["new_bytes"], out.data_ptr(),
                                a["out_bytes"], 1)

    assert _error(lib, attend())[1].startswith("nq 1 outside")  # nothing to attend to
    assert "q_heads" in _error(lib, attend(seq_len=4, q_heads=3))[1]
    assert "q buffer" in _error(lib, attend(seq_len=4, q_bytes=10))[1]
    assert "out buffer" in _error(lib, attend(seq_len=4, out_bytes=8))[1]
    assert "seq_len" in _error(lib, attend(seq_len=401))[1]
    assert "new K/V" in _error(lib, attend(seq_len=4, new_bytes=2))[1]
    code, msg = _error(lib, attend(seq_len=4))  # the empty state's mask has no high pairs
    assert code == 7 and "pair_mask" in msg
    state["pair_mask"].copy_(packing.pack_pair_mask(reference.saliency_mask(k, layout)))
    assert attend(seq_len=4) == 0


def test_attend_append_checks_everything_before_it_writes(abi):
    lib, layout, lay, state, _ = abi
    k, v = make_random_kv(1, 2, 401, 32, seed=0, dtype=torch.float32)  # one past the capacity of 400
    state.update(run_schedule(append_reference, layout, [398], k[:, :, :398].half(), v[:, :, :398].half())[0])
    st = core_ops.c_state(state)
    before = {name: t.clone() for name, t in state.items()}
    q = torch.randn(1, 4, 1, 32)
    out = torch.empty(1, 4, 1, 32)

    def step(seq_len=398, n_new=1, new_bytes=None, is_fp32=1, new_k=None, q_bytes=q.numel() * 4):
        new_k = k[:, :, seq_len:seq_len + n_new].contiguous() if new_k is None else new_k
        new_v = v[:, :, seq_len:seq_len + n_new].contiguous()
        size = new_k.numel() * (4 if is_fp32 else 2) if new_bytes is None else new_bytes
        return lib.pnmix_attend_append(ctypes.byref(lay), ctypes.byref(st), seq_len, q.data_ptr(), 1, 4, 1,
                                       q_bytes, new_k.data_ptr(), new_v.data_ptr(), is_fp32, n_new, size,
                                       out.data_ptr(), out.numel() * 4, 1)

    assert "n_new must be in 1.." in _error(lib, step(n_new=0, new_bytes=0))[1]
    code, msg = _error(lib, step(new_bytes=2 * 32 * 2))  # fp16's size for fp32 K/V
    assert code == 3 and "fp32 needs 256" in msg
    code, msg = _error(lib, step(seq_len=398, n_new=3))  # 398 + 3 > 400
    assert code == 4 and "capacity" in msg
    bad = k[:, :, 398:399].clone()
    bad[0, 1, 0, 7] = 1e5  # beyond fp16's range
    code, msg = _error(lib, step(new_k=bad))
    assert code == 8 and "new keys" in msg and "not finite in fp16" in msg
    assert "q buffer" in _error(lib, step(q_bytes=q.numel() * 4 - 4))[1]  # the attention's check, after the append's
    assert all(torch.equal(before[name], state[name]) for name in STATE_NAMES)
    assert step() == 0 and step(seq_len=399) == 0  # the same arguments, finite and in range, go in
    assert not torch.equal(before["residual_k"], state["residual_k"])




# no group yet; groups (each dequantized once for the tiles); more keys than one batch of the tiles
# holds (1024: the batch runs in the middle of the work item, and again at its end)
@pytest.mark.parametrize("seq_len", [150, 700, 1400])
@pytest.mark.parametrize("name, head_dim", [("manifest", 64), ("odd", 40)])
def test_a_long_chunk_splits_its_rows_and_stays_within_tolerance(ops, name, head_dim, seq_len):
    """A chunk of many queries (a prompt's later chunk) over a cache: its rows are split into
    blocks that each read every key, the fp16 tokens and the dequantized groups go through the
    block-tiled products (head dims that are not a multiple of the vector width take the scalar
    tail). Every kernel and thread count stays within tolerance of the reference, and the first
    query sees exactly what a one-query call at its position sees."""
    config = CONFIGS[name]
    n_new = 203  # a partial key block at the end
    layout = CacheLayout(config, 1, 2, head_dim, seq_len + n_new)
    k, v = make_random_kv(1, 2, seq_len + n_new, head_dim, seed=21)
    state, _ = run_schedule(append_reference, layout, [seq_len], k[:, :, :seq_len], v[:, :, :seq_len])
    k_new, v_new = k[:, :, seq_len:], v[:, :, seq_len:]
    q = torch.randn(1, 6, n_new, head_dim, generator=torch.Generator().manual_seed(8)).half()
    expected = reference.attend(q, layout, state, seq_len, k_new, v_new)
    first = reference.attend(q[:, :, :1], layout, state, seq_len, k_new[:, :, :1], v_new[:, :, :1])
    assert (expected[:, :, :1] - first).abs().max().item() <= 1e-5  # the reference is causal
    for isa in ops.each_kernel():
        for threads in (1, 2, 3):
            ops.threads = threads
            got = ops.attend(q, layout, state, seq_len, k_new, v_new)
            assert (got - expected).abs().max().item() <= 1e-3, (isa, threads)
    ops.threads = 0


def test_attention_on_a_callers_pool_is_bit_identical(ops):
    """pnmix_attend_on hands every work item to the caller's parallel-for (ONNX Runtime's pool in
    libpnmix_ort): here one that runs them in reverse order. Each item runs once and the output is
    bit-identical to the core's own pool; a runner that fails is one error line."""
    lib = core_ops.core_library()
    attend_on = lib.pnmix_attend_on
    # 9.7 MB of packed bytes: 4 threads by either rule, so both split the work alike (the split,
    # and with it the order of the softmax merge, follows the thread count)
    layout = CacheLayout(CONFIGS["manifest"], 1, 8, 128, 16384)
    k, v = make_random_kv(1, 8, 16000, 128, seed=3)
    state, seq_len = run_schedule(ops.append, layout, [16000], k, v)
    lay, st = core_ops.c_layout(layout), core_ops.c_state(state)
    q = torch.randn(1, 32, 1, 128)
    want, got = torch.empty(1, 32, 1, 128), torch.full((1, 32, 1, 128), float("nan"))
    args = (ctypes.byref(lay), ctypes.byref(st), seq_len, q.data_ptr(), 1, 32, 1, q.numel() * 4, None, None, 0, 0)
    assert lib.pnmix_attend(*args, want.data_ptr(), want.numel() * 4, 4) == 0
    ran: list = []
    runner = reverse_order_runner(ran)
    assert attend_on(*args, got.data_ptr(), got.numel() * 4, 4, native.address(runner), None) == 0
    assert len(ran) > 4 and sorted(ran) == list(range(len(ran)))  # split for 4 threads, each item once
    assert torch.equal(got, want)
    failing = RUNNER(lambda *a: 1)
    code, message = _error(lib, attend_on(*args, got.data_ptr(), got.numel() * 4, 4, native.address(failing), None))
    assert code == 6 and "parallel-for" in message
    # null runner: the core's own pool
    got.fill_(float("nan"))
    assert attend_on(*args, got.data_ptr(), got.numel() * 4, 4, None, None) == 0 and torch.equal(got, want)
    # torch's OpenMP team (pnmix_openmp_parallel_for): the same split, so the same bits
    gomp_parallel = core_ops.torch_gomp_parallel()
    if gomp_parallel is not None:
        got.fill_(float("nan"))
        runner, team = native.address(lib.pnmix_openmp_parallel_for), core_ops.COpenMPTeam(gomp_parallel, 2)
        assert attend_on(*args, got.data_ptr(), got.numel() * 4, 4, runner, ctypes.addressof(team)) == 0
        assert torch.equal(got, want)
        empty = core_ops.COpenMPTeam(None, 2)  # no GOMP_parallel: nothing run, one error line
        code, message = _error(lib, attend_on(*args, got.data_ptr(), got.numel() * 4, 4, runner, ctypes.addressof(empty)))
        assert code == 6 and "parallel-for" in message


@pytest.mark.parametrize("heads, tokens, threads, items", [
    ((9, 3, 64), 8192, 2, 6), ((9, 3, 64), 8192, 4, 12), ((9, 3, 64), 32768, 2, 18), ((9, 3, 64), 2048, 2, 6),
    ((32, 8, 128), 8192, 2, 16)])
def test_a_calls_splits_hold_a_floor_of_work_unless_threads_want_more(ops, heads, tokens, threads, items):
    """A work item costs a few groups' time besides its groups (its rows' set-up, the integer path's
    channel order, a partial row to merge): a call splits a KV head's groups no finer than 32 of
    SmolLM2-135M's groups (head dim 64, 3 query rows) a split, or as much work, unless that leaves
    fewer than two items a thread, and then into whole rounds of the threads; 8 items a thread
    otherwise. SmolLM2's layer (9 query / 3 KV heads): 63 groups at 8K, 6 items on 2 threads (8 a
    thread asked for 18), 12 on 4 (two items a thread are 9: a last round of one); 255 groups at 32K,
    18 on 2; 15 groups at 2K, still two items a thread. The bench shape's groups (head dim 128, 4
    rows) hold 4 times the work: at 8K its 8 KV heads keep 2 splits, 16 items. Every item runs once."""
    q_heads, kv_heads, dim = heads
    lib = core_ops.core_library()
    layout = CacheLayout(PnMixConfig(), 1, kv_heads, dim, tokens)
    k, v = make_random_kv(1, kv_heads, tokens, dim, seed=5)
    state, seq_len = run_schedule(ops.append, layout, [tokens], k, v)
    lay, st = core_ops.c_layout(layout), core_ops.c_state(state)
    q = torch.randn(1, q_heads, 1, dim)
    want, got = torch.empty(1, q_heads, 1, dim), torch.full((1, q_heads, 1, dim), float("nan"))
    args = (ctypes.byref(lay), ctypes.byref(st), seq_len, q.data_ptr(), 1, q_heads, 1, q.numel() * 4, None, None, 0, 0)
    ran: list = []
    runner = reverse_order_runner(ran)
    assert lib.pnmix_attend_on(*args, got.data_ptr(), got.numel() * 4, threads, native.address(runner), None) == 0
    assert sorted(ran) == list(range(items))
    assert lib.pnmix_attend(*args, want.data_ptr(), want.numel() * 4, threads) == 0
    assert (got - want).abs().max().item() <= 1e-3  # the core's own split: the paths' rounding apart


def test_torch_threads_switch(monkeypatch):
    """CoreOps takes torch's OpenMP team unless told not to (the argument, else PNMIX_TORCH_THREADS,
    read where the ops are made: a copy reads it again); a bad switch is one line."""
    monkeypatch.delenv("PNMIX_TORCH_THREADS", raising=False)
    gomp_parallel = core_ops.torch_gomp_parallel()

    def on_team(ops: CoreOps) -> bool:
        assert (ops.team is None) == (ops.runner is None) == (ops.team_address is None)
        return ops.team is not None

    assert on_team(CoreOps()) == (gomp_parallel is not None) and not on_team(CoreOps(torch_threads=False))
    if gomp_parallel is not None:
        assert CoreOps().team.gomp_parallel == gomp_parallel and CoreOps(3).team.threads == 3
    monkeypatch.setenv("PNMIX_TORCH_THREADS", "0")
    ops = CoreOps()
    assert not on_team(ops) and on_team(CoreOps(torch_threads=True)) == (gomp_parallel is not None)
    monkeypatch.setenv("PNMIX_TORCH_THREADS", "1")
    assert on_team(copy.deepcopy(ops)) == (gomp_parallel is not None)  # the switch where the copy is made
    assert not on_team(copy.deepcopy(CoreOps(torch_threads=False)))  # an argument travels with the copy
    monkeypatch.setenv("PNMIX_TORCH_THREADS", "yes")
    with pytest.raises(PnMixError, match="PNMIX_TORCH_THREADS must be 0 or 1"):
        CoreOps()


def test_openmp_team_runs_every_item_once_on_its_threads():
    """pnmix_openmp_parallel_for shares the items out among the threads of an OpenMP team: every
    item runs exactly once, on more than one thread where the team has several; a null team or task
    runs nothing."""
    gomp_parallel = core_ops.torch_gomp_parallel()
    if gomp_parallel is None:
        pytest.skip("torch's intra-op threads are not on an OpenMP runtime")
    lib = core_ops.core_library()
    seen, threads, other_thread = [], set(), threading.Event()
    first = []

    def task(ctx, item):
        seen.append(item)
        me = threading.get_native_id()
        threads.add(me)
        if not first:
            first.append(me)
            other_thread.wait(timeout=10)  # until another thread of the team has taken an item
        elif me != first[0]:
            other_thread.set()

    callback = TASK(task)
    team = core_ops.COpenMPTeam(gomp_parallel, 2)
    assert lib.pnmix_openmp_parallel_for(ctypes.addressof(team), native.address(callback), None, 40) == 0
    assert sorted(seen) == list(range(40))
    assert other_thread.is_set() and len(threads) == 2
    seen.clear()
    assert lib.pnmix_openmp_parallel_for(None, native.address(callback), None, 4) == -1
    empty = core_ops.COpenMPTeam(None, 2)
    assert lib.pnmix_openmp_parallel_for(ctypes.addressof(empty), native.address(callback), None, 4) == -1
    assert lib.pnmix_openmp_parallel_for(ctypes.addressof(team), None, None, 4) == -1
    assert lib.pnmix_openmp_parallel_for(ctypes.addressof(team), native.address(callback), None, 0) == 0
    assert seen == []


def test_capacity_and_config_errors(abi, ops):
    lib, layout, lay, state, st = abi
    k, v = make_random_kv(1, 2, 10, 32, seed=0)
    code, msg = _error(lib, lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), 395, k.data_ptr(), v.data_ptr(), 10, k.numel() * 2))
    assert code == 4 and "capacity" in msg
    lay.config.group_size = 12
    code, msg = _error(lib, lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), 0, k.data_ptr(), v.data_ptr(), 10, k.numel() * 2))
    assert code == 2 and "group_size" in msg
    lay = core_ops.c_layout(layout)
    lay.head_dim = 31
    assert "head_dim" in _error(lib, lib.pnmix_state_bytes(ctypes.byref(lay), (ctypes.c_int64 * 11)()))[1]
    # through the backend: one-line PnMixError
    with pytest.raises(PnMixError, match="capacity exceeded"):
        ops.append(layout, state, 395, k, v)
    with pytest.raises(PnMixError, match="CPU tensors|contiguous"):
        ops.append(layout, {**state, "key_step": state["key_step"].transpose(2, 3)}, 0, k, v)


def test_state_bytes_match_python_layout():
    lib = core_ops.core_library()
    for config in CONFIGS.values():
        layout = CacheLayout(config, 3, 2, 48 if config.value_group_size <= 48 else 32, 1000)
        sizes = (ctypes.c_int64 * 11)()
        core_ops.check(lib, lib.pnmix_state_bytes(ctypes.byref(core_ops.c_layout(layout)), sizes))
        shapes = layout.state_shapes()
        for i, name in enumerate(STATE_NAMES):
            assert sizes[i] == math.prod(shapes[name]) * fmt.STATE_DTYPES[name].itemsize, name
        for seq_len in (0, 1, 37, 999, 1000):
            out = ctypes.c_int64()
            core_ops.check(lib, lib.pnmix_persistent_bytes(ctypes.byref(core_ops.c_layout(layout)), seq_len, ctypes.byref(out)))
            assert out.value == layout.persistent_bytes(seq_len)["persistent_cache_bytes"]


# ---- the integer path (pnmix_set_attend_arith("int8")) ------------------------------------------

INT8_CONFIGS = {  # (config, head_dim, what the integer path takes)
    "manifest_d128": (PnMixConfig(), 128, "int8"),
    "manifest_d64": (PnMixConfig(), 64, "int8"),  # 16-byte value rows: two tokens per vector
    "g32_k42_v4": (PnMixConfig(pair_layout="half", key_high_bits=4, key_low_bits=2, value_bits=4, group_size=32,
                               residual_size=96, sink_tokens=8, high_ratio=0.25), 64, "int8"),
    "v1_d128": (PnMixConfig(key_high_bits=2, key_low_bits=1, value_bits=1, group_size=64, residual_size=64,
                            high_ratio=0.3), 128, "int8"),
    "odd_pair_count": (PnMixConfig(high_ratio=0.3, pair_layout="half"), 64, "int8"),  # 19 channel pairs per class
    "value_blocks": (PnMixConfig(value_group_size=32), 128, "int8 keys, fp32 values"),
    "wide_keys": (PnMixConfig(key_high_bits=5, group_size=64, residual_size=64), 128, "fp32 keys, int8 values"),
    "odd": (CONFIGS["odd"], 32, "fp32"),
}
INT8_TOLERANCE = 0.05  # max |int8 - reference| on these caches (|output| up to ~1, peaked softmax)


def _int8_case(config, head_dim, seq_len=900, n_new=3, scale=2.0, seed=11):
    layout = CacheLayout(config, 1, 2, head_dim, seq_len + n_new)
    k, v = make_random_kv(1, 2, seq_len + n_new, head_dim, seed=seed)
    state, _ = run_schedule(append_reference, layout, [seq_len], k[:, :, :seq_len], v[:, :, :seq_len])
    q = torch.randn(1, 8, 2, head_dim, generator=torch.Generator().manual_seed(5)) * scale
    return layout, state, q, k[:, :, seq_len:], v[:, :, seq_len:]


HAS_VNNI = {"avx512vbmi", "avx512_vnni"} <= cpu_flags()  # the avx512vnni kernel's needs


@pytest.fixture(params=["avx2", "avx512vnni"])
def arith(ops, request):
    """The core with each of the integer path's kernels forced: the AVX2 pair kernel and the AVX-512
    VNNI one (skipped on a CPU without AVX-512 VBMI and VNNI)."""
    try:
        ops.set_isa(request.param)
    except PnMixError:
        pytest.skip(f"this CPU has no {request.param} kernel (it needs AVX-512 VBMI and VNNI)")
    yield ops
    ops.set_arith("auto")
    ops.set_isa("auto")
    ops.threads = 0


def test_int8_runs_the_vnni_kernel_where_the_cpu_has_it(ops):
    assert ops.isa() in ("scalar", "avx2", "avx512", "avx512vbmi")  # fp32: the fp32 kernels
    ops.set_arith("int8")
    try:
        assert ops.isa() == ("avx512vnni" if HAS_VNNI else "avx2")
        ops.set_isa("avx2")  # a forced AVX2 runs the pair kernel
        assert ops.isa() == "avx2"
    finally:
        ops.set_arith("auto")
        ops.set_isa("auto")
    if not HAS_VNNI:
        with pytest.raises(PnMixError, match="no AVX-512 VBMI and VNNI"):
            ops.set_isa("avx512vnni")


@pytest.mark.parametrize("name", list(INT8_CONFIGS))
def test_int8_path_stays_within_its_error_of_the_reference(arith, name, request):
    config, head_dim, expected_path = INT8_CONFIGS[name]
    layout, state, q, k_new, v_new = _int8_case(config, head_dim)
    seq_len = layout.max_seq_len - k_new.shape[2]
    want = reference.attend(q, layout, state, seq_len, k_new, v_new)
    arith.set_arith("fp32")
    exact = arith.attend(q, layout, state, seq_len, k_new, v_new)
    arith.set_arith("int8")
    assert arith.arith() == "int8" and arith.isa() == request.node.callspec.params["arith"]
    assert arith.arith_for(layout) == expected_path
    got = arith.attend(q, layout, state, seq_len, k_new, v_new)
    if expected_path == "fp32":  # nothing taken: the fp32 kernel, bit for bit
        assert torch.equal(got, exact)
    else:  # the rounding shows, and stays small
        assert (got - exact).abs().max().item() > 0
        assert (got - want).abs().max().item() <= INT8_TOLERANCE, name
    # A split over threads: in fp32 only the merge's rounding changes. On the integer path each work
    # item orders its channels by its first group's key steps (int8_order_channels) and rounds its
    # value weights against its own softmax maximum, so a split rounds otherwise, within the path's
    # error. (CoreOps on torch's threads splits this 300 KB cache; the core's own pool does not.)
    arith.threads = 1
    one = arith.attend(q, layout, state, seq_len, k_new, v_new)
    arith.threads = 3
    three = arith.attend(q, layout, state, seq_len, k_new, v_new)
    assert (one - three).abs().max().item() <= (1e-5 if expected_path == "fp32" else INT8_TOLERANCE)
    assert (three - want).abs().max().item() <= INT8_TOLERANCE


@pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX-512 VBMI and VNNI: one integer kernel only")
@pytest.mark.parametrize("name", [name for name, case in INT8_CONFIGS.items() if case[2] != "fp32"])
def test_the_two_integer_kernels_round_alike(ops, name):
    """The AVX2 pair kernel and the VNNI kernel round the same weights in the same blocks, so their
    integer sums are equal and their outputs differ by float rounding only (under 2e-6 measured),
    where either one's rounding error is about 1e-2: a weight rounded otherwise in one of them
    shows here (a block maximum taken over a lane of the next block gave 8e-3 to 2e-2), though not
    against the reference's looser tolerance."""
    config, head_dim, _ = INT8_CONFIGS[name]
    layout, state, q, k_new, v_new = _int8_case(config, head_dim)
    seq_len = layout.max_seq_len - k_new.shape[2]
    outs = []
    try:
        ops.set_arith("int8")
        for isa in ("avx2", "avx512vnni"):
            ops.set_isa(isa)
            outs.append(ops.attend(q, layout, state, seq_len, k_new, v_new))
    finally:
        ops.set_arith("auto")
        ops.set_isa("auto")
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


def test_a_chunk_under_the_integer_path_stays_within_its_error(arith):
    """A chunk of many queries with the integer path on: its packed groups go through the int8
    kernels, its fp16 tokens (sink, residual, its own) through the fp32 tiles, on one thread and
    two, within the integer path's error."""
    layout, state, _, k_new, v_new = _int8_case(PnMixConfig(), 64, n_new=40)
    q = torch.randn(1, 8, 40, 64, generator=torch.Generator().manual_seed(6)) * 2.0  # 160 rows per KV head
    seq_len = layout.max_seq_len - 40
    want = reference.attend(q, layout, state, seq_len, k_new, v_new)
    arith.set_arith("int8")
    assert arith.arith_for(layout) == "int8"
    for threads in (1, 2):
        arith.threads = threads
        got = arith.attend(q, layout, state, seq_len, k_new, v_new)
        assert (got - want).abs().max().item() <= INT8_TOLERANCE, threads


@pytest.mark.parametrize("head_dim", [128, 64])
def test_int8_value_weights_are_dithered_not_rounded_to_nearest(arith, head_dim):
    """In a peaked softmax most of a 128-token group's value weights are under half an int8 level of
    its largest: rounded to nearest they would all vanish, a bias that adds up over the groups (mean
    |error| 0.9-2.0e-2 over seeds 11-13, measured). Dithered they are right on average (2.6-4.4e-3).
    Keys stay fp32 here (5-bit), so this is the values' error alone."""
    config = PnMixConfig(key_high_bits=5, key_low_bits=5, group_size=128, residual_size=128)
    layout, state, q, _, _ = _int8_case(config, head_dim, seq_len=1500)
    want = reference.attend(q[:, :, :1], layout, state, 1500)
    arith.set_arith("int8")
    assert arith.arith_for(layout) == "fp32 keys, int8 values"
    got = arith.attend(q[:, :, :1], layout, state, 1500)
    assert (got - want).abs().mean().item() <= 6e-3


def test_int8_path_takes_negative_value_steps(arith):
    """A state whose value steps are negative (appends never write one; a hand-made state can) runs the
    signed variant and still agrees with the reference."""
    layout, state, q, k_new, v_new = _int8_case(PnMixConfig(), 128)
    state["value_step"].neg_()
    seq_len = layout.max_seq_len - k_new.shape[2]
    want = reference.attend(q, layout, state, seq_len, k_new, v_new)
    arith.set_arith("int8")
    got = arith.attend(q, layout, state, seq_len, k_new, v_new)
    assert (got - want).abs().max().item() <= INT8_TOLERANCE


def test_int8_value_sums_of_a_huge_group_do_not_overflow(arith):
    """A group of 565K tokens under uniform attention, each token's 4-bit value codes 15 on half
    the channels: a lane's integer sum over the group, 565,248 * 255 * 15, is past 2^31. The VNNI
    kernel summed a whole group before flushing and gave -0.99 where the answer is 1.0; it flushes
    every 4096 tokens now. The fp32 kernel is the yardstick (the reference takes seconds here)."""
    group = 565_248
    config = PnMixConfig(group_size=group, residual_size=group, sink_tokens=0, value_bits=4)
    seq_len = group + 8
    layout = CacheLayout(config, 1, 1, 64, seq_len)
    k = torch.zeros(1, 1, seq_len, 64)
    k[..., 0] = 1.0  # every key alike: every token of the group gets the same weight
    v = torch.zeros(1, 1, seq_len, 64)
    v[..., :32] = 1.0
    state = layout.empty_state()
    arith.append(layout, state, 0, k, v)
    q = torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(3))
    arith.set_arith("fp32")
    exact = arith.attend(q, layout, state, seq_len)
    arith.set_arith("int8")
    assert arith.arith_for(layout) == "int8"
    got = arith.attend(q, layout, state, seq_len)
    assert (exact[..., :32] - 1.0).abs().max().item() <= 1e-3
    assert (got - exact).abs().max().item() <= INT8_TOLERANCE


def test_int8_arithmetic_errors_and_environment(arith):
    with pytest.raises(PnMixError, match="unknown attention arithmetic 'int9'; choose auto, fp32 or int8"):
        arith.set_arith("int9")
    assert arith.arith() == "fp32"  # the default, and unchanged by the refusal
    with pytest.raises(PnMixError, match="unknown multiply-add kind"):
        arith.madd_rate("fp64", 1)
    assert arith.madd_rate("int8", 1, iterations=1000, runs=1) > 0
    import os
    import subprocess
    import sys

    code = "from pnmix.backends.core_ops import CoreOps; o = CoreOps(); print(o.arith()); o.set_arith('fp32'); print(o.arith())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PNMIX_ATTEND_ARITH": "int8"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["int8", "fp32"]  # the environment chooses, the call overrides
    # a typo in the variable is an error on every attention, not a silent fp32
    code = ("import torch; from pnmix.backends.core_ops import CoreOps; from pnmix.config import PnMixConfig; "
            "from pnmix.format import CacheLayout; o = CoreOps(); lay = CacheLayout(PnMixConfig(), 1, 1, 64, 8); "
            "print(o.arith()); o.attend(torch.zeros(1, 1, 1, 64), lay, lay.empty_state(), 0, "
            "torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PNMIX_ATTEND_ARITH": "int-8"},
                         capture_output=True, text=True)
    assert run.returncode != 0 and run.stdout.split() == ["invalid"]
    assert "PNMIX_ATTEND_ARITH is 'int-8'; set it to fp32 or int8 (or unset it)" in run.stderr


POOL_THREADS = """
import os, sys, torch
from pnmix.backends.core_ops import CoreOps
from pnmix.config import PnMixConfig
from pnmix.format import CacheLayout
from pnmix.testing import make_random_kv
cores = sys.argv[1]
if cores != "all":
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
torch.set_num_threads(1)  # torch's own pool out of the count
lay = CacheLayout(PnMixConfig(), 1, 8, 128, 8192)
ops = CoreOps(torch_threads=False)  # the core's own pool; threads=0: every core the thread may use
state = lay.empty_state()
k, v = make_random_kv(1, 8, 8192, 128, seed=1)
q = torch.randn(1, 32, 1, 128)
before = len(os.listdir("/proc/self/task"))
ops.append(lay, state, 0, k, v)
ops.attend(q, lay, state, 8192)  # a cache big enough to wake every thread
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity masks and at least 2 usable cores")
def test_threads_by_default_are_the_cores_the_caller_may_use():
    """A process pinned to one core (vLLM pins its CPU worker so) gets no helper thread: helpers
    inherit the caller's mask, so they would share its core and only contend; unpinned, the same
    work wakes helpers."""
    import subprocess
    import sys

    def helpers(cores: str) -> int:
        run = subprocess.run([sys.executable, "-c", POOL_THREADS, cores], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return int(run.stdout.split()[-1])

    first = sorted(os.sched_getaffinity(0))[0]
    assert helpers(str(first)) == 0
    assert helpers("all") >= 1
