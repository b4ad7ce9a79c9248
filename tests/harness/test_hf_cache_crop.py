"""PnMixCache.crop for assisted / speculative and prompt-lookup decoding, and the dequantized
layers[i].keys / .values view: a crop leaves exactly what the cache would hold had it never seen
the cropped tokens (the used bytes of every state tensor), or refuses in one line saying how far
it can go, changing nothing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from pnmix.dump import dump_state  # noqa: E402
from pnmix.errors import PnMixError  # noqa: E402
from pnmix.hf import PnMixCache  # noqa: E402
from pnmix import testing  # noqa: E402
from pnmix.hf.cache import MAX_KEPT_GROUPS  # noqa: E402
from pnmix.testing import make_random_kv  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
SMALL = dict(group_size=16, residual_size=24, sink_tokens=4)  # lengths: 4 sink, a flush every 16 tokens
HEADS, DIM = 2, 32


def kv(n, seed):
    return make_random_kv(1, HEADS, n, DIM, seed=seed)


def fed(chunks, record=False, backend=None):
    """A one-layer PnMixCache that took these (k, v) chunks in order."""
    cache = PnMixCache(**SMALL, backend=backend)
    if record:
        cache.activate_past_recording()
    for k, v in chunks:
        cache.update(k, v, 0)
    return cache


def dumped(cache):
    packed = cache.layers[0].packed
    return dump_state(packed.layout, packed.state, packed.seq_len)


def split(k, v, *sizes):
    out, start = [], 0
    for size in sizes:
        out.append((k[:, :, start:start + size], v[:, :, start:start + size]))
        start += size
    return out


@pytest.mark.parametrize("backend", ["torch", None])  # the reference and the default (the core where built)
def test_crop_inside_the_residual_is_exact_without_recording(backend):
    k, v = kv(60, 0)
    cache = fed(split(k, v, 40, 5, 3), backend=backend)  # 48 tokens: 4 sink, 2 groups of 16, 12 residual
    lengths = cache.layers[0].packed.lengths()
    assert lengths.groups == 2 and lengths.residual == 12
    cache.crop(-4)  # 44 tokens still make 2 groups (a residual of 8): the residual just gets shorter
    assert cache.get_seq_length() == 44
    assert dumped(cache) == dumped(fed(split(k, v, 40, 4), backend=backend))
    cache.crop(45)  # older transformers' max_length: beyond the length, nothing to do
    cache.crop(0)
    assert cache.get_seq_length() == 44


@pytest.mark.parametrize("backend", ["torch", None])
def test_crop_across_flushed_groups_is_exact_while_recording(backend):
    k, v = kv(90, 1)
    cache = fed(split(k, v, 40, 30, 2), record=True, backend=backend)  # the 30 flush two groups
    assert cache.is_croppable
    cache.crop(-31)  # back to 41 tokens: both groups give their tokens back
    assert cache.get_seq_length() == 41
    assert dumped(cache) == dumped(fed(split(k, v, 40, 1), backend=backend))
    # and the cache goes on as if it had never seen them
    cache.update(k[:, :, 41:80], v[:, :, 41:80], 0)
    assert dumped(cache) == dumped(fed(split(k, v, 40, 1, 39), backend=backend))


@pytest.mark.parametrize("backend", ["torch", None])
def test_crop_after_packed_steps_of_the_models_kv_is_exact(backend):
    """Steps on the packed path (where the core takes the model's fp32 K/V unconverted) that flush a
    group while recording, K/V carrying autograd as outside no_grad: the crop gives back exactly the
    cache that never saw them, and no state tensor takes a graph."""
    k, v = (t.float() for t in kv(60, 3))
    cache = fed(split(k, v, 30), record=True, backend=backend)  # 4 sink, a group, 10 residual
    layer = cache.layers[0]
    layer.packed_attention = True  # what the pnmix attention sets after the prefill
    q = torch.randn(1, 2 * HEADS, 1, DIM).half()
    for t in range(30, 50):  # token 44 fills the residual: a flush
        cache.update(k[:, :, t:t + 1].requires_grad_(), v[:, :, t:t + 1].requires_grad_(), 0)
        layer.attend_pending(q)
    cache.crop(-18)  # back to 32 tokens, across the flushed group
    assert dumped(cache) == dumped(fed(split(k, v, 30, 2), backend=backend))
    assert not any(t.requires_grad for t in layer.packed.state.values())


def test_crop_past_what_is_kept_is_one_line_and_changes_nothing():
    k, v = kv(90, 2)
    cache = fed(split(k, v, 40, 30))  # not recording: the two groups the 30 flushed are quantized only
    before = dumped(cache)
    with pytest.raises(PnMixError) as error:
        cache.crop(-25)
    message = str(error.value)
    assert "\n" not in message and "cannot crop layer 0 from 70 to 45 tokens" in message
    # 70 tokens: 3 groups; 60 is the shortest length with 3 (4 sink + 3 x 16 + the residual's 8 minimum)
    assert "the lowest length it can crop to is 60" in message
    assert dumped(cache) == before
    cache.crop(-2)  # within the residual: fine
    assert dumped(cache) == dumped(fed(split(k, v, 40, 28)))


def test_crop_into_the_prefill_is_refused_unless_recording():
    k, v = kv(40, 3)
    cache = fed(split(k, v, 20, 4))
    with pytest.raises(PnMixError, match="pair mask was chosen from the 20-token prefill; the lowest length it "
                                         "can crop to is 20"):
        cache.crop(-5)
    cache.crop(-4)
    assert dumped(cache) == dumped(fed(split(k, v, 20)))
    # recording (assisted decoding's first forward is the prompt and drafts): the prefill is redone
    cache = fed(split(k, v, 30, 4), record=True)
    cache.crop(-18)
    assert cache.get_seq_length() == 16 and dumped(cache) == dumped(fed(split(k, v, 16)))
    cache.update(k[:, :, 16:40], v[:, :, 16:40], 0)
    assert dumped(cache) == dumped(fed(split(k, v, 16, 24)))


def test_only_the_last_kept_groups_come_back():
    k, v = kv(200, 4)
    cache = fed(split(k, v, 40, 150), record=True)  # 190 tokens: 11 groups, the 150 flushed 10; 4 kept
    assert len(cache.layers[0].flushed) == MAX_KEPT_GROUPS
    with pytest.raises(PnMixError, match="4 flushed group"):
        cache.crop(-100)
    cache.crop(-60)  # 130 tokens: 7 groups, the residual from group 8 on, among the 4 kept
    assert dumped(cache) == dumped(fed(split(k, v, 40, 90)))


def test_bad_crop_arguments_are_one_line():
    cache = fed([kv(30, 5)])
    for bad in (1.5, True, "3"):
        with pytest.raises(ValueError, match="crop: expected an integer"):
            cache.crop(bad)
    with pytest.raises(ValueError, match="cannot remove 31 tokens from a cache of 30"):
        cache.crop(-31)


def test_layer_keys_and_values_are_the_dequantized_cache():
    k, v = kv(70, 6)
    cache = fed([(k, v)])
    layer = cache.layers[0]
    want_k, want_v = layer.packed.dequantized()
    assert torch.equal(layer.keys, want_k.to(k.dtype)) and torch.equal(layer.values, want_v.to(v.dtype))
    assert layer.keys.shape == (1, HEADS, 70, DIM)
    torch.testing.assert_close(layer.keys[:, :, :4], k[:, :, :4].half().to(k.dtype))  # the sink is fp16
    layer.keys.zero_()  # a copy: the cache does not change
    assert torch.equal(layer.keys, want_k.to(k.dtype))
    with pytest.raises(PnMixError, match="cannot be assigned"):
        layer.keys = torch.zeros(1)
    assert PnMixCache().layers == [] and fed([]).layers == []


def tiny_llama(seed):
    return testing.tiny_llama(seed, vocab_size=64)


class LoggedCache(PnMixCache):
    """A PnMixCache that logs layer 0's appends and crops: the chunks each forward kept."""

    def __init__(self, **fields):
        super().__init__(**fields)
        self.kept = []
        self.removed = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.kept.append(key_states.shape[2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def crop(self, tokens_to_remove):
        if tokens_to_remove < 0 and self.kept:
            self.kept[-1] += tokens_to_remove
            self.removed -= tokens_to_remove
        super().crop(tokens_to_remove)


@pytest.fixture(params=["sdpa", "pnmix"])
def model(request):
    from pnmix.hf.attention import register

    register()
    model = tiny_llama(0)
    model.set_attn_implementation(request.param)
    return model


# a repetitive prompt, so prompt lookup drafts something; 60 new tokens flush several groups
PROMPT = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 33, 2, 7] * 5])


DRAFTS = {"same-weights assistant": lambda: {"assistant_model": tiny_llama(0)},  # drafts mostly kept
          "another assistant": lambda: {"assistant_model": tiny_llama(1)},  # drafts rejected
          "prompt lookup": lambda: {"prompt_lookup_num_tokens": 6}}


@pytest.mark.slow  # 6 generations of 60 tokens with their replays: about 2 minutes
@pytest.mark.parametrize("draft", list(DRAFTS))
def test_assisted_decoding_equals_feeding_the_kept_chunks(model, draft):
    """transformers' assisted and prompt-lookup generation: drafted tokens are checked in one
    forward and the cache crops the rejected ones, across group flushes. A forward's own tokens
    attend to each other in fp16 (as a prefill's do), so the tokens are those of a fresh
    PnMixCache fed the same kept chunks, one forward each: the crops leave no trace. Where every
    forward keeps one token, that is plain greedy decoding."""
    cache = LoggedCache(**SMALL)
    out = model.generate(PROMPT, cache=cache, max_new_tokens=60, do_sample=False, **DRAFTS[draft]())[0]
    assert sum(cache.kept) == cache.get_seq_length() == len(out) - 1 and cache.removed > 0
    replay, start = PnMixCache(**SMALL), 0
    with torch.no_grad():
        for size in cache.kept:
            logits = model(out[None, start:start + size], cache=replay, use_cache=True).logits[0]
            start += size
            predicted = logits[max(0, PROMPT.shape[1] - 1 - (start - size)):].argmax(-1)
            first = max(start - size + 1, PROMPT.shape[1])
            assert predicted.tolist() == out[first:start + 1].tolist()
    if max(cache.kept[1:]) == 1:
        plain = model.generate(PROMPT, cache=PnMixCache(**SMALL), max_new_tokens=60, do_sample=False)
        assert out.tolist() == plain[0].tolist()
    else:
        assert draft != "another assistant"
