"""Hardening, third round (docs/HARDENING.md): what a red team found reaching the last-resort
handler (`error: SomeError: ...`), crashing, or working minutes before its check.

* The Cache API's batch calls (reorder_cache, batch_select_indices, batch_repeat_interleave)
  refuse bad indices and counts with PnMixIndexError / PnMixValueError (PnMixErrors that are
  also the built-in IndexError / ValueError transformers' callers catch), changing nothing.
* PnMixCache.update checks the token count against the capacity before any fp16 copy.
* --threads is 1..MAX_THREADS wherever it is an option; text handed to a tokenizer is at most
  TEXT_LIMIT bytes and UTF-8; every output folder must take a new file before the run; one path
  for two outputs is refused; bench generate and export --model refuse sizes beyond the model's
  positions or memory before they allocate.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pnmix.cli import app
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError, PnMixIndexError, PnMixValueError
from pnmix.testing import make_random_kv

runner = CliRunner()
UNEXPECTED = re.compile(r"^error: [A-Z]\w*(Error|Exception|Exit|Interrupt)\b")
CONFIG = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4, pair_layout="half")
HEADS, DIM = 2, 8


def one_line_error(args, *words) -> str:
    """The command exits 2 with one `error:` line holding words, not the last-resort handler's."""
    result = runner.invoke(app, [str(a) for a in args])
    text = result.output.strip()
    assert result.exit_code == 2, (result.exit_code, text, result.exception)
    assert len(text.splitlines()) == 1 and text.startswith("error: "), text
    assert not UNEXPECTED.match(text), text
    for word in words:
        assert word in text, text
    return text


# ---------------------------------------------------------------------------------------
# The error types
# ---------------------------------------------------------------------------------------


def test_the_cache_api_errors_are_pnmix_errors_and_the_builtin_types():
    assert issubclass(PnMixIndexError, PnMixError) and issubclass(PnMixIndexError, IndexError)
    assert issubclass(PnMixValueError, PnMixError) and issubclass(PnMixValueError, ValueError)
    assert str(PnMixIndexError("row 5\n  of 2")) == "row 5 of 2"  # one line, as every PnMixError


def test_the_cli_prints_them_as_one_line_without_their_type():
    from pnmix.cli import one_line_errors

    for error in (PnMixIndexError("index 3 is out of range"), PnMixValueError("repeats must be >= 1")):
        def fail(error=error):
            raise error

        result = runner.invoke(_app_running(one_line_errors(fail)), [])
        assert result.exit_code == 2
        assert result.output.strip() == f"error: {error}", result.output


def _app_running(fn):
    import typer

    one = typer.Typer()
    one.command()(fn)
    return one


# ---------------------------------------------------------------------------------------
# PnMixCache: the batch calls and update's capacity
# ---------------------------------------------------------------------------------------


def hf_cache(batch: int = 2, layers: int = 2, max_cache_len=None):
    pytest.importorskip("transformers")
    from pnmix.hf.cache import PnMixCache

    cache = PnMixCache(CONFIG, backend="torch", max_cache_len=max_cache_len)
    for layer in range(layers):
        cache.update(*make_random_kv(batch, HEADS, 40, DIM, seed=layer), layer)
    return cache


def snapshot(cache):
    return [(layer.packed.seq_len, layer.packed.layout.batch, layer.packed.layout.max_seq_len,
             {name: t.clone() for name, t in layer.packed.state.items()}) for layer in cache.pnmix_layers]


def assert_unchanged(cache, before) -> None:
    after = snapshot(cache)
    assert len(after) == len(before)
    for (n, b, cap, state), (n2, b2, cap2, state2) in zip(before, after):
        assert (n, b, cap) == (n2, b2, cap2)
        assert all(torch.equal(state[name], state2[name]) for name in state)


BAD_INDICES = [
    ("out of range", lambda: torch.tensor([0, 2]), PnMixIndexError, "index 2 is out of range"),
    ("negative", lambda: torch.tensor([-1, 0]), PnMixIndexError, "index -1 is out of range"),
    ("list out of range", lambda: [0, 5], PnMixIndexError, "index 5"),
    ("float", lambda: torch.tensor([0.0, 1.0]), PnMixValueError, "integer tensor"),
    ("2-D", lambda: torch.tensor([[0, 1]]), PnMixValueError, "1-D"),
    ("boolean", lambda: torch.tensor([True, False]), PnMixValueError, "torch.bool"),
    ("empty", lambda: torch.tensor([], dtype=torch.int64), PnMixValueError, "no batch row"),
    ("list of floats", lambda: [0.0, 1.0], PnMixValueError, "must be integers"),
    ("list of bools", lambda: [True, False], PnMixValueError, "must be integers"),
    ("a string", lambda: "01", PnMixValueError, "got str"),
]


@pytest.mark.parametrize("call", ["reorder_cache", "batch_select_indices"])
@pytest.mark.parametrize("case,indices,error,words", BAD_INDICES, ids=[c[0] for c in BAD_INDICES])
def test_bad_batch_indices_are_refused_and_change_nothing(call, case, indices, error, words):
    cache = hf_cache()
    before = snapshot(cache)
    with pytest.raises(error) as info:
        getattr(cache, call)(indices())
    assert words in str(info.value) and call in str(info.value), str(info.value)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("repeats,words", [(-1, ">= 1"), (0, ">= 1"), (1.5, "positive integer"),
                                           (True, "positive integer"), ("2", "positive integer"),
                                           (2**40, "batch limit")])
def test_bad_repeats_are_refused_and_change_nothing(repeats, words):
    cache = hf_cache()
    before = snapshot(cache)
    with pytest.raises(PnMixValueError) as info:
        cache.batch_repeat_interleave(repeats)
    assert words in str(info.value), str(info.value)
    assert_unchanged(cache, before)


def test_an_empty_cache_checks_the_arguments_too():
    cache = hf_cache(layers=0)
    with pytest.raises(PnMixValueError):
        cache.batch_repeat_interleave(0)
    with pytest.raises(PnMixValueError):
        cache.reorder_cache(torch.tensor([0.5]))
    cache.reorder_cache(torch.tensor([3]))  # no batch yet: nothing to index, nothing changes
    assert len(cache.layers) == 0


def test_batch_select_indices_takes_a_list_or_tuple_of_ints_as_a_tensor():
    by_tensor, by_list, by_tuple = hf_cache(batch=3), hf_cache(batch=3), hf_cache(batch=3)
    by_tensor.batch_select_indices(torch.tensor([2, 0]))
    by_list.batch_select_indices([2, 0])
    by_tuple.reorder_cache((2, 0))
    for other in (by_list, by_tuple):
        for a, b in zip(by_tensor.pnmix_layers, other.pnmix_layers):
            assert a.packed.layout.batch == b.packed.layout.batch == 2
            assert all(torch.equal(a.packed.state[n], b.packed.state[n]) for n in a.packed.state)


def test_valid_batch_calls_still_work():
    cache = hf_cache(batch=2)
    rows = [layer.packed.state["key_codes"].clone() for layer in cache.pnmix_layers]
    cache.batch_repeat_interleave(2)
    for layer, before in zip(cache.pnmix_layers, rows):
        assert layer.packed.layout.batch == 4 and layer.batch_size == 4
        assert torch.equal(layer.packed.state["key_codes"], before.repeat_interleave(2, dim=0))
    cache.reorder_cache(torch.tensor([3, 3, 0, 1]))
    assert cache.get_seq_length() == 40
    with pytest.raises(PnMixValueError):
        cache.get_seq_length(-1)


def test_a_batch_call_that_fails_in_a_later_layer_changes_no_layer(monkeypatch):
    """Every layer's new state is built before any layer takes it."""
    from pnmix.cache import PackedKVCache

    cache = hf_cache()
    before = snapshot(cache)
    real, calls = PackedKVCache.resized, []

    def second_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise PnMixError("out of memory (planted)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PackedKVCache, "resized", second_fails)
    with pytest.raises(PnMixError, match="planted"):
        cache.batch_repeat_interleave(2)
    assert_unchanged(cache, before)


def test_an_update_beyond_max_cache_len_is_refused_before_its_fp16_copy(monkeypatch):
    """A 10^8-token expand()ed tensor has no memory of its own; its fp16 copy would take 6 GB."""
    import pnmix.hf.cache as hf

    cache = hf_cache(batch=1, layers=1, max_cache_len=128)
    before = snapshot(cache)
    monkeypatch.setattr(hf, "fp16_kv", lambda *a: pytest.fail("converted before the capacity check"))
    huge = torch.zeros(1, HEADS, 1, DIM).expand(1, HEADS, 10**8, DIM)
    for layer in (0, 1):  # the layer that exists, and a new one
        with pytest.raises(PnMixError, match=r"cache capacity exceeded: .*100000000 tokens > max_cache_len 128"):
            cache.update(huge, huge, layer)
    assert_unchanged(cache, before)


def test_an_update_whose_fp16_copy_cannot_fit_is_refused(monkeypatch):
    import pnmix.memory as memory

    cache = hf_cache(batch=1, layers=0)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)
    huge = torch.zeros(1, HEADS, 1, DIM).expand(1, HEADS, 10**6, DIM)
    with pytest.raises(PnMixError, match="fp16 copies of 1000000 new K/V tokens"):
        cache.update(huge, huge, 0)
    assert len(cache.layers) == 0


# ---------------------------------------------------------------------------------------
# --threads, one check everywhere
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", ["-1", "0", "100000"])
@pytest.mark.parametrize("command", [
    ["generate", "no-such.onnx", "--tokenizer", "x", "--prompt", "hi"],
    ["bench", "decode", "--impls", "torch"],
    ["bench", "generate", "--model", "no-such-model"],
], ids=["generate", "bench decode", "bench generate"])
def test_threads_outside_one_to_the_maximum_are_refused_first(command, threads):
    from pnmix.machine import MAX_THREADS

    one_line_error(command + ["--threads", threads], f"--threads must be 1..{MAX_THREADS}, got {threads}")


# ---------------------------------------------------------------------------------------
# Text for a tokenizer: UTF-8 and at most TEXT_LIMIT bytes, checked before the tokenizer
# ---------------------------------------------------------------------------------------


def test_a_prompt_file_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"caf\xe9 \xff\xfe")
    one_line_error(["generate", tmp_path / "no-such.onnx", "--tokenizer", "x", "--prompt-file", bad],
                   "prompt file", "UTF-8")


def test_a_text_beyond_the_limit_is_refused_before_it_is_read(tmp_path):
    from pnmix.io import TEXT_LIMIT

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: no 16 MiB written
        f.truncate(TEXT_LIMIT + 1)
    one_line_error(["generate", tmp_path / "no-such.onnx", "--tokenizer", "x", "--prompt-file", big],
                   f"more than the limit of {TEXT_LIMIT} bytes")
    from pnmix.dataset import text_or_hamlet  # the reader of eval's, verify --model's and bench onnx's --text

    with pytest.raises(PnMixError, match=f"more than the limit of {TEXT_LIMIT} bytes"):
        text_or_hamlet(big)


def test_a_prompt_value_is_held_to_the_same_rules():
    from pnmix.generate import read_prompt
    from pnmix.io import TEXT_LIMIT

    assert read_prompt("the capital of france", None) == "the capital of france"
    with pytest.raises(PnMixError, match="--prompt is not UTF-8 text"):
        read_prompt("caf\udce9", None)  # a command line's undecodable byte, as Python passes it on
    with pytest.raises(PnMixError, match=f"more than the limit of {TEXT_LIMIT} bytes"):
        read_prompt("x" * (TEXT_LIMIT + 1), None)


# ---------------------------------------------------------------------------------------
# Outputs: writable before the run, one path per output
# ---------------------------------------------------------------------------------------


def read_only_folder(tmp_path: Path) -> Path:
    """A folder no new file can be made in: a chmod for a normal user; root ignores modes, so
    there /proc (no regular files can be created in it)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    return Path("/proc")


def test_check_output_path_refuses_a_folder_that_takes_no_new_file(tmp_path):
    from pnmix.io import check_output_path

    folder = read_only_folder(tmp_path)
    with pytest.raises(PnMixError, match="cannot write to output folder"):
        check_output_path(folder / "out.json")
    assert check_output_path(tmp_path / "out.json") == tmp_path
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pnmix")] == []  # the probe is removed


@pytest.mark.parametrize("command", [
    ["reproduce", "--json"],
    ["generate", "no-such.onnx", "--tokenizer", "x", "--prompt", "hi", "--json"],
    ["bench", "generate", "--model", "no-such-model", "--json"],
    ["bench", "decode", "--json"],
    ["export", "-o"],
    ["doctor", "--json"],
], ids=["reproduce", "generate", "bench generate", "bench decode", "export", "doctor"])
def test_a_read_only_output_folder_is_found_before_the_run(command, tmp_path):
    one_line_error(command + [read_only_folder(tmp_path) / "out.json"], "cannot write to output folder")


def test_one_path_for_two_outputs_is_refused(tmp_path):
    out = tmp_path / "report"
    one_line_error(["eval", "x", "--json", out, "--plot", out], "--json and --plot name the same file")
    one_line_error(["eval", "x", "--json", out, "--plot", tmp_path / "." / "report"], "the same file")
    assert not out.exists()


# ---------------------------------------------------------------------------------------
# Sizes from a model, refused before anything is allocated
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from pnmix.testing import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {"model": make_tiny_model(root / "tiny"), "no-layers": make_tiny_model(root / "none", layers=0)}


def test_bench_generate_refuses_contexts_beyond_the_models_positions(tiny):
    one_line_error(["bench", "generate", "--model", tiny["model"], "--contexts", "1000000000"],
                   "--contexts 1000000000 is beyond the model's 1024 positions")


def test_bench_generate_refuses_contexts_that_cannot_fit(tiny, monkeypatch):
    import pnmix.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)
    one_line_error(["bench", "generate", "--model", tiny["model"], "--contexts", "1000"],
                   "--contexts 1000", "of memory")


def test_bench_generate_refuses_a_model_without_layers(tiny):
    one_line_error(["bench", "generate", "--model", tiny["no-layers"], "--contexts", "16", "--new-tokens", "1"],
                   "layers")  # bench generate's own check, or the model config's (num_hidden_layers)


def test_export_refuses_a_max_seq_len_whose_rope_tables_cannot_fit():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from pnmix.export.llama import Dims

    positions = 1 << 26  # within the model's positions: only memory refuses it (275 GB of tables)
    config = LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                         max_position_embeddings=positions)
    with pytest.raises(PnMixError, match=rf"--max-seq-len {positions} \(the RoPE tables\) needs about 275 GB"):
        Dims.from_config(config).check_capacity(positions)
    Dims.from_config(config).check_capacity(4096)
