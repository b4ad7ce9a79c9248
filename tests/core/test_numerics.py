"""Numerics at the edges (docs/HARDENING.md): zero-variance groups, fp16's largest and
subnormal magnitudes, non-finite K/V, empty prefill, over-capacity prefill and sequences that end
exactly on a flush boundary."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pnmix import quant, reference
from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.dump import DUMP_HEADER_BYTES, dump_state, load_state
from pnmix.format import CacheLayout
from pnmix.testing import make_random_kv

FP16_MAX = 65504.0
SUBNORMAL = 2.0**-24  # fp16's smallest positive value
SMALL = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4)
CASES = {"finite fp16 groups": 0}


def fp16_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16)


# Any finite fp16 bit pattern: zeros, -0, subnormals, the largest values, everything between.
finite_fp16_bits = st.integers(0, 0xFFFF).filter(lambda b: (b & 0x7C00) != 0x7C00)
# Groups drawn from the extremes, so min/max/mean land on the edges of fp16's range.
edge_values = st.sampled_from([0.0, -0.0, SUBNORMAL, -SUBNORMAL, 3 * SUBNORMAL, 2.0**-14,
                               1.0, -1.0, 60000.0, FP16_MAX, -FP16_MAX])


@st.composite
def fp16_groups(draw) -> torch.Tensor:
    n = draw(st.sampled_from([2, 8, 16]))
    if draw(st.booleans()):
        return fp16_from_bits(draw(st.lists(finite_fp16_bits, min_size=n, max_size=n)))
    return torch.tensor(draw(st.lists(edge_values, min_size=n, max_size=n))).half()


# ---------------------------------------------------------------------------------------
# The quantizer: finite in, finite out (fp16 saturation), codes in range, error bounded
# ---------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(fp16_groups(), st.integers(1, 8))
def test_finite_groups_give_finite_step_offset_and_values(x, bits):
    CASES["finite fp16 groups"] += 1
    x = x.unsqueeze(0)
    step, offset = quant.choose_qparams(x, bits)
    assert torch.isfinite(step).all() and torch.isfinite(offset).all()
    assert (step >= 0).all()
    codes = quant.quantize(x, step, offset, bits)
    assert int(codes.max()) <= 2**bits - 1
    xhat = quant.dequantize(codes, step, offset)
    assert torch.isfinite(xhat).all()
    if bits >= 2:
        # Half a step from rounding, plus what rounding the step to fp16 moves the top code by,
        # plus fp32 rounding of offset + step * q.
        x32 = x.float()
        exact = (x32.amax(-1) - x32.amin(-1)) / (2**bits - 1)
        slack = (2**bits - 1) * (step.float() - exact).abs()
        bound = step.float() / 2 + slack + 1e-6 * x32.abs().amax(-1) + SUBNORMAL
        assert ((xhat - x32).abs() <= bound.unsqueeze(-1)).all()


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
@pytest.mark.parametrize("value", [0.0, -0.0, SUBNORMAL, -FP16_MAX, FP16_MAX, 1234.5])
def test_zero_variance_groups_reconstruct_exactly(bits, value):
    x = torch.full((3, 16), value).half()
    step, offset = quant.choose_qparams(x, bits)
    assert (step == 0).all()
    codes = quant.quantize(x, step, offset, bits)
    assert (codes == 0).all()
    assert torch.equal(quant.dequantize(codes, step, offset), x.float())


def test_one_bit_spread_beyond_fp16_saturates_step_and_offset():
    # mu 0, a 65504: 2a = 131008 and mu - a = -65504 would overflow without saturation.
    x = torch.tensor([[-FP16_MAX, FP16_MAX] * 4]).half()
    step, offset = quant.choose_qparams(x, 1)
    assert step.item() == FP16_MAX and offset.item() == -FP16_MAX
    xhat = quant.dequantize(quant.quantize(x, step, offset, 1), step, offset)
    assert torch.isfinite(xhat).all()


def test_subnormal_spread_rounding_to_zero_step_keeps_the_minimum():
    # (2^-24 - 0) / 3 is below half of fp16's smallest subnormal: step rounds to 0, all codes 0.
    x = torch.tensor([[0.0, SUBNORMAL] * 4]).half()
    step, offset = quant.choose_qparams(x, 2)
    assert step.item() == 0.0 and offset.item() == 0.0
    assert torch.equal(quant.dequantize(quant.quantize(x, step, offset, 2), step, offset),
                       torch.zeros(1, 8))


# ---------------------------------------------------------------------------------------
# The cache with extreme but finite K/V
# ---------------------------------------------------------------------------------------


def filled_cache(k, v, config=SMALL, chunks=None):
    cache = PackedKVCache(config, k.shape[1], k.shape[3], max(k.shape[2], 1), batch=k.shape[0])
    start = 0
    for n in chunks or [k.shape[2]]:
        cache.append(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    return cache


@pytest.mark.parametrize("scale", [FP16_MAX, 1.0, 2.0**-14, SUBNORMAL])
def test_extreme_magnitudes_give_finite_cache_and_attention(scale):
    g = torch.Generator().manual_seed(7)
    signs = torch.randint(0, 2, (2, 2, 60, 8), generator=g) * 2 - 1
    mags = torch.rand(2, 2, 60, 8, generator=g)
    k = (signs * mags * scale).clamp(-FP16_MAX, FP16_MAX).half()
    v = (signs.flip(2) * scale).clamp(-FP16_MAX, FP16_MAX).half()
    cache = filled_cache(k, v, chunks=[30] + [1] * 30)
    assert cache.lengths().groups >= 3
    for name in ("key_step", "key_offset", "value_step", "value_offset"):
        assert torch.isfinite(cache.state[name]).all(), name
    keys, values = cache.dequantized()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    q = (torch.randn(2, 4, 5, 8, generator=g) * min(scale, 1000.0)).half()
    out = cache.attend(q)
    assert torch.isfinite(out).all()
    # Values are +-scale per token: a 2-bit block spans [-scale, scale]; only the fp16 rounding
    # of the step (3 * step != 2 * scale) moves the top code.
    assert (values - v.float()).abs().max() <= 1e-3 * scale + SUBNORMAL


def test_dequantized_values_can_leave_fp16_range_so_they_stay_fp32():
    # step = fp16(131008 / 3) = 43680, and -65504 + 3 * 43680 = 65536 > 65504: finite in fp32,
    # Inf if a backend cast dequantized K/V to fp16 (docs/HARDENING.md).
    x = torch.tensor([[-FP16_MAX, FP16_MAX, 0.0, 1.0]]).half()
    step, offset = quant.choose_qparams(x, 2)
    xhat = quant.dequantize(quant.quantize(x, step, offset, 2), step, offset)
    assert step.item() == 43680.0 and xhat[0, 1].item() == 65536.0
    assert torch.isinf(xhat.half()).any() and torch.isfinite(xhat).all()


def test_zero_variance_keys_and_values_reconstruct_exactly_through_the_cache():
    # Keys constant along tokens (one value per channel), values constant along channels.
    channel = torch.linspace(-3, 3, 8)
    k = channel.expand(1, 2, 50, 8).half().contiguous()
    v = torch.arange(50.0).reshape(1, 1, 50, 1).expand(1, 2, 50, 8).half().contiguous()
    cache = filled_cache(k, v)
    assert cache.lengths() == (4, 4, 14)
    assert (cache.state["key_step"][:, :, :4] == 0).all()
    keys, values = cache.dequantized()
    assert torch.equal(keys, k.float()) and torch.equal(values, v.float())


# ---------------------------------------------------------------------------------------
# Non-finite K/V: rejected at PackedKVCache.append before the state changes
# ---------------------------------------------------------------------------------------


def _poisoned(kind: str, n: int = 6):
    k, v = make_random_kv(1, 2, n, 8)
    if kind == "nan key":
        k[0, 1, n - 1, 3] = float("nan")
    elif kind == "inf value":
        v[0, 0, 0, 0] = float("inf")
    elif kind == "-inf key":
        k[0, 0, n // 2, 7] = float("-inf")
    else:  # fp32 input beyond fp16's range becomes Inf on the cast
        k = k.float()
        k[0, 0, 0, 0] = 1e6
    return k, v


@pytest.mark.parametrize("kind", ["nan key", "inf value", "-inf key", "fp32 beyond fp16"])
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_non_finite_kv_is_rejected_and_the_cache_is_untouched(kind, when):
    cache = PackedKVCache(SMALL, 2, 8, 64)
    if when == "decode":
        k, v = make_random_kv(1, 2, 30, 8)
        cache.append(k, v)
    before = {name: t.clone() for name, t in cache.state.items()}
    seq_len, computations = cache.seq_len, cache.saliency_computations
    k, v = _poisoned(kind, 1 if when == "decode" else 6)
    with pytest.raises(PnMixError, match="non-finite") as info:
        cache.append(k, v)
    assert "\n" not in str(info.value)
    assert cache.seq_len == seq_len and cache.saliency_computations == computations
    assert all(torch.equal(before[name], t) for name, t in cache.state.items())


@pytest.mark.parametrize("where, name", [("keys", "keys"), ("values", "values"), ("both", "keys")])
def test_non_finite_kv_names_the_tensor_even_when_the_infinities_cancel(where, name):
    """The check sums each tensor once: +Inf in the keys and -Inf in the values, or both in one
    tensor, still make a non-finite total, and the error names the tensor that holds them."""
    cache = PackedKVCache(SMALL, 2, 8, 64)
    k, v = make_random_kv(1, 2, 3, 8, dtype=torch.float32)
    if where in ("keys", "both"):
        k[0, 0, 1, 2], k[0, 1, 2, 3] = float("inf"), float("-inf")  # cancel within the keys
    if where in ("values", "both"):
        v[0, 1, 0, 0] = float("-inf")
    with pytest.raises(PnMixError, match=f"new {name} hold non-finite values"):
        cache.append(k, v)
    assert cache.seq_len == 0


# ---------------------------------------------------------------------------------------
# Lengths at the edges
# ---------------------------------------------------------------------------------------


def test_empty_prefill_is_a_no_op_and_the_first_tokens_set_the_mask():
    cache = PackedKVCache(SMALL, 2, 8, 40)
    cache.append(torch.zeros(1, 2, 0, 8).half(), torch.zeros(1, 2, 0, 8).half())
    assert cache.seq_len == 0 and cache.saliency_computations == 0
    assert cache.persistent_bytes()["persistent_cache_bytes"] == 0
    assert all((t == 0).all() for t in cache.state.values())
    blob = dump_state(cache.layout, cache.state, 0)
    assert len(blob) == DUMP_HEADER_BYTES and load_state(blob)[2] == 0
    with pytest.raises(PnMixError, match="queries"):
        cache.attend(torch.randn(1, 4, 1, 8).half())  # no key to attend to
    k = torch.zeros(1, 2, 10, 8)
    k[..., 2:4] = 5.0  # pair 1 carries all the energy
    cache.append(k.half(), k.half())
    assert cache.saliency_computations == 1
    assert cache.pair_mask()[0, :, 1].all()


def test_prefill_longer_than_capacity_is_refused_before_anything_changes():
    cache = PackedKVCache(SMALL, 2, 8, 20)
    with pytest.raises(PnMixError, match="capacity exceeded: 0 \\+ 21 tokens > max_seq_len 20"):
        cache.append(*make_random_kv(1, 2, 21, 8))
    assert cache.seq_len == 0 and cache.saliency_computations == 0
    assert all((t == 0).all() for t in cache.state.values())
    with pytest.raises(PnMixError, match="max_seq_len"):
        PackedKVCache(SMALL, 2, 8, 0)


def _boundaries(config: PnMixConfig):
    """Lengths just before, at and just after the first two flushes."""
    first = config.sink_tokens + config.residual_size
    second = first + config.group_size
    return [first - 1, first, first + 1, second - 1, second]


@pytest.mark.parametrize("config", [
    SMALL, PnMixConfig(group_size=8, residual_size=8, sink_tokens=0),
    PnMixConfig(group_size=16, residual_size=24, sink_tokens=3, value_bits=1, key_low_bits=2),
], ids=["R=2gs", "R=gs-no-sink", "R=1.5gs"])
def test_sequences_ending_on_a_flush_boundary(config):
    k, v = make_random_kv(1, 2, _boundaries(config)[-1], 8, seed=1)
    for n in _boundaries(config):
        prefill = min(n, config.sink_tokens + 2)
        one_shot = filled_cache(k[:, :, :n], v[:, :, :n], config)
        stepped = filled_cache(k[:, :, :n], v[:, :, :n], config, [prefill] + [1] * (n - prefill))
        lengths = one_shot.lengths()
        assert lengths == stepped.lengths()
        rest = n - lengths.sink
        expected_groups = 0 if rest < config.residual_size else (rest - config.residual_size) // config.group_size + 1
        assert lengths.groups == expected_groups and lengths.residual < config.residual_size
        # The residual holds exactly the newest tokens, in order.
        tail = slice(n - lengths.residual, n)
        assert torch.equal(stepped.state["residual_k"][:, :, : lengths.residual], k[:, :, tail])
        blob = dump_state(stepped.layout, stepped.state, n)
        layout, state, seq_len = load_state(blob)
        assert seq_len == n and dump_state(layout, state, seq_len) == blob
        keys, _ = reference.dequantize_cache(layout, state, seq_len)
        assert torch.equal(keys, stepped.dequantized()[0])


def test_queries_beyond_the_keys_and_misshapen_queries_are_refused():
    cache = filled_cache(*make_random_kv(1, 2, 5, 8))
    with pytest.raises(PnMixError, match="6 queries but only 5 keys"):
        cache.attend(torch.randn(1, 4, 6, 8).half())
    with pytest.raises(PnMixError, match="q_heads"):
        cache.attend(torch.randn(1, 3, 1, 8).half())
    with pytest.raises(PnMixError, match="both new keys and new values"):
        cache.attend(torch.randn(1, 4, 1, 8).half(), torch.randn(1, 2, 1, 8).half(), None)
    assert cache.attend(torch.randn(1, 4, 5, 8).half()).shape == (1, 4, 5, 8)


def test_layout_rejects_non_positive_sizes():
    for bad in (dict(batch=0), dict(kv_heads=-1), dict(max_seq_len=True), dict(head_dim=7)):
        args = dict(config=SMALL, batch=1, kv_heads=1, head_dim=8, max_seq_len=8) | bad
        with pytest.raises(PnMixError):
            CacheLayout(**args)
