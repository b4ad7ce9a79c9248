"""A PnMixLayer's steady decode steps (pnmix/hf/layer_step.py's SteadyDecode): after one packed
step passed every check, steps like it skip the checks whose answers cannot have changed. They
must give the bits of fully checked steps and refuse what those refuse."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from pnmix._native import library_status  # noqa: E402
from pnmix.errors import PnMixError  # noqa: E402
from pnmix.format import STATE_NAMES  # noqa: E402
from pnmix.hf import PnMixCache  # noqa: E402
from pnmix.hf.cache import PnMixLayer  # noqa: E402
from pnmix import testing  # noqa: E402
from pnmix.testing import make_random_kv  # noqa: E402

KV_HEADS, HEAD_DIM = 2, 32
# Steady steps are the core's: the other backends check a step's K/V values at the update.
available, reason = library_status("pnmix_core")
if not available:
    pytest.skip(f"libpnmix_core not available: {reason}", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    return testing.tiny_llama(0, layers=2)


def never_steady(cache: PnMixCache) -> None:
    """Make every step of the cache's layers a fully checked one."""
    for layer in cache.layers:
        layer._note_steady = lambda *args: None


def test_steady_steps_give_the_bits_of_fully_checked_steps(model, monkeypatch):
    """Greedy decoding past group flushes and a growth of the state: the logits at every step and
    the state bytes at the end are those of a cache whose every step is fully checked, and the
    steady cache skipped the full checks in all but a few steps."""
    full_checks = {}
    real = PnMixLayer._note_steady

    def counted(layer, *args):
        full_checks[id(layer)] = full_checks.get(id(layer), 0) + 1
        return real(layer, *args)

    monkeypatch.setattr(PnMixLayer, "_note_steady", counted)
    ids = torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("pnmix")
    try:
        caches, logits = [], []
        for steady in (True, False):
            cache = PnMixCache()
            with torch.no_grad():
                out = model(input_ids=ids, cache=cache)
                if not steady:
                    never_steady(cache)
                rows = []
                for _ in range(300):  # 400 tokens: flushes every 128, the state grows past 356
                    out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache)
                    rows.append(out.logits)
            caches.append(cache)
            logits.append(torch.cat(rows, dim=1))
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(logits[0], logits[1])
    steady, full = caches
    for a, b in zip(steady.layers, full.layers):
        assert a.packed.seq_len == b.packed.seq_len == 400
        assert all(torch.equal(a.packed.state[name], b.packed.state[name]) for name in STATE_NAMES)
        # fully checked: the first decode step and the one after the growth (a new state)
        assert full_checks[id(a)] == 2, full_checks[id(a)]
        assert id(b) not in full_checks  # (never_steady replaced its bookkeeping)


def kv(n: int, seed: int, dtype=torch.float32):
    return make_random_kv(1, KV_HEADS, n, HEAD_DIM, seed=seed, dtype=dtype)


def packed_layer(dtype=torch.float32, **options):
    """A layer past its prefill and one packed step."""
    cache = PnMixCache(**options)
    cache.update(*kv(160, seed=0, dtype=dtype), 0)
    layer = cache.layers[0]
    layer.packed_attention = True  # what the pnmix attention sets after the prefill
    cache.update(*kv(1, seed=1, dtype=dtype), 0)
    layer.attend_pending(query())
    return cache, layer


def steady_layer(dtype=torch.float32, **options):
    """A layer past its prefill and one fully checked packed step: its next steps are steady."""
    cache, layer = packed_layer(dtype, **options)
    assert layer.steady is not None and layer.steady.query is not None
    return cache, layer


def query(seed: int = 3):
    return torch.randn(1, 2 * KV_HEADS, 1, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_steady_step_refuses_non_finite_kv_and_the_layer_goes_on(dtype):
    cache, layer = steady_layer(dtype, backend="core")
    before = {name: t.clone() for name, t in layer.packed.state.items()}
    bad_k, v1 = kv(1, seed=5, dtype=dtype)
    bad_k[0, 1, 0, 7] = float("inf")
    cache.update(bad_k, v1, 0)
    assert layer.pending.steady  # the values are the C call's to refuse
    with pytest.raises(PnMixError, match="new keys hold non-finite values .* at tokens 161..161"):
        layer.attend_pending(query())
    assert layer.pending is None and cache.get_seq_length() == 161
    assert all(torch.equal(before[name], layer.packed.state[name]) for name in STATE_NAMES)
    cache.update(*kv(1, seed=6, dtype=dtype), 0)
    layer.attend_pending(query())
    assert cache.get_seq_length() == 162


def test_no_steady_steps_where_the_update_checks_the_values():
    """The torch backend (fp16_kv at the update: fp16 K/V pass through it as the same tensor) and a
    padded batch's row (its rows all checked before any appends) never take the steady path."""
    cache, layer = packed_layer(torch.float16, backend="torch")
    assert layer.steady is None
    bad_k, v1 = kv(1, seed=5, dtype=torch.float16)
    bad_k[0, 0, 0, 1] = float("nan")
    with pytest.raises(PnMixError, match="new keys hold non-finite values"):
        cache.update(bad_k, v1, 0)
    assert layer.pending is None and cache.get_seq_length() == 161
    row = PnMixLayer(PnMixCache().config, 0)
    row.check_at_update = True
    row.update(*kv(160, seed=0, dtype=torch.float16))
    row.packed_attention = True
    row.update(*kv(1, seed=1, dtype=torch.float16))
    row.attend_pending(query())
    assert row.steady is None


def test_a_step_unlike_the_steady_one_gets_every_check():
    cache, layer = steady_layer(backend="core")
    with pytest.raises(PnMixError, match="new keys must have shape"):
        cache.update(*make_random_kv(1, KV_HEADS + 1, 1, HEAD_DIM, seed=7, dtype=torch.float32), 0)
    with pytest.raises(PnMixError, match="differ in shape"):
        cache.update(kv(1, seed=8)[0], kv(2, seed=8)[1], 0)
    cache.update(*kv(1, seed=9), 0)
    with pytest.raises(PnMixError, match="was not attended by the pnmix attention"):
        cache.update(*kv(1, seed=10), 0)  # a step still pending: not steady
    layer.attend_pending(query())
    assert cache.get_seq_length() == 162


def test_a_steady_step_checks_the_positions():
    cache, layer = steady_layer(backend="core")
    with pytest.raises(PnMixError, match="position ids start at 150 but the cache holds 161 tokens"):
        cache.update(*kv(1, seed=4), 0, kwargs={"position_ids": torch.tensor([[150]])})
    assert layer.pending is None and cache.get_seq_length() == 161


def test_steady_steps_stop_at_max_cache_len():
    cache, layer = steady_layer(backend="core", max_cache_len=163)
    for seed in (11, 12):
        cache.update(*kv(1, seed=seed), 0)
        layer.attend_pending(query())
    with pytest.raises(PnMixError, match="max_cache_len 163"):
        cache.update(*kv(1, seed=13), 0)
    assert cache.get_seq_length() == 163


def test_a_different_query_shape_goes_through_the_backends_checks():
    cache, layer = steady_layer(backend="core")
    cache.update(*kv(1, seed=14), 0)
    with pytest.raises(PnMixError, match="queries must have shape"):
        layer.attend_pending(torch.randn(1, 2 * KV_HEADS + 1, 1, HEAD_DIM))
    assert layer.pending is None and cache.get_seq_length() == 161


def test_an_empty_step_after_steady_ones_attends_alone():
    """An update of no tokens is never steady: it attends without appending, as before."""
    cache, layer = steady_layer(backend="core")
    for _ in range(2):
        cache.update(*kv(0, seed=15), 0)
        assert not layer.pending.steady
        out = layer.attend_pending(query())
        assert out.shape == (1, 2 * KV_HEADS, 1, HEAD_DIM) and cache.get_seq_length() == 161
    cache.update(*kv(1, seed=16), 0)
    layer.attend_pending(query())
    assert cache.get_seq_length() == 162
