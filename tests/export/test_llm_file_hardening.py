"""An LLM file (`pnmix export --model`: m.onnx + m.onnx.data) from elsewhere: its pnmix.* metadata is
checked against its graph, its weights file against the digest recorded at export, and every
command that reads it (generate, verify --onnx --model, bench onnx --model) refuses a file that
disagrees with one line, exit 2, before anything runs or allocates (docs/OPS.md section 8,
docs/HARDENING.md section 2). One tiny export per module, copied and edited per test."""

import hashlib
import json
import os
import shutil
import stat

import numpy as np
import onnx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="the LLM exporter needs transformers")
pytest.importorskip("onnxruntime", reason="the LLM file runs in ONNX Runtime")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (pnmix[hf])")

from pnmix.errors import PnMixError  # noqa: E402
from pnmix.export import llm_file  # noqa: E402
from pnmix.export.llm import export_llm  # noqa: E402
from pnmix.export.llm_file import read_llm_info  # noqa: E402
from pnmix.testing import SMALL, make_tiny_model  # noqa: E402

CAPACITY = 96


class Result:
    def __init__(self, result):
        self.returncode = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr


def run_cli(*args):
    """The CLI in this process (no re-import of torch and transformers per call)."""
    from typer.testing import CliRunner

    from pnmix.cli import app

    return Result(CliRunner().invoke(app, [str(a) for a in args]))


def one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "\x1b[" not in proc.stderr and "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def copy_pair(tiny, folder, name="m.onnx"):
    """The export copied into folder (a fresh inode and modification time for the weights)."""
    folder.mkdir(exist_ok=True)
    target = folder / name
    shutil.copyfile(tiny["onnx"], target)
    shutil.copyfile(tiny["onnx"].with_name("m.onnx.data"), folder / "m.onnx.data")
    return target


def edited(tiny, folder, drop=(), **changes):
    """A copy whose pnmix.* metadata has the fields changed (strings) or dropped as asked."""
    path = copy_pair(tiny, folder)
    proto = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in proto.metadata_props}
    for key, value in changes.items():
        props["pnmix." + key] = value
    for key in drop:
        props.pop("pnmix." + key)
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, props)
    onnx.save(proto, str(path))
    return path


def refused(path, *words):
    with pytest.raises(PnMixError) as caught:
        read_llm_info(path)
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


# ---- 1. the metadata against the graph -------------------------------------------------------


def test_the_export_reads_back_and_records_the_digest_of_its_weights(tiny):
    info = read_llm_info(tiny["onnx"])
    data = tiny["onnx"].with_name("m.onnx.data").read_bytes()
    assert info.data_sha256 == hashlib.sha256(data).hexdigest()
    assert (info.layers, info.kv_heads, info.head_dim, info.q_heads, info.max_seq_len, info.batch, info.dtype) == \
        (2, 2, 16, 4, CAPACITY, 1, "fp32")
    proto = onnx.load(str(tiny["onnx"]), load_external_data=False)
    assert {p.key: p.value for p in proto.metadata_props}["pnmix.format_version"] == llm_file.FORMAT_VERSION
    names = {t.name for t in proto.graph.initializer}  # the tensors the reader checks the metadata against
    assert {llm_file.Q_PROJ, *llm_file.ROPE_TABLES} <= names
    assert llm_file.embedding(proto.graph).name == "embed"  # "lm_head" in a model with tied embeddings


EDITS = [
    # (field, value, words in the error)
    ("layers", "3", ["pnmix.layers", "2 layers"]),
    ("layers", "1", ["pnmix.layers"]),
    ("layers", "-2", ["pnmix.layers", "integer"]),
    ("layers", "0", ["pnmix.layers"]),
    ("layers", " 2", ["pnmix.layers"]),
    ("layers", "2.0", ["pnmix.layers"]),
    ("kv_heads", "1", ["pnmix.kv_heads"]),
    ("kv_heads", "4", ["pnmix.kv_heads"]),
    ("head_dim", "8", ["pnmix.head_dim"]),
    ("head_dim", "32", ["pnmix.head_dim"]),
    ("q_heads", "2", ["pnmix.q_heads"]),
    ("batch", "2", ["pnmix.batch"]),
    ("vocab_size", "100", ["pnmix.vocab_size"]),
    ("vocab_size", "99999999999999999999", ["pnmix.vocab_size"]),
    ("max_seq_len", "64", ["pnmix.max_seq_len", "96 positions"]),  # smaller: GatherND failed mid-run
    ("max_seq_len", "100", ["pnmix.max_seq_len"]),  # the same number of groups: only the RoPE table tells
    ("max_seq_len", str(10**9), ["pnmix.max_seq_len"]),  # was a MemoryError
    ("dtype", "fp16", ["pnmix.dtype", "fp32 weights"]),
    ("dtype", "bf16", ["pnmix.dtype"]),
    ("format_version", "3", ["format_version", "'3'"]),
    ("format_version", "", ["format_version"]),
    ("format_version", "1", ["format 1", "export it again"]),
    ("kind", "diagnostic", ["not an LLM file"]),
    ("config", json.dumps(dict(SMALL, group_size=32)), ["pnmix.config", "group_size"]),
    ("config", json.dumps(dict(SMALL, high_ratio=0.25)), ["pnmix.config", "high_ratio"]),
    ("config", json.dumps(dict(SMALL, typo=1)), ["pnmix.config"]),
    ("config", "[" * 100_000 + "]" * 100_000, ["pnmix.config", "nested"]),  # was a RecursionError
    ("config", '{"group_size": ' + "9" * 5000 + "}", ["pnmix.config", "digits"]),
    ("config", "not json", ["pnmix.config", "JSON"]),
    ("config", "[]", ["pnmix.config", "object"]),
    ("model_type", "llama\nllama", ["pnmix.model_type"]),
    ("model", "", ["pnmix.model"]),
    ("tokenizer_sha256", "xyz", ["pnmix.tokenizer_sha256"]),
    ("data_sha256", "0" * 64, ["weights file", "m.onnx.data", "not the one it was exported with"]),
    ("data_sha256", "Z" * 64, ["pnmix.data_sha256"]),
]


@pytest.mark.parametrize("field, value, words", EDITS, ids=[f"{f}={v[:12]!r}" for f, v, _ in EDITS])
def test_edited_metadata_is_refused_naming_the_field(tiny, tmp_path, field, value, words):
    refused(edited(tiny, tmp_path, **{field: value}), *words)


@pytest.mark.parametrize("field", ["q_heads", "data_sha256", "config", "format_version", "kind"])
def test_a_missing_field_is_named(tiny, tmp_path, field):
    refused(edited(tiny, tmp_path, drop=[field]), field if field != "kind" else "not an LLM file")


def test_a_field_given_twice_is_refused(tiny, tmp_path):
    path = copy_pair(tiny, tmp_path)
    proto = onnx.load(str(path), load_external_data=False)
    proto.metadata_props.add(key="pnmix.layers", value="3")
    onnx.save(proto, str(path))
    refused(path, "pnmix.layers twice")


def test_a_graph_input_that_disagrees_with_the_layout_is_refused(tiny, tmp_path):
    """The state tensors' shapes are CacheLayout's for the metadata: an edited graph is refused too."""
    path = copy_pair(tiny, tmp_path)
    proto = onnx.load(str(path), load_external_data=False)
    value = next(v for v in proto.graph.input if v.name == "past.1.key_codes")
    value.type.tensor_type.shape.dim[2].dim_value += 1
    onnx.save(proto, str(path))
    refused(path, "past.1.key_codes", "shape")


# every command: exit 2 and one line before anything runs (these ran with exit 0 or failed inside ONNX Runtime)
COMMANDS = {
    "generate": lambda tiny, path, out: ["generate", path, "--tokenizer", tiny["folder"], "--prompt", "the city",
                                         "--max-new-tokens", "2", "--json", out],
    "verify": lambda tiny, path, out: ["verify", "--onnx", path, "--model", tiny["folder"], "--text", tiny["text"],
                                       "--prompt-tokens", "8", "--decode-tokens", "1", "--json", out],
    "bench": lambda tiny, path, out: ["bench", "onnx", "--model", tiny["folder"], "--onnx", path, "--peer", "none",
                                      "--contexts", "8", "--repeats", "1", "--json", out],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("field, value", [("format_version", "7"), ("layers", "-1"), ("max_seq_len", "64"),
                                          ("kv_heads", "3"), ("config", "[" * 5000 + "]" * 5000)],
                         ids=["format_version", "layers", "max_seq_len", "kv_heads", "deep config"])
def test_every_command_refuses_edited_metadata_with_one_line(tiny, tmp_path, command, field, value):
    path = edited(tiny, tmp_path / "f", **{field: value})
    out = tmp_path / "out.json"
    one_line_error(run_cli(*COMMANDS[command](tiny, path, out)), field if field != "format_version" else "format")
    assert not out.exists()


def test_a_session_whose_state_cannot_fit_is_refused_before_it_allocates(tiny, monkeypatch):
    import pnmix.memory

    from pnmix.backends.onnxruntime.llm_session import LlmSession

    info = read_llm_info(tiny["onnx"])
    monkeypatch.setattr(pnmix.memory, "available_bytes", lambda: 1000)
    with pytest.raises(PnMixError, match="packed state of m.onnx needs about"):
        LlmSession(tiny["onnx"], info=info)


# ---- 2. the weights file is the one exported with the graph ---------------------------------------


def _rewrite_data(path, change):
    data = path.with_name("m.onnx.data")
    blob = bytearray(data.read_bytes())
    change(blob)
    data.write_bytes(bytes(blob))
    return path


def _tensor_slice(path, name):
    proto = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    entries = {e.key: e.value for e in tensor.external_data}
    return int(entries["offset"]), int(entries["length"])


def _swap_k_and_v(path):
    """Layer 0's k_proj and v_proj weights (same shape) swapped: a weights file of the same size and layout."""
    (k, n), (v, _) = _tensor_slice(path, "layers.0.k_proj.weight"), _tensor_slice(path, "layers.0.v_proj.weight")

    def swap(blob):
        blob[k:k + n], blob[v:v + n] = blob[v:v + n], blob[k:k + n]
    return swap


WEIGHTS = {
    "zeroed": lambda path: lambda blob: blob.__setitem__(slice(None), bytes(len(blob))),
    "NaN-filled": lambda path: lambda blob: blob.__setitem__(slice(None), np.full(len(blob) // 4, np.nan,
                                                                                  np.float32).tobytes()),
    "one byte": lambda path: lambda blob: blob.__setitem__(len(blob) // 2, blob[len(blob) // 2] ^ 1),
    "k and v swapped": _swap_k_and_v,
}


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_a_changed_weights_file_is_refused(tiny, tmp_path, kind):
    path = copy_pair(tiny, tmp_path)
    _rewrite_data(path, WEIGHTS[kind](path))
    refused(path, "m.onnx.data", "not the one it was exported with")
    out = tmp_path / "g.json"
    one_line_error(run_cli(*COMMANDS["generate"](tiny, path, out)), "not the one it was exported with")
    assert not out.exists()


def test_a_weights_file_changed_after_a_first_read_is_refused_in_the_same_process(tiny, tmp_path):
    """The digest is computed once per file and process; a change (a new modification time) hashes again."""
    path = copy_pair(tiny, tmp_path)
    data = path.with_name("m.onnx.data")
    old = data.stat().st_mtime_ns - 10**10
    os.utime(data, ns=(old, old))  # an old file: its digest is kept for the process
    read_llm_info(path)
    _rewrite_data(path, WEIGHTS["one byte"](path))
    refused(path, "not the one it was exported with")


@pytest.mark.slow
def test_the_weights_of_another_export_are_refused(tiny, tmp_path):
    """Another export of the same model (another capacity) has other RoPE tables: refused."""
    other = tmp_path / "other"
    other.mkdir()
    export_llm(str(tiny["folder"]), other / "m.onnx", 64, tiny["config"])
    path = copy_pair(tiny, tmp_path / "pair")
    shutil.copyfile(other / "m.onnx.data", path.with_name("m.onnx.data"))
    refused(path, "m.onnx.data")


@pytest.mark.parametrize("cut", [1, 4096, 100_000])
def test_a_truncated_weights_file_is_one_line_without_onnx_runtime_log_lines(tiny, tmp_path, cut):
    path = copy_pair(tiny, tmp_path)
    _rewrite_data(path, lambda blob: blob.__delitem__(slice(len(blob) - cut, None)))
    refused(path, "truncated")
    for command in ("generate", "verify"):
        one_line_error(run_cli(*COMMANDS[command](tiny, path, tmp_path / "o.json")), "truncated")


@pytest.mark.parametrize("entry, value, words", [("length", "12", ["says its external data is 12 bytes"]),
                                                 ("offset", str(10**9), ["lies at bytes", "truncated"]),
                                                 ("offset", "-1", ["unreadable external-data entry"]),
                                                 ("length", "x", ["unreadable external-data entry"])])
def test_external_data_entries_that_lie_are_one_line(tiny, tmp_path, entry, value, words):
    path = copy_pair(tiny, tmp_path)
    proto = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.name == "lm_head")
    next(e for e in tensor.external_data if e.key == entry).value = value
    onnx.save(proto, str(path))
    refused(path, "lm_head", *words)
    one_line_error(run_cli(*COMMANDS["generate"](tiny, path, tmp_path / "o.json")), "lm_head")


def test_a_file_of_format_1_is_refused_with_the_reason(tiny, tmp_path):
    """Files exported before the digest: refused (nothing tells their weights from a swapped file)."""
    path = edited(tiny, tmp_path, drop=["data_sha256"], format_version="1")
    refused(path, "format 1", "digest", "export it again")


# ---- 3. verify on fp16 files ---------------------------------------------------------------------------


def test_an_fp32_file_relabelled_fp16_is_refused_by_verify(tiny, tmp_path):
    path = edited(tiny, tmp_path / "f", dtype="fp16")
    out = tmp_path / "v.json"
    one_line_error(run_cli(*COMMANDS["verify"](tiny, path, out)), "pnmix.dtype", "fp32 weights")
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny_fp16(tiny):
    path = tiny["root"] / "fp16" / "m.onnx"
    path.parent.mkdir()
    export_llm(str(tiny["folder"]), path, CAPACITY, tiny["config"], "fp16")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("ops", ["functions", "native"])
def test_a_correct_fp16_export_passes_its_own_verify(tiny, tiny_fp16, ops):
    from pnmix.backends.onnxruntime.session import resolve_ops
    from pnmix.verify.llm import verify_llm

    if ops == "native" and resolve_ops(None) != "native":
        pytest.skip("libpnmix_ort is not built")
    report = verify_llm(tiny_fp16, str(tiny["folder"]), tiny["text"], 40, 6, ops=ops)
    run = report["runs"][0]
    assert run["graph_bytes_exact"] and all(s["graph_bytes_exact"] for s in run["steps"])
    assert run["tokens_identical"] and report["passed"], run
    # the tolerances are at least twice fp16's own error, measured in the same run
    assert all("dtype_own_logits_diff" in s for s in run["steps"])
    assert run["decode_tolerance"] >= 2 * max(s["dtype_own_logits_diff"] for s in run["steps"][1:])


@pytest.mark.slow
def test_an_fp16_file_relabelled_fp32_is_refused(tiny, tiny_fp16, tmp_path):
    path = tmp_path / "m.onnx"
    shutil.copyfile(tiny_fp16, path)
    shutil.copyfile(tiny_fp16.with_name("m.onnx.data"), tmp_path / "m.onnx.data")
    proto = onnx.load(str(path), load_external_data=False)
    next(p for p in proto.metadata_props if p.key == "pnmix.dtype").value = "fp32"
    onnx.save(proto, str(path))
    refused(path, "pnmix.dtype", "fp16 weights")


# ---- 4. bench onnx --model A --onnx <B's file> -----------------------------------------------------------


def _other_model(tmp_path, name, **kwargs):
    return make_tiny_model(tmp_path / name, **kwargs)


def test_bench_refuses_a_file_of_another_model(tiny, tmp_path):
    out = tmp_path / "b.json"
    other = _other_model(tmp_path, "other", seed=1)  # same shapes and tokenizer, other weights, other name
    one_line_error(run_cli(*COMMANDS["bench"]({**tiny, "folder": other}, tiny["onnx"], out)),
                   "exported from llama", "not from --model")
    assert not out.exists()


def test_bench_refuses_another_models_shapes_and_tokenizer(tiny, tmp_path):
    out = tmp_path / "b.json"
    deeper = _other_model(tmp_path / "deeper", "llama", layers=3)  # the same name, three layers
    one_line_error(run_cli(*COMMANDS["bench"]({**tiny, "folder": deeper}, tiny["onnx"], out)), "layers 2", "layers 3")
    renamed = _other_model(tmp_path / "tok", "llama")
    vocab = json.loads((renamed / "tokenizer.json").read_text())
    size = len(vocab["model"]["vocab"])
    vocab["model"]["vocab"] = {k: (v + 1) % size for k, v in vocab["model"]["vocab"].items()}
    (renamed / "tokenizer.json").write_text(json.dumps(vocab))
    one_line_error(run_cli(*COMMANDS["bench"]({**tiny, "folder": renamed}, tiny["onnx"], out)), "tokenizer")
    assert not out.exists()


def test_bench_runs_the_file_of_its_own_model(tiny, tmp_path):
    out = tmp_path / "b.json"
    proc = run_cli(*COMMANDS["bench"](tiny, tiny["onnx"], out), "--ops", "functions")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["rows"][0]["context"] == 8


# ---- 5. the pair as an output ----------------------------------------------------------------------------


def _save_pair(tiny, path, **kwargs):
    """export/llm.py's save_atomic on the tiny file's model (no tracing: an onnx_ir model loaded from it)."""
    import onnx_ir as ir

    from pnmix.export.llm import save_atomic

    return save_atomic(ir.load(str(tiny["onnx"])), path, **kwargs)


def test_rewriting_the_pair_keeps_both_modes_and_a_new_pair_gets_the_umask(tiny, tmp_path):
    path = copy_pair(tiny, tmp_path)
    data = path.with_name("m.onnx.data")
    os.chmod(path, 0o600)
    os.chmod(data, 0o640)
    _save_pair(tiny, path)
    assert (stat.S_IMODE(path.stat().st_mode), stat.S_IMODE(data.stat().st_mode)) == (0o600, 0o640)
    assert read_llm_info(path).data_sha256 == hashlib.sha256(data.read_bytes()).hexdigest()
    fresh = tmp_path / "new" / "m.onnx"
    fresh.parent.mkdir()
    umask = os.umask(0o022)
    os.umask(umask)
    _save_pair(tiny, fresh)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (fresh, fresh.with_name("m.onnx.data"))} == {0o666 & ~umask}
    assert sorted(p.name for p in fresh.parent.iterdir()) == ["m.onnx", "m.onnx.data"]  # no staging folder left


def test_a_pair_that_fails_the_checker_leaves_the_old_pair(tiny, tmp_path, monkeypatch):
    import pnmix.export.llm as llm

    path = copy_pair(tiny, tmp_path)
    before = path.read_bytes(), path.with_name("m.onnx.data").read_bytes()

    def failing(staged, output):
        raise PnMixError(f"exported model {output} fails the ONNX checker: planted")

    monkeypatch.setattr(llm, "check_written", failing)
    with pytest.raises(PnMixError, match="planted"):
        _save_pair(tiny, path)
    assert (path.read_bytes(), path.with_name("m.onnx.data").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_special_weights_path_is_refused_before_the_export(tiny, tmp_path, kind):
    data = tmp_path / "m.onnx.data"
    os.mkfifo(data) if kind == "fifo" else data.mkdir()
    proc = run_cli("export", "--model", tiny["folder"], "-o", tmp_path / "m.onnx")
    one_line_error(proc, "m.onnx.data")
    assert stat.S_ISFIFO(data.lstat().st_mode) if kind == "fifo" else data.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx.data"]


def test_the_fuzz_target_finds_a_reader_that_stops_checking(tiny, tmp_path, monkeypatch):
    """tools/fuzz_python.py's llm_meta target reports an accepted file whose metadata lies (a planted gap)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import fuzz_python as fuzz

    monkeypatch.setattr(llm_file, "check_graph", lambda *args: None)
    monkeypatch.setattr(fuzz, "_LLM_FILES", [tiny["onnx"]])
    result = fuzz.run_loop("llm_meta", 150, 60.0, seed=4, crash_dir=tmp_path, log=lambda _: None)
    assert any("accepted" in f for f in result["findings"]), result
