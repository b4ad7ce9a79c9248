import pytest
import torch

from pnmix import reference
from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.dump import dump_state
from pnmix.testing import schedule_list_model


def check_cache_against_model(config, chunks, random_kv, batch=1):
    total = sum(chunks)
    k, v = random_kv(batch, 2, total, 32, seed=len(chunks))
    cache = PackedKVCache(config, 2, 32, max(total, 1), batch=batch)
    start = 0
    for n in chunks:
        cache.append(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    sink, groups, residual = schedule_list_model(config, chunks)
    assert tuple(cache.lengths()) == (len(sink), len(groups), len(residual))
    state = cache.state
    assert torch.equal(state["sink_k"][:, :, : len(sink)], k[:, :, sink])
    assert torch.equal(state["residual_v"][:, :, : len(residual)], v[:, :, residual])
    # Each group holds exactly the model's tokens: re-quantizing them gives the stored bytes.
    bits = reference.state_channel_bits(cache.layout, state)
    for g, members in enumerate(groups):
        packed, step, offset = reference.quantize_key_groups(
            k[:, :, members].reshape(-1, config.group_size, 32), bits.reshape(-1, 32), cache.layout)
        assert torch.equal(state["key_codes"][:, :, g].reshape(packed.shape), packed)
        assert torch.equal(state["key_step"][:, :, g].reshape(step.shape), step)
        packed_v, _, _ = reference.quantize_values(v[:, :, members], cache.layout)
        assert torch.equal(state["value_codes"][:, :, g], packed_v)
    return cache


@pytest.mark.parametrize("chunks", [
    [10],                 # prefill shorter than the sink
    [300],                # prefill not a multiple of the group
    [384] + [1] * 64,     # the protocol
    [40] + [1] * 300,     # decode crossing several flushes
    [128, 127, 1, 256],   # chunks ending exactly on flush boundaries
])
def test_append_flush_schedule_matches_spec(chunks, random_kv):
    check_cache_against_model(PnMixConfig(), chunks, random_kv)


def test_schedule_without_sink_and_with_large_residual(random_kv):
    config = PnMixConfig(sink_tokens=0, group_size=32, residual_size=80)
    check_cache_against_model(config, [50, 1, 1, 70, 3] + [1] * 40, random_kv)


def test_decode_steps_give_the_same_bytes_as_one_chunk(random_kv):
    k, v = random_kv(1, 2, 500, 32)
    steps = PackedKVCache(PnMixConfig(), 2, 32, 500)
    chunk = PackedKVCache(PnMixConfig(), 2, 32, 500)
    for cache in (steps, chunk):
        cache.append(k[:, :, :384], v[:, :, :384])  # the same prefill, so the same mask
    for t in range(384, 500):
        steps.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    chunk.append(k[:, :, 384:], v[:, :, 384:])
    # Rows past the used part are scratch; the persistent bytes (the dump) must agree.
    assert dump_state(steps.layout, steps.state, 500) == dump_state(chunk.layout, chunk.state, 500)


def test_saliency_is_computed_once_from_the_prefill(random_kv):
    k, v = random_kv(1, 2, 448, 32)
    cache = PackedKVCache(PnMixConfig(), 2, 32, 448)
    cache.append(k[:, :, :384], v[:, :, :384])
    mask = cache.pair_mask().clone()
    for t in range(384, 448):
        cache.append(k[:, :, t:t + 1] * 50, v[:, :, t:t + 1])  # loud decode keys must not move it
    assert cache.saliency_computations == 1
    assert torch.equal(cache.pair_mask(), mask)
    assert torch.equal(mask, reference.saliency_mask(k[:, :, :384], cache.layout))


def test_saliency_picks_largest_energy_pairs_ties_to_lower_index():
    config = PnMixConfig(high_ratio=0.5)
    cache = PackedKVCache(config, 1, 8, 16)
    k = torch.zeros(1, 1, 2, 8)
    k[..., 6] = 3.0  # adjacent pair 3 is the loudest; the other pairs tie at zero energy
    cache.append(k.half(), k.half())
    assert cache.pair_mask()[0, 0].tolist() == [True, False, False, True]


def test_capacity_is_an_error_and_leaves_the_cache_untouched(random_kv):
    k, v = random_kv(1, 2, 20, 32)
    cache = PackedKVCache(PnMixConfig(), 2, 32, 16)
    cache.append(k[:, :, :10], v[:, :, :10])
    before = {name: t.clone() for name, t in cache.state.items()}
    with pytest.raises(PnMixError, match="capacity exceeded"):
        cache.append(k[:, :, 10:], v[:, :, 10:])
    assert cache.seq_len == 10
    assert all(torch.equal(before[n], cache.state[n]) for n in before)


def _steps_both_ways(random_kv, prefill, steps):
    """Two caches given the same prefill and decode steps: one attends and then appends each
    step, the other takes each in one attend_append_prechecked call; their outputs, per step."""
    k, v = random_kv(1, 2, prefill + steps, 32, seed=4)
    q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(9)).half()
    apart, together = (PackedKVCache(PnMixConfig(), 2, 32, prefill + steps) for _ in range(2))
    outs = []
    for t in range(prefill + steps):
        new_k, new_v = k[:, :, t:t + 1].contiguous(), v[:, :, t:t + 1].contiguous()
        if t < prefill:
            apart.append(new_k, new_v)
            together.append(new_k, new_v)
            continue
        expected = apart.attend(q, new_k, new_v)
        apart.append(new_k, new_v)
        outs.append((expected, together.attend_append_prechecked(q, new_k, new_v)))
    return apart, together, outs


def test_a_decode_step_in_one_call_equals_attend_then_append(random_kv):
    # 200 steps from 300 tokens cross flushes; the default (torch) ops compose the two calls
    apart, together, outs = _steps_both_ways(random_kv, 300, 200)
    assert all(torch.equal(want, got) for want, got in outs)
    assert (together.seq_len, together.saliency_computations) == (apart.seq_len, apart.saliency_computations) == (500, 1)
    assert dump_state(apart.layout, apart.state, 500) == dump_state(together.layout, together.state, 500)


def test_a_decode_step_past_capacity_is_refused_and_changes_nothing(random_kv):
    k, v = random_kv(1, 2, 17, 32)
    cache = PackedKVCache(PnMixConfig(), 2, 32, 16)
    cache.append(k[:, :, :16], v[:, :, :16])
    before = {name: t.clone() for name, t in cache.state.items()}
    q = torch.randn(1, 2, 1, 32).half()
    for step in (lambda: cache.attend_append_prechecked(q, k[:, :, 16:], v[:, :, 16:]),
                 lambda: cache.append_fp16(k[:, :, 16:], v[:, :, 16:])):
        with pytest.raises(PnMixError, match="capacity exceeded"):
            step()
    assert cache.seq_len == 16
    assert all(torch.equal(before[n], cache.state[n]) for n in before)


def test_kv_that_carry_autograd_are_stored_alike_without_a_warning(random_kv, recwarn):
    k, v = random_kv(1, 2, 200, 32, dtype=torch.float32)
    plain, tracked = (PackedKVCache(PnMixConfig(), 2, 32, 200) for _ in range(2))
    plain.append(k, v)
    tracked.append(k.clone().requires_grad_(), v.clone().requires_grad_())
    assert not recwarn.list
    assert dump_state(plain.layout, plain.state, 200) == dump_state(tracked.layout, tracked.state, 200)


def test_wrong_shapes_are_rejected(random_kv):
    cache = PackedKVCache(PnMixConfig(), 2, 32, 16)
    k, v = random_kv(1, 3, 4, 32)
    with pytest.raises(PnMixError, match="kv_heads=2"):
        cache.append(k, v)


def test_batch_sequences_are_independent(random_kv):
    k, v = random_kv(2, 2, 400, 32)
    both = PackedKVCache(PnMixConfig(), 2, 32, 400, batch=2)
    both.append(k, v)
    for b in range(2):
        single = PackedKVCache(PnMixConfig(), 2, 32, 400)
        single.append(k[b:b + 1], v[b:b + 1])
        for name, tensor in single.state.items():
            assert torch.equal(both.state[name][b:b + 1], tensor), name


def test_state_export_import_round_trip(other_config, random_kv):
    k, v = random_kv(1, 2, 200, 32)
    cache = PackedKVCache(other_config, 2, 32, 256)
    cache.append(k, v)
    tensors = cache.export_state()
    assert tensors["key_codes"].dtype == torch.int8  # as the ONNX graph and plugins take them
    copy = PackedKVCache(other_config, 2, 32, 256)
    copy.import_state(tensors, cache.seq_len)
    assert all(torch.equal(copy.state[n], cache.state[n]) for n in cache.state)
    with pytest.raises(PnMixError, match="shape"):
        PackedKVCache(other_config, 2, 32, 512).import_state(tensors, 200)


@pytest.mark.parametrize("n", [5, 32, 100, 448])
def test_attention_over_cache_plus_new_tokens_matches_dense_on_dequantized_keys(n, random_kv):
    k, v = random_kv(1, 2, n + 3, 32, seed=n)
    q = torch.randn(1, 4, 3, 32).half()
    cache = PackedKVCache(PnMixConfig(), 2, 32, n + 3)
    cache.append(k[:, :, :n], v[:, :, :n])
    out = cache.attend(q, k[:, :, n:], v[:, :, n:])
    k_hat, v_hat = cache.dequantized()
    dense = reference.attention_dense(q, torch.cat([k_hat, k[:, :, n:].float()], 2),
                                      torch.cat([v_hat, v[:, :, n:].float()], 2))
    assert torch.allclose(out, dense)
    # the last query sees everything; the first does not see the two after it
    probe = reference.attention_dense(q[:, :, :1], torch.cat([k_hat, k[:, :, n:n + 1].float()], 2),
                                      torch.cat([v_hat, v[:, :, n:n + 1].float()], 2))
    assert torch.allclose(out[:, :, :1], probe, atol=1e-6)


def test_prefill_attention_is_full_precision(random_kv):
    k, v = random_kv(1, 2, 50, 32)
    q = torch.randn(1, 4, 50, 32).half()
    cache = PackedKVCache(PnMixConfig(), 2, 32, 64)
    out = cache.attend(q, k, v)
    assert torch.allclose(out, reference.attention_dense(q, k, v))
