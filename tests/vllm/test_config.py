"""The pn-mix config a vLLM engine runs with and the start-up refusals (pnmix/vllm/config.py): every
check the backend's layer constructor runs is here, without vLLM; tests/vllm/test_engine.py checks with
vLLM that such a refusal stops the engine before it allocates KV memory."""

import json

import pytest

from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.vllm.config import CONFIG_ENV, check_engine, engine_config, layer_pages


class Llama:
    model_type = "llama"


class GptJ:
    model_type = "gptj"


GOOD = dict(model_type="llama", kv_cache_dtype="auto", prefix_caching=False)


def test_default_is_pnmixcaches_config_for_the_model(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert engine_config(Llama()) == PnMixConfig(pair_layout="half")
    assert engine_config(GptJ()).pair_layout == "adjacent"


def test_a_config_file_from_the_environment_is_laid_over_it(tmp_path, monkeypatch):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"group_size": 64, "residual_size": 64, "sink_tokens": 0}))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    cfg = engine_config(Llama())
    assert (cfg.group_size, cfg.residual_size, cfg.sink_tokens, cfg.pair_layout) == (64, 64, 0, "half")


@pytest.mark.parametrize("text, message", [
    ('{"group_size": 12}', "group_size"),
    ('{"pair_layout": "adjacent"}', "contradicts the model"),
    ('[1, 2]', "JSON object"),
    ('{"grup_size": 64}', "grup_size"),
])
def test_a_bad_config_file_is_a_one_line_error(tmp_path, monkeypatch, text, message):
    path = tmp_path / "cfg.json"
    path.write_text(text)
    monkeypatch.setenv(CONFIG_ENV, str(path))
    with pytest.raises(PnMixError, match=message) as info:
        engine_config(Llama())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma3"}, "serves llama"),
    ({"model_type": None}, "serves llama"),
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8 contradicts"),
    ({"prefix_caching": True}, "--no-enable-prefix-caching"),
    ({"sliding_window": 4096}, "sliding-window"),
    ({"alibi": True}, "ALiBi"),
])
def test_what_the_backend_cannot_serve_is_refused(change, message):
    with pytest.raises(PnMixError, match=message):
        check_engine(**{**GOOD, **change})
    check_engine(**GOOD)  # and the plain case passes


SMOLLM2_LAYER = dict(num_kv_heads=3, head_size=64, block_size=128, kv_cache_dtype="auto", prefix_caching=False)


@pytest.mark.parametrize("change, message", [
    ({"block_size": 64}, r"the pn-mix cache needs the engine's block size to equal group_size \(128\)"),
    ({"block_size": 16}, "got block size 16"),
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8 contradicts the pn-mix backend"),
    ({"prefix_caching": True}, "--no-enable-prefix-caching"),
    ({"kv_sharing": True}, "does not share KV caches between layers"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"sinks": True}, "attention sinks"),
])
def test_a_layer_the_backend_cannot_serve_is_refused_in_one_line(monkeypatch, change, message):
    """What PnMixAttentionImpl's constructor runs (pnmix/vllm/backend.py): the layer's page layout
    after every start-up check."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(PnMixError, match=message) as info:
        layer_pages(Llama(), **{**SMOLLM2_LAYER, **change})
    assert "\n" not in str(info.value)
    pages = layer_pages(Llama(), **SMOLLM2_LAYER)  # and SmolLM2's layer passes
    assert (pages.block_size, pages.token_bytes) == (128, 38)


def test_a_config_the_head_dim_cannot_take_is_refused_for_the_layer(tmp_path, monkeypatch):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"value_bits": 3}))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    with pytest.raises(PnMixError, match="head_dim"):
        layer_pages(Llama(), **{**SMOLLM2_LAYER, "head_size": 4})
    path.write_text(json.dumps({"group_size": 64, "residual_size": 64}))
    with pytest.raises(PnMixError, match=r"block size to equal group_size \(64\)"):
        layer_pages(Llama(), **SMOLLM2_LAYER)  # the file's group size decides the block size
