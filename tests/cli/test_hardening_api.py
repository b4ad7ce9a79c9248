"""The Python API's no-state-change promise (docs/HARDENING.md section 3): every refused call is one
PnMixError line and leaves the cache exactly as it was (state bytes, seq_len, capacity, layers).

PackedKVCache.append refuses what is not real floating point; import_state checks what load_state
checks for a dump; PnMixCache.update validates before it grows, and takes layers in order.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.dump import dump_state
from pnmix.format import STATE_NAMES
from pnmix.testing import make_random_kv

CONFIG = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4)
HEADS, DIM, CAPACITY = 2, 8, 64


def filled(n: int = 40) -> PackedKVCache:
    cache = PackedKVCache(CONFIG, HEADS, DIM, CAPACITY)
    cache.append(*make_random_kv(1, HEADS, n, DIM, seed=n))
    return cache


def snapshot(cache: PackedKVCache):
    return (cache.seq_len, cache.saliency_computations,
            {name: t.clone() for name, t in cache.state.items()})


def assert_unchanged(cache: PackedKVCache, before) -> None:
    seq_len, saliency, state = before
    assert (cache.seq_len, cache.saliency_computations) == (seq_len, saliency)
    for name in STATE_NAMES:
        assert torch.equal(cache.state[name], state[name]), name


def refused(call, *words):
    with pytest.raises(PnMixError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message
    for word in words:
        assert word in message, message
    return message


# ---------------------------------------------------------------------------------------
# PackedKVCache.append: real floating point only
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int8,
                                   torch.uint8, torch.bool])
@pytest.mark.parametrize("empty", [True, False])
def test_append_refuses_tensors_that_are_not_real_floating_point(dtype, empty):
    cache = PackedKVCache(CONFIG, HEADS, DIM, CAPACITY) if empty else filled()
    before = snapshot(cache)
    k = torch.ones(1, HEADS, 3, DIM).to(dtype)
    refused(lambda: cache.append(k, torch.ones(1, HEADS, 3, DIM).half()), "keys", str(dtype).replace("torch.", ""))
    refused(lambda: cache.append(torch.ones(1, HEADS, 3, DIM).half(), k), "values")
    assert_unchanged(cache, before)


def test_append_takes_every_real_floating_point_dtype_as_fp16():
    reference = filled()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        cache = PackedKVCache(CONFIG, HEADS, DIM, CAPACITY)
        k, v = make_random_kv(1, HEADS, 40, DIM, seed=40)
        if dtype == torch.bfloat16:  # bf16 cannot hold every fp16 value: compare with its own fp16 rounding
            k, v = k.to(dtype).half(), v.to(dtype).half()
            reference = PackedKVCache(CONFIG, HEADS, DIM, CAPACITY)
            reference.append(k, v)
        cache.append(k.to(dtype), v.to(dtype))
        assert dump_state(cache.layout, cache.state, 40) == dump_state(reference.layout, reference.state, 40)


def test_append_refuses_what_is_not_a_tensor():
    cache = filled()
    before = snapshot(cache)
    refused(lambda: cache.append([[1.0]], torch.ones(1, HEADS, 1, DIM)), "4-D tensor")
    refused(lambda: cache.append(torch.ones(HEADS, 1, DIM), torch.ones(HEADS, 1, DIM)), "4-D tensor")
    assert_unchanged(cache, before)


# ---------------------------------------------------------------------------------------
# PackedKVCache.import_state: what load_state checks, checked before anything changes
# ---------------------------------------------------------------------------------------


def _exported(cache: PackedKVCache):
    return {name: t.clone() for name, t in cache.export_state().items()}


def _bad_states(source: PackedKVCache):
    """(name, tensors, seq_len, words) of states import_state must refuse."""
    good = _exported(source)
    n = source.seq_len
    cases = []
    for seq_len, word in ((1.5, "integer"), (True, "integer"), ("3", "integer"), (-1, "outside"),
                          (CAPACITY + 1, "outside"), (40.0, "integer")):
        cases.append((f"seq_len {seq_len!r}", good, seq_len, [word]))

    def changed(name, tensor):
        return {**good, name: tensor}

    cases += [
        ("bf16 sink_k", changed("sink_k", good["sink_k"].view(torch.bfloat16)), n, ["sink_k", "bfloat16"]),
        ("int16 residual_k", changed("residual_k", good["residual_k"].view(torch.int16)), n, ["residual_k", "int16"]),
        ("fp32 key_step", changed("key_step", good["key_step"].float()), n, ["key_step", "float32"]),
        ("fp16 codes", changed("key_codes", torch.zeros_like(good["key_codes"], dtype=torch.float16)[..., : good["key_codes"].shape[-1]]), n, ["key_codes"]),
        ("wrong shape", changed("sink_v", good["sink_v"][:, :1]), n, ["sink_v", "shape"]),
        ("missing", {k: v for k, v in good.items() if k != "pair_mask"}, n, ["pair_mask"]),
        ("a list", changed("value_step", good["value_step"].tolist()), n, ["value_step", "torch tensor"]),
    ]
    for name, index in (("sink_k", (0, 0, 0, 0)), ("residual_v", (0, 1, 2, 3)), ("key_step", (0, 0, 0, 0)),
                        ("value_offset", (0, 0, 0, 0, 0))):
        for bad in (float("nan"), float("inf")):
            tensor = good[name].clone()
            tensor[index] = bad
            cases.append((f"{bad} in {name}", changed(name, tensor), n, [name, "NaN or Inf"]))
    all_high = good["pair_mask"].clone()
    all_high[:] = -1  # int8 0xFF: every pair high, and bits past the last pair
    cases.append(("impossible pair mask", changed("pair_mask", all_high), n, ["pair_mask"]))
    one_pair = torch.zeros_like(good["pair_mask"])
    one_pair[0, 0] = 1  # one high pair where the config gives two per head
    cases.append(("too few high pairs", changed("pair_mask", one_pair), n, ["pair_mask", "high pairs"]))
    return cases


def test_import_state_refuses_what_load_state_refuses_and_changes_nothing():
    source = filled(40)
    target = filled(20)
    for name, tensors, seq_len, words in _bad_states(source):
        before = snapshot(target)
        try:
            refused(lambda tensors=tensors, seq_len=seq_len: target.import_state(tensors, seq_len), *words)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
        assert_unchanged(target, before)


def test_import_state_takes_what_export_state_gives():
    source = filled(40)
    for tensors in (source.export_state(), dict(source.state)):  # int8 or uint8 codes and mask
        target = PackedKVCache(CONFIG, HEADS, DIM, CAPACITY)
        target.import_state(tensors, torch.tensor(40))  # an integer tensor is an integer
        assert target.seq_len == 40
        assert dump_state(target.layout, target.state, 40) == dump_state(source.layout, source.state, 40)


def test_unused_parts_of_an_imported_state_are_not_checked():
    """Only the used part is defined (docs/FORMAT.md section 3): a NaN in an unused group slot is fine."""
    source = filled(20)  # 20 tokens: one group used of the slots a 64-token capacity holds
    tensors = _exported(source)
    tensors["key_step"][0, 0, -1, 0] = float("nan")
    target = PackedKVCache(CONFIG, HEADS, DIM, CAPACITY)
    target.import_state(tensors, 20)
    assert target.seq_len == 20


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(STATE_NAMES), seq_len=st.one_of(st.integers(-2, CAPACITY + 2), st.floats(0, 64),
                                                            st.booleans()),
       dtype=st.sampled_from([None, torch.float16, torch.bfloat16, torch.int16, torch.uint8, torch.int8,
                              torch.float32]),
       at=st.integers(0, 10**6), value=st.sampled_from([0.0, 1.0, -65504.0, float("nan"), float("inf"), 255.0]))
def test_any_changed_state_imports_whole_or_changes_nothing(name, seq_len, dtype, at, value):
    source = filled(40)
    tensors = _exported(source)
    tensor = tensors[name]
    if dtype is not None and dtype.itemsize == tensor.element_size():
        tensor = tensor.view(dtype)
    elif dtype is not None:
        tensor = tensor.to(dtype)
    flat = tensor.reshape(-1)
    if flat.numel():
        flat[at % flat.numel()] = value if tensor.dtype.is_floating_point else (
            int(value) % 128 if math.isfinite(value) else 127)
    tensors[name] = tensor
    target = filled(20)
    before = snapshot(target)
    try:
        target.import_state(tensors, seq_len)
    except PnMixError as exc:
        assert "\n" not in str(exc)
        assert_unchanged(target, before)
        return
    assert target.seq_len == seq_len and not isinstance(seq_len, (bool, float))
    used = target.layout.used_slices(target.seq_len)
    for part in STATE_NAMES:
        if target.state[part].dtype == torch.float16:
            assert torch.isfinite(target.state[part][used[part]]).all(), part


# ---------------------------------------------------------------------------------------
# PnMixCache.update (transformers' Cache interface)
# ---------------------------------------------------------------------------------------


@pytest.fixture
def hf_cache():
    pytest.importorskip("transformers")
    from pnmix.hf.cache import PnMixCache

    return PnMixCache(CONFIG.replace(pair_layout="half"), backend="torch")


def kv(n: int, value: float | None = None, seed: int = 0):
    k, v = make_random_kv(1, HEADS, n, DIM, seed=seed, dtype=torch.float32)
    if value is not None:
        k[0, 0, n - 1, 0] = value
    return k, v


def layer_snapshot(cache):
    return [(layer.packed.layout.max_seq_len, layer.packed.seq_len, layer.allocated_bytes(),
             dump_state(layer.packed.layout, layer.packed.state, layer.packed.seq_len)) for layer in cache.layers]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e6])
def test_a_refused_update_does_not_grow_the_layer(hf_cache, value):
    hf_cache.update(*kv(20), 0)
    capacity = hf_cache.layers[0].packed.layout.max_seq_len
    before = layer_snapshot(hf_cache)
    # More tokens than the capacity holds: a growth would come first, if the update did not check first.
    refused(lambda: hf_cache.update(*kv(capacity, value, seed=1), 0), "non-finite")
    assert layer_snapshot(hf_cache) == before
    hf_cache.update(*kv(capacity, seed=1), 0)  # the same update with finite values grows and goes in
    assert hf_cache.layers[0].packed.seq_len == 20 + capacity


def test_a_refused_first_update_makes_no_layer(hf_cache):
    refused(lambda: hf_cache.update(*kv(8, float("nan")), 0), "non-finite")
    refused(lambda: hf_cache.update(torch.ones(1, HEADS, 8, DIM, dtype=torch.int64),
                                    torch.ones(1, HEADS, 8, DIM), 0), "int64")
    refused(lambda: hf_cache.update(*(t.to(torch.complex64) for t in kv(8)), 0), "complex64")
    assert hf_cache.layers == [] and hf_cache.get_seq_length() == 0
    hf_cache.update(*kv(8), 0)
    assert len(hf_cache.layers) == 1 and hf_cache.get_seq_length() == 8


@pytest.mark.parametrize("layer_idx", [-1, -2, 2, 10**6, 2**63, True, 1.0, "1", None])
def test_layer_indices_outside_the_layers_made_are_refused(hf_cache, layer_idx):
    hf_cache.update(*kv(8), 0)
    before = layer_snapshot(hf_cache)
    refused(lambda: hf_cache.update(*kv(1), layer_idx), "layer_idx")
    assert len(hf_cache.layers) == 1 and layer_snapshot(hf_cache) == before
    hf_cache.update(*kv(8), 1)  # the next layer in order is made
    assert len(hf_cache.layers) == 2


def test_an_update_of_the_wrong_shape_changes_nothing(hf_cache):
    hf_cache.update(*kv(8), 0)
    before = layer_snapshot(hf_cache)
    refused(lambda: hf_cache.update(torch.ones(1, HEADS + 1, 1, DIM), torch.ones(1, HEADS + 1, 1, DIM), 0), "shape")
    refused(lambda: hf_cache.update(torch.ones(1, HEADS, 2, DIM), torch.ones(1, HEADS, 1, DIM), 0), "differ")
    assert layer_snapshot(hf_cache) == before
