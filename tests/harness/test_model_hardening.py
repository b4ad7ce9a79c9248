"""Real-model inputs that must be refused, not run (docs/HARDENING.md section 2, "Models"): a
checkpoint that lacks weights (transformers would fill them with random values), non-finite
weights or config numbers, features neither the eval reference nor the pn-mix decoder computes,
a weight index that points outside the model folder, absurd shapes; and `pnmix eval` never
reporting a NaN as a score. Tiny random models made here (pnmix.testing), nothing downloaded."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="pnmix.hf needs transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from pnmix.cli import app  # noqa: E402
from pnmix.config import PnMixConfig  # noqa: E402
from pnmix.errors import PnMixError  # noqa: E402
from pnmix.hf.models import (  # noqa: E402
    check_full_attention, load_causal_lm, load_model_config, resolve_model, sliding_window,
)
from pnmix.testing import SMALL, make_tiny_model  # noqa: E402

K_PROJ = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 2-layer random Llama (untied head) in a Hugging Face folder."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def variant(tiny: Path, folder: Path, tensors=None, config=None) -> Path:
    """A copy of the tiny model with its weights (``tensors(dict)``) or config (``config(dict)``) edited."""
    shutil.copytree(tiny, folder)
    if tensors is not None:
        weights = load_file(folder / "model.safetensors")
        tensors(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        fields = json.loads((folder / "config.json").read_text())
        config(fields)
        (folder / "config.json").write_text(json.dumps(fields))
    return folder


def load(folder) -> None:
    load_causal_lm(resolve_model(str(folder)))


def refused(call, *words) -> str:
    with pytest.raises(PnMixError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    return result, lines


def one_line_error(result, lines, *words) -> None:
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for word in words:
        assert word in lines[0], lines[0]


# ---- 1. a load that leaves a parameter as random init is refused ------------------------------
@pytest.mark.parametrize("drop", [K_PROJ, "model.embed_tokens.weight", "lm_head.weight"])
def test_a_folder_missing_a_weight_is_refused_naming_it(tiny, tmp_path, drop):
    folder = variant(tiny, tmp_path / "m", tensors=lambda w: w.pop(drop))
    refused(lambda: load(folder), drop, "lacks weights", "random")


def test_a_config_claiming_more_layers_than_the_checkpoint_is_refused(tiny, tmp_path):
    folder = variant(tiny, tmp_path / "m", config=lambda c: c.update(num_hidden_layers=3))
    refused(lambda: load(folder), "model.layers.2.", "3 layers")


def test_a_config_claiming_fewer_layers_than_the_checkpoint_is_refused(tiny, tmp_path):
    """Its weights would be dropped: a 1-layer model would run where the file holds 2."""
    folder = variant(tiny, tmp_path / "m", config=lambda c: c.update(num_hidden_layers=1))
    refused(lambda: load(folder), "model.layers.1.", "no place for")


def test_a_weight_of_another_shape_is_refused(tiny, tmp_path):
    folder = variant(tiny, tmp_path / "m", tensors=lambda w: w.update({K_PROJ: torch.zeros(16, 64)}))
    refused(lambda: load(folder), "k_proj")


def test_a_tied_head_is_legitimately_absent(tmp_path):
    """Qwen3's tiny model ties lm_head to the embeddings: the file has no lm_head, and it loads."""
    folder = make_tiny_model(tmp_path / "qwen3", "qwen3")
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = load_causal_lm(resolve_model(str(folder)))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_eval_and_export_of_a_model_missing_a_weight_exit_2_writing_nothing(tiny, tmp_path):
    folder = variant(tiny, tmp_path / "m", tensors=lambda w: w.pop(K_PROJ))
    out = tmp_path / "out"
    out.mkdir()
    one_line_error(*invoke("eval", folder, "--methods", "pnmix", "--contexts", 16, "--decode-tokens", 2,
                           "--json", out / "r.json"), K_PROJ)
    one_line_error(*invoke("export", "--model", folder, "-o", out / "m.onnx", "--max-seq-len", 64), K_PROJ)
    assert list(out.iterdir()) == []


# ---- GGUF files --------------------------------------------------------------------------------
gguf_needed = pytest.mark.skipif(__import__("importlib").util.find_spec("gguf") is None,
                                 reason="writing a GGUF file needs the gguf package (the hf extra)")


def tiny_gguf(path: Path, **changes) -> Path:
    from pnmix.testing import make_tiny_gguf

    return make_tiny_gguf(path, **changes)


@gguf_needed
def test_a_whole_gguf_loads_with_its_own_weights(tmp_path):
    """The control: every tensor present, the model holds the file's values (not random ones)."""
    from gguf import GGUFReader

    path = tiny_gguf(tmp_path / "m.gguf")
    model = load_causal_lm(resolve_model(str(path)))
    embed = next(t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    assert torch.equal(model.model.embed_tokens.weight, torch.from_numpy(embed.data.copy()).reshape(128, 64))


@gguf_needed
@pytest.mark.parametrize("case, changes, words", [
    ("renamed tensor", {"rename": {"blk.1.attn_k.weight": "blk.1.attn_key.weight"}},
     ("model.layers.1.self_attn.k_proj.weight", "lacks weights")),
    ("one block too many", {"header": {"block_count": 3}}, ("model.layers.2.", "3 layers")),
    ("relabelled qwen2", {"architecture": "qwen2"}, ("lacks weights", "bias")),
    ("NaN weight", {"poison": "blk.0.ffn_up.weight"}, ("mlp.up_proj.weight", "non-finite")),
])
def test_a_gguf_that_would_load_random_or_nan_weights_is_refused(tmp_path, case, changes, words):
    path = tiny_gguf(tmp_path / "m.gguf", **changes)
    refused(lambda: load(path), *words)


# ---- 2. non-finite models ----------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [(float("nan"), "non-finite"), (float("inf"), "non-finite"),
                                          (1e30, "beyond ±65504")])
def test_a_non_finite_or_huge_weight_is_refused_naming_the_tensor(tiny, tmp_path, value, words):
    def poison(weights):
        weights[K_PROJ][3, 5] = value

    folder = variant(tiny, tmp_path / "m", tensors=poison)
    refused(lambda: load(folder), K_PROJ, words)


@pytest.mark.parametrize("field, value", [
    ("rms_norm_eps", float("inf")), ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-6),
    ("rope_theta", float("nan")), ("rope_theta", 0.0), ("rope_theta", float("inf")),
])
def test_a_non_finite_config_number_is_refused_naming_the_field(tiny, tmp_path, field, value):
    """`rms_norm_eps: Infinity` is what Python's JSON reads from a config.json."""
    def edit(config):
        if field == "rope_theta":
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": value}
            config.pop("rope_theta", None)
        else:
            config[field] = value

    folder = variant(tiny, tmp_path / "m", config=edit)
    assert ("Infinity" in (folder / "config.json").read_text()) == (value == float("inf"))
    refused(lambda: load_model_config(resolve_model(str(folder))), field)


def test_a_nan_rope_table_is_refused_by_the_decoder(tiny):
    from pnmix.export.llama import PnMixDecoder

    model = load_causal_lm(resolve_model(str(tiny)))
    model.model.rotary_emb.inv_freq[2] = float("nan")
    refused(lambda: PnMixDecoder(model, PnMixConfig(pair_layout="half", **SMALL), 64), "RoPE", "non-finite")


def test_eval_of_a_model_that_overflows_is_one_line_and_writes_no_json(tiny, tmp_path):
    """Weights within fp16's range whose fp16 activations overflow: the logits are NaN, and eval
    says so (exit 2) instead of reporting NaN KL and perplexity."""
    def scale(weights):
        for name, tensor in weights.items():
            if tensor.dim() == 2:
                weights[name] = tensor.sign() * 60000.0

    folder = variant(tiny, tmp_path / "m", tensors=scale)
    out = tmp_path / "r.json"
    one_line_error(*invoke("eval", folder, "--methods", "pnmix", "--contexts", 16, "--decode-tokens", 2,
                           "--dtype", "fp16", "--json", out), "NaN")
    assert not out.exists()


def test_a_report_with_a_non_finite_number_is_refused():
    from pnmix.hf.evaluate.command import check_finite

    row = {"method": "pnmix", "kl": 0.1, "perplexity": float("inf"), "top1": 1.0}
    refused(lambda: check_finite({"results": [row], "passkey": []}, "tiny"), "pnmix", "perplexity", "tiny")
    check_finite({"results": [dict(row, perplexity=3.0)], "passkey": []}, "tiny")


def test_nan_logits_stop_the_scoring(tiny):
    """The kl task's own check (an in-process model whose head was made NaN after loading)."""
    from pnmix.hf.evaluate.kl import kl_task
    from pnmix.hf.evaluate.methods import METHODS, REFERENCE

    model = load_causal_lm(resolve_model(str(tiny)))
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("nan")
    ids = torch.arange(3, 40).unsqueeze(0)
    refused(lambda: kl_task(model, [METHODS[REFERENCE]], ids, 30, 4, lambda _: None), "NaN logits")


# ---- 3. features neither side computes ---------------------------------------------------------
@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                          ("partial_rotary_factor", 0.5), ("attention_chunk_size", 64),
                                          ("rope_parameters", {"rope_type": "yarnn", "rope_theta": 10000.0})])
def test_a_feature_the_llama_family_does_not_compute_is_refused(tiny, tmp_path, field, value):
    folder = variant(tiny, tmp_path / "m", config=lambda c: c.update({field: value}))
    refused(lambda: load_model_config(resolve_model(str(folder))), "yarnn" if field == "rope_parameters" else field)


def test_a_sliding_window_refuses_lengths_past_it_in_eval_and_export(tiny, tmp_path):
    """A Llama config with sliding_window: transformers' DynamicCache (the eval reference) keeps
    only the window's tokens; pn-mix keeps all of them. Within the window they agree."""
    folder = variant(tiny, tmp_path / "m", config=lambda c: c.update(sliding_window=32))
    model_config = load_model_config(resolve_model(str(folder)))
    assert sliding_window(model_config) == 32
    check_full_attention(model_config, 32, "--contexts 28 + --decode-tokens 4")
    one_line_error(*invoke("eval", folder, "--methods", "pnmix", "--contexts", 40, "--decode-tokens", 2),
                   "sliding_window (32)", "--contexts 40")
    one_line_error(*invoke("eval", folder, "--methods", "pnmix", "--task", "passkey", "--lengths", 64),
                   "sliding_window (32)", "--lengths 64")
    one_line_error(*invoke("export", "--model", folder, "-o", tmp_path / "m.onnx", "--max-seq-len", 64),
                   "sliding window (32)")


def test_which_configs_slide():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(Qwen2Config(use_sliding_window=False, sliding_window=4096)) is None
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=0,
                                      num_hidden_layers=2)) == 512
    # every layer below max_window_layers: full attention, the window takes no effect
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=4,
                                      num_hidden_layers=2)) is None
    assert sliding_window(LlamaConfig()) is None


@pytest.mark.parametrize("rope, error", [
    ({"rope_type": "dynamic", "factor": 2.0}, "depends on the sequence length"),
    ({"rope_type": "longrope", "original_max_position_embeddings": 32, "long_factor": [1.5] * 8,
      "short_factor": [1.0] * 8}, "longrope"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, None),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}, None),
])
def test_rope_scaling_is_computed_as_transformers_does_or_refused(tmp_path, rope, error):
    """dynamic changes with the length, longrope switches factors past its original length (the
    export's table is one length's): refused past it. yarn and llama3 are static: the decoder's
    logits are the transformers model's at positions past the original length."""
    import transformers

    from pnmix.export.llama import PnMixDecoder

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256,
                                      rope_parameters={"rope_theta": 10000.0, **rope})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    cache_config = PnMixConfig(pair_layout="half", **SMALL)
    if error is not None:
        refused(lambda: PnMixDecoder(model, cache_config, 64), error)
        return
    decoder = PnMixDecoder(model, cache_config, 64).eval()
    ids = torch.arange(3, 60).unsqueeze(0)
    with torch.no_grad():
        ours = decoder(ids, torch.tensor(0), torch.tensor(ids.shape[1]), decoder.empty_state())[0]
        theirs = model(ids).logits[:, -1:]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_longrope_within_its_original_length_is_exported():
    import transformers

    from pnmix.export.llama import Dims

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, rope_parameters={
                                          "rope_theta": 10000.0, "rope_type": "longrope",
                                          "original_max_position_embeddings": 64, "long_factor": [1.5] * 8,
                                          "short_factor": [1.0] * 8})
    dims = Dims.from_config(config)
    dims.check_capacity(64)
    refused(lambda: dims.check_capacity(65), "original_max_position_embeddings (64)")


def test_a_non_silu_activation_is_refused_by_the_decoder(tiny, tmp_path):
    folder = variant(tiny, tmp_path / "m", config=lambda c: c.update(hidden_act="gelu"))
    one_line_error(*invoke("export", "--model", folder, "-o", tmp_path / "m.onnx", "--max-seq-len", 64),
                   "hidden_act 'gelu'")


# ---- 4. a weight index names files outside the folder -----------------------------------------
def sharded(tiny: Path, folder: Path) -> Path:
    model = load_causal_lm(resolve_model(str(tiny)))
    model.save_pretrained(folder, max_shard_size="100KB")
    shutil.copy(tiny / "tokenizer.json", folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def test_a_sharded_folder_loads_and_an_index_pointing_outside_is_refused(tiny, tmp_path):
    folder = sharded(tiny, tmp_path / "sharded")
    load(folder)  # the control: names inside the folder
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"][K_PROJ]
    shutil.copy(folder / shard, tmp_path / "other.safetensors")
    for outside in ("../other.safetensors", str(tmp_path / "other.safetensors"), "sub/../../other.safetensors",
                    "..\\other.safetensors"):
        data["weight_map"][K_PROJ] = outside
        index.write_text(json.dumps(data))
        refused(lambda: resolve_model(str(folder)), "outside the model folder", K_PROJ)
    data["weight_map"][K_PROJ] = "missing.safetensors"
    index.write_text(json.dumps(data))
    refused(lambda: resolve_model(str(folder)), "missing.safetensors")


# ---- 5. absurd shapes are refused before anything is allocated --------------------------------
@pytest.mark.parametrize("field, value, limit", [
    ("num_hidden_layers", 10**6, "1..1024"), ("hidden_size", 10**9, "1..65536"), ("vocab_size", 0, "1..4194304"),
    ("num_key_value_heads", 3, "not a multiple of num_key_value_heads 3"),
])
def test_an_absurd_shape_is_refused_at_once_saying_the_limit(tiny, tmp_path, field, value, limit):
    folder = variant(tiny, tmp_path / "m", config=lambda c: c.update({field: value, "head_dim": 16}))
    began = time.monotonic()
    refused(lambda: load(folder), field, limit)
    assert time.monotonic() - began < 10


def test_weights_beyond_memory_are_refused_before_loading(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 65536,
        "intermediate_size": 1 << 20, "num_hidden_layers": 1024, "num_attention_heads": 512,
        "num_key_value_heads": 512, "vocab_size": 1 << 22}))
    refused(lambda: load(folder), "parameters in fp32", "needs about")


@gguf_needed
@pytest.mark.parametrize("header, words", [({"block_count": 10**6}, ("num_hidden_layers", "1..1024")),
                                           ({"embedding_length": 0}, ("hidden_size", "got 0"))])
def test_an_absurd_gguf_header_is_one_line_without_warnings(tmp_path, capfd, header, words):
    path = tiny_gguf(tmp_path / "m.gguf", layers=1, header=header)
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused(lambda: load(path), *words)
    assert time.monotonic() - began < 10
    assert [str(w.message) for w in caught] == []
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


# ---- 7. determinism ----------------------------------------------------------------------------
def test_eval_gives_identical_figures_run_after_run(tiny, tmp_path):
    """Three runs of the kl task on one model: every figure but the speed identical."""
    reports = []
    for run in range(3):
        out = tmp_path / f"r{run}.json"
        result, _ = invoke("eval", tiny, "--methods", "pnmix,kivi2-g32", "--contexts", 48, "--decode-tokens", 8,
                           "--json", out)
        assert result.exit_code == 0, result.output
        rows = json.loads(out.read_text())["results"]
        for row in rows:
            assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
            row.pop("tokens_per_s")
        reports.append(rows)
    assert reports[0] == reports[1] == reports[2]
    assert len(reports[0]) == 3 and reports[0][1]["kl"] > 0


def test_eval_with_a_tokenizer_larger_than_the_vocabulary_is_one_line(tiny, tmp_path):
    """Another model's tokenizer in the folder: its ids pass the model's 128-id vocabulary (an
    IndexError in the embedding before); eval says so before anything runs."""
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {token: i + 200 for token, i in spec["model"]["vocab"].items()}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    out = tmp_path / "r.json"
    one_line_error(*invoke("eval", folder, "--methods", "pnmix", "--contexts", 16, "--decode-tokens", 2,
                           "--json", out), "the model's vocabulary has 128 ids")
    assert not out.exists()
