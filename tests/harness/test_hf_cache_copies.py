"""PnMixCache copied and saved as transformers' users do (copy.deepcopy to reuse a prompt's cache
for several continuations, pickle, torch.save / torch.load), on a tiny random Llama, on both the
dequantized (sdpa) and the packed (pnmix attention) path, with the default backend (the C++ core
where it is built)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from pnmix.format import STATE_NAMES  # noqa: E402
from pnmix.hf import PnMixCache  # noqa: E402
from pnmix.testing import tiny_llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
SMALL = dict(group_size=16, residual_size=24, sink_tokens=4)  # groups flush within a short run


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(params=["sdpa", "pnmix"])
def attention(request, model):
    from pnmix.hf.attention import register

    register()
    model.set_attn_implementation(request.param)
    yield request.param
    model.set_attn_implementation("sdpa")


def prompt(n=70):
    return torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(3))


def filled_cache(model, n=70):
    cache = PnMixCache(**SMALL)
    with torch.no_grad():
        logits = model(prompt(n), cache=cache, use_cache=True).logits[:, -1]
    return cache, logits


def state_bytes(cache):
    return [{name: layer.packed.state[name].clone() for name in STATE_NAMES} | {"seq_len": layer.packed.seq_len}
            for layer in cache.layers]


def same_state(a, b):
    return all(x["seq_len"] == y["seq_len"] and all(torch.equal(x[n], y[n]) for n in STATE_NAMES) for x, y in zip(a, b))


def greedy(model, cache, logits, steps=24):
    """Continue greedily; the ids and the last logits (the cache grows by `steps` tokens)."""
    ids = []
    with torch.no_grad():
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            ids.append(int(token))
            logits = model(token, cache=cache, use_cache=True).logits[:, -1]
    return ids, logits


def saved_and_loaded(cache, how):
    if how == "deepcopy":
        return copy.deepcopy(cache)
    if how == "pickle":
        return pickle.loads(pickle.dumps(cache))
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # a cache is an object, not a tensor file


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_or_loaded_cache_continues_exactly_as_the_original(model, attention, how):
    cache, logits = filled_cache(model)
    assert cache.ops_name is not None
    twin = saved_and_loaded(cache, how)
    assert twin is not cache and twin.ops_name == cache.ops_name
    assert same_state(state_bytes(twin), state_bytes(cache))
    ids, last = greedy(model, cache, logits)
    twin_ids, twin_last = greedy(model, twin, logits)
    assert twin_ids == ids
    torch.testing.assert_close(twin_last, last, rtol=0, atol=0)
    assert same_state(state_bytes(twin), state_bytes(cache))  # 24 more tokens: groups flushed in both
    assert cache.get_seq_length() == twin.get_seq_length() == 70 + 24


def test_copies_are_independent(model, attention):
    cache, logits = filled_cache(model)
    twin = copy.deepcopy(cache)
    before = state_bytes(twin)
    greedy(model, cache, logits, steps=20)  # the original appends and flushes a group
    assert not same_state(state_bytes(cache), before)
    assert same_state(state_bytes(twin), before)
    greedy(model, twin, logits, steps=3)  # and the other way round
    assert cache.get_seq_length() == 90 and twin.get_seq_length() == 73


def test_one_prompt_cache_serves_several_continuations(model, attention):
    """The documented reuse: fill once, deepcopy per continuation; each continuation equals a
    fresh prefill of the same prompt followed by the same tokens."""
    cache, logits = filled_cache(model)
    for first in (5, 77):
        twin = copy.deepcopy(cache)
        with torch.no_grad():
            got = model(torch.tensor([[first]]), cache=twin, use_cache=True).logits[:, -1]
            fresh, _ = filled_cache(model)
            want = model(torch.tensor([[first]]), cache=fresh, use_cache=True).logits[:, -1]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
