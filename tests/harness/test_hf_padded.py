"""Left-padded batches with PnMixCache (pnmix/hf/padded.py): every batched generate of a
decoder-only model left-pads, and each row must give what its prompt gives alone, on the
dequantized (sdpa) and the packed (pnmix attention) path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from pnmix.hf import PnMixCache  # noqa: E402
from pnmix.hf.padded import RowsLayer  # noqa: E402
from pnmix.testing import tiny_llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
SMALL = dict(group_size=16, residual_size=24, sink_tokens=4)
LENGTHS = (37, 52, 20)  # three prompts: padded to 52


@pytest.fixture(scope="module", params=["sdpa", "pnmix"])
def model(request):
    from pnmix.hf.attention import register

    register()
    model = tiny_llama()
    model.set_attn_implementation(request.param)
    return model


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 256, (n,), generator=g) for n in LENGTHS]


def left_padded(rows, extra=0):
    width = max(len(r) for r in rows) + extra
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = row
        mask[b, width - len(row):] = 1
    return ids, mask


def generate(model, ids, mask=None, new=40, cache=None):
    cache = cache if cache is not None else PnMixCache(**SMALL)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1), cache


@pytest.mark.slow  # three and two prompts generated alone beside the batch, on both paths
def test_each_row_of_a_padded_batch_gives_what_its_prompt_gives_alone(model):
    rows = prompts()
    ids, mask = left_padded(rows)
    batch_tokens, batch_scores, cache = generate(model, ids, mask)
    assert all(isinstance(layer, RowsLayer) for layer in cache.layers)
    assert cache.get_seq_length() == ids.shape[1] + 39
    for b, row in enumerate(rows):
        alone_tokens, alone_scores, alone = generate(model, row[None])
        assert batch_tokens[b].tolist() == alone_tokens[0].tolist()
        torch.testing.assert_close(batch_scores[b], alone_scores[0], atol=2e-3, rtol=0)
        # the row's cache holds its own tokens only: the pads never entered the sink or a group
        layer, alone_layer = cache.layers[0].rows[b], alone.layers[0]
        assert layer.packed.seq_len == alone_layer.packed.seq_len == len(row) + 39
        assert layer.persistent_bytes() == alone_layer.persistent_bytes()
    assert cache.persistent_bytes() == sum(layer.persistent_bytes() for layer in cache.layers)


def test_one_prompt_with_extra_left_padding_gives_what_it_gives_alone(model):
    row = prompts()[0]
    ids, mask = left_padded([row], extra=9)
    tokens, scores, cache = generate(model, ids, mask)
    alone_tokens, alone_scores, _ = generate(model, row[None])
    assert tokens.tolist() == alone_tokens.tolist()
    torch.testing.assert_close(scores, alone_scores, atol=2e-3, rtol=0)
    assert cache.layers[0].pads == [9]


@pytest.mark.slow  # three and two prompts generated alone beside the batch, on both paths
def test_beam_search_over_a_padded_batch(model):
    rows = prompts()[:2]
    ids, mask = left_padded(rows)
    out = model.generate(ids, attention_mask=mask, cache=PnMixCache(**SMALL), max_new_tokens=12,
                         num_beams=3, do_sample=False)
    for b, row in enumerate(rows):
        alone = model.generate(row[None], cache=PnMixCache(**SMALL), max_new_tokens=12, num_beams=3,
                               do_sample=False)
        assert out[b, ids.shape[1]:].tolist() == alone[0, len(row):].tolist()


def test_layer_views_of_a_padded_batch_have_zeros_at_the_pads(model):
    rows = prompts()
    ids, mask = left_padded(rows)
    _, _, cache = generate(model, ids, mask, new=4)
    keys = cache.layers[1].keys
    assert keys.shape == (3, 2, ids.shape[1] + 3, 32)
    for b, row in enumerate(rows):
        pad = ids.shape[1] - len(row)
        assert not keys[b, :, :pad].any()
        torch.testing.assert_close(keys[b:b + 1, :, pad:], cache.layers[1].rows[b].keys)
