"""Every command, given a missing, unreadable, truncated or malformed file or a bad option value,
exits non-zero with ONE line naming the problem, never a traceback; and a failing command never
clobbers an existing output file (docs/HARDENING.md).

Each case names the module its command runs, which must import (a missing in-repo module is a
packaging bug, never a skip); cases that need the optional transformers skip without it. A message of the form
``error: SomeError: ...`` comes from the CLI's last-resort handler for unexpected exceptions, so it
counts as a failure here: the problem must be caught and named where it happens.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pnmix.cli import app
from pnmix.manifest import bundled_path

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
UNEXPECTED = re.compile(r"^error: [A-Z]\w*(Error|Exception|Exit|Interrupt)\b")
SENTINEL = b"an earlier result that a failing run must leave alone\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad inputs of every kind, made once."""
    root = tmp_path_factory.mktemp("bad")
    manifest = bundled_path().read_text()
    paths = {
        "MISSING": root / "no-such-file.json",
        "MISSING_DIR": root / "no-such-folder",
        "DIR": root / "a-folder",
        "EMPTY": root / "empty.json",
        "GARBAGE": root / "garbage.bin",
        "NOT_UTF8": root / "latin1.json",
        "TRUNC_MANIFEST": root / "truncated-manifest.json",
        "BAD_CONFIG": root / "bad-config.json",
        "LIST_CONFIG": root / "list-config.json",
        "HUGE_SINK": root / "huge-sink.json",
        "NO_PREFILL": root / "no-prefill.json",
        "LONG_PROTOCOL": root / "long-protocol.json",
        "TEXT": root / "text.txt",
        "FOREIGN_ONNX": root / "identity.onnx",
    }
    paths["DIR"].mkdir()
    paths["EMPTY"].write_bytes(b"")
    paths["GARBAGE"].write_bytes(bytes(range(256)) * 4)
    paths["NOT_UTF8"].write_bytes(b'{"group_size": "\xe9\xff"}')
    paths["TRUNC_MANIFEST"].write_text(manifest[: len(manifest) // 2])
    paths["BAD_CONFIG"].write_text('{"group_size": "eight"}')
    paths["LIST_CONFIG"].write_text("[128, 128]")
    paths["HUGE_SINK"].write_text('{"sink_tokens": 1000000000000}')
    paths["NO_PREFILL"].write_text('{"prefill_tokens": 0}')
    paths["LONG_PROTOCOL"].write_text('{"prefill_tokens": 100000000}')
    paths["TEXT"].write_text("To be, or not to be, that is the question. " * 20)
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(paths["FOREIGN_ONNX"]))
    # A plan that is not an engine, beside a valid description (sidecar), and one with a bare sidecar.
    from pnmix.config import PnMixConfig

    for name, sidecar in (("ENGINE", {
        "format": "pnmix-engine-1", "config": PnMixConfig().to_dict(), "capacity": 448, "batch": 1,
        "seed": 42, "precision": "fp32", "profiles": {"decode": 0, "prefill": 1, "max_prefill": 384},
    }), ("ENGINE_BARE_SIDECAR", {"format": "pnmix-engine-1"})):
        paths[name] = root / f"{name.lower()}.plan"
        paths[name].write_bytes(b"not a TensorRT plan" * 10)
        (root / f"{name.lower()}.plan.json").write_text(json.dumps(sidecar))
    if importlib.util.find_spec("transformers") is not None:
        paths.update(_hf_model_dirs(root))
    return paths


def _hf_model_dirs(root: Path) -> dict:
    """A tiny random Llama (no download), one with a truncated weights file, one with a broken config."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    good = root / "hf-model"
    LlamaForCausalLM(config).save_pretrained(good)
    truncated, broken = root / "hf-truncated", root / "hf-broken-config"
    shutil.copytree(good, truncated)
    shutil.copytree(good, broken)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    return {"HF_MODEL": good, "HF_TRUNCATED": truncated, "HF_BROKEN_CONFIG": broken}


def module_ready(module: str | None, args, files) -> None:
    if module is not None:  # an in-repo module: missing is a packaging bug, never a skip
        importlib.import_module(module)
    if any(a.startswith("HF_") for a in args) and "HF_MODEL" not in files:
        pytest.skip("transformers is not installed (the optional hf extra)")


def invoke(args, files, out: Path | None = None):
    def resolve(arg: str) -> str:
        head, _, tail = arg.partition("/")
        if head == "OUT":
            return str(out)
        if head in files:
            return str(files[head] / tail) if tail else str(files[head])
        return arg

    argv = [resolve(a) for a in args]
    return runner.invoke(app, argv)


def assert_one_line_error(result, words) -> str:
    text = result.output.strip()
    assert result.exit_code not in (0, None), f"exit 0 for a bad input: {text}"
    assert result.exit_code == 2, f"errors exit 2, got {result.exit_code}: {text}"
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line:\n{text}"
    assert not UNEXPECTED.match(lines[0]), f"an unexpected exception reached the CLI: {lines[0]}"
    for word in words:
        assert word.lower() in lines[0].lower(), f"{word!r} not named in: {lines[0]}"
    return lines[0]


# (id, module the command needs, argv, words the message must name)
CASES = [
    # reproduce: the manifest, the config, the options, the output
    ("reproduce-missing-manifest", None, ["reproduce", "--manifest", "MISSING"], ["not found"]),
    ("reproduce-manifest-is-folder", None, ["reproduce", "--manifest", "DIR"], ["directory"]),
    ("reproduce-empty-manifest", None, ["reproduce", "--manifest", "EMPTY"], ["not valid JSON"]),
    ("reproduce-truncated-manifest", None, ["reproduce", "--manifest", "TRUNC_MANIFEST"], ["not valid JSON"]),
    ("reproduce-binary-manifest", None, ["reproduce", "--manifest", "GARBAGE"], ["manifest"]),
    ("reproduce-not-utf8-config", None, ["reproduce", "--config", "NOT_UTF8"], ["config"]),
    ("reproduce-missing-config", None, ["reproduce", "--config", "MISSING"], ["config", "not found"]),
    ("reproduce-bad-field", None, ["reproduce", "--config", "BAD_CONFIG"], ["group_size"]),
    ("reproduce-list-config", None, ["reproduce", "--config", "LIST_CONFIG"], ["JSON object"]),
    ("reproduce-huge-sink", None, ["reproduce", "--config", "HUGE_SINK"], ["sink_tokens"]),
    ("reproduce-no-prefill", None, ["reproduce", "--config", "NO_PREFILL"], ["prefill_tokens"]),
    ("reproduce-too-long", None, ["reproduce", "--config", "LONG_PROTOCOL"], ["tokens"]),
    ("reproduce-bad-seeds", None, ["reproduce", "--seeds", "42,x"], ["--seeds"]),
    ("reproduce-no-seeds", None, ["reproduce", "--seeds", ","], ["seed"]),
    ("reproduce-bad-device", None, ["reproduce", "--device", "tpu"], ["--device"]),
    ("reproduce-json-folder-missing", None, ["reproduce", "--json", "MISSING_DIR/r.json"], ["does not exist"]),
    ("reproduce-json-is-folder", None, ["reproduce", "--json", "DIR"], ["directory"]),
    ("reproduce-bad-config-keeps-json", None, ["reproduce", "--config", "BAD_CONFIG", "--json", "OUT"], ["group_size"]),
    # verify
    ("verify-no-backend", None, ["verify"], ["exactly one"]),
    ("verify-two-backends", None, ["verify", "--backend", "torch", "--onnx", "GARBAGE"], ["exactly one"]),
    ("verify-unknown-backend", None, ["verify", "--backend", "jax"], ["--backend"]),
    ("verify-bad-device", None, ["verify", "--backend", "torch", "--device", "tpu"], ["--device"]),
    ("verify-bad-manifest-keeps-json", None, ["verify", "--backend", "torch", "--manifest", "GARBAGE", "--json", "OUT"], ["manifest"]),
    ("verify-onnx-on-cuda", "pnmix.backends.onnxruntime.backend", ["verify", "--onnx", "GARBAGE", "--device", "tpu"], ["--device"]),
    ("verify-onnx-missing", "pnmix.backends.onnxruntime.backend", ["verify", "--onnx", "MISSING"], ["not found"]),
    ("verify-onnx-folder", "pnmix.backends.onnxruntime.backend", ["verify", "--onnx", "DIR"], ["not a file"]),
    ("verify-onnx-empty", "pnmix.backends.onnxruntime.backend", ["verify", "--onnx", "EMPTY"], ["empty"]),
    ("verify-onnx-garbage", "pnmix.backends.onnxruntime.backend", ["verify", "--onnx", "GARBAGE"], ["not an ONNX model"]),
    ("verify-onnx-json", "pnmix.backends.onnxruntime.backend", ["verify", "--onnx", "TRUNC_MANIFEST"], ["ONNX"]),
    ("verify-onnx-foreign", "pnmix.backends.onnxruntime.backend", ["verify", "--onnx", "FOREIGN_ONNX"], ["pnmix"]),
    ("verify-engine-missing", "pnmix.backends.tensorrt.backend", ["verify", "--engine", "MISSING", "--plugins", "GARBAGE"], ["not found"]),
    ("verify-engine-garbage-plugins-missing", "pnmix.backends.tensorrt.backend", ["verify", "--engine", "GARBAGE", "--plugins", "MISSING"], ["not found"]),
    ("verify-engine-without-sidecar", "pnmix.backends.tensorrt.backend", ["verify", "--engine", "GARBAGE", "--plugins", "GARBAGE"], ["engine description not found"]),
    ("verify-engine-plugins-missing", "pnmix.backends.tensorrt.backend", ["verify", "--engine", "ENGINE", "--plugins", "MISSING"], ["plugin", "not found"]),
    ("verify-engine-plugins-folder", "pnmix.backends.tensorrt.backend", ["verify", "--engine", "ENGINE", "--plugins", "DIR"], ["director"]),
    ("verify-engine-bare-sidecar", "pnmix.backends.tensorrt.backend", ["verify", "--engine", "ENGINE_BARE_SIDECAR", "--plugins", "GARBAGE"], ["config", "missing"]),
    # export
    ("export-folder-missing", "pnmix.export.exporter", ["export", "-o", "MISSING_DIR/m.onnx"], ["does not exist"]),
    ("export-output-is-folder", "pnmix.export.exporter", ["export", "-o", "DIR"], ["directory"]),
    ("export-zero-capacity", "pnmix.export.exporter", ["export", "-o", "OUT", "--max-seq-len", "0"], ["max_seq_len"]),
    ("export-negative-batch", "pnmix.export.exporter", ["export", "-o", "OUT", "--batch", "-1"], ["batch"]),
    ("export-bad-opset", "pnmix.export.exporter", ["export", "-o", "OUT", "--opset", "3"], ["opset"]),
    ("export-bad-config-keeps-output", "pnmix.export.exporter", ["export", "-o", "OUT", "--config", "BAD_CONFIG"], ["group_size"]),
    ("export-missing-manifest", "pnmix.export.exporter", ["export", "-o", "OUT", "--manifest", "MISSING"], ["not found"]),
    # bench decode (10^12 tokens is past any address space: the allocation fails, never succeeds lazily)
    ("bench-decode-context-beyond-memory", "pnmix.bench.decode", ["bench", "decode", "--context", "1000000000000", "--repeats", "1"], ["context", "memory"]),
    ("bench-decode-huge-threads", "pnmix.bench.decode", ["bench", "decode", "--threads", "1000000000000", "--context", "64", "--repeats", "1"], ["threads"]),
    ("bench-decode-huge-q-heads", "pnmix.bench.decode", ["bench", "decode", "--q-heads", "9223372036854775808", "--context", "64", "--repeats", "1"], ["heads"]),
    ("bench-decode-negative-context", "pnmix.bench.decode", ["bench", "decode", "--context", "-1"], ["context"]),
    ("bench-decode-zero-batch", "pnmix.bench.decode", ["bench", "decode", "--batch", "0"], ["batch"]),
    ("bench-decode-odd-head-dim", "pnmix.bench.decode", ["bench", "decode", "--head-dim", "7"], ["head"]),
    ("bench-decode-gqa-mismatch", "pnmix.bench.decode", ["bench", "decode", "--q-heads", "32", "--kv-heads", "5"], ["heads"]),
    ("bench-decode-zero-threads", "pnmix.bench.decode", ["bench", "decode", "--threads", "0"], ["threads"]),
    ("bench-decode-bad-device", "pnmix.bench.decode", ["bench", "decode", "--device", "tpu"], ["device"]),
    ("bench-decode-unknown-impl", "pnmix.bench.decode", ["bench", "decode", "--impls", "nope"], ["nope"]),
    ("bench-decode-zero-repeats", "pnmix.bench.decode", ["bench", "decode", "--repeats", "0"], ["repeats"]),
    ("bench-decode-missing-config", "pnmix.bench.decode", ["bench", "decode", "--config", "MISSING"], ["not found"]),
    ("bench-decode-json-folder-missing", "pnmix.bench.decode", ["bench", "decode", "--context", "64", "--json", "MISSING_DIR/b.json"], ["does not exist"]),
    # bench onnx
    ("bench-onnx-zero-capacity", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "0"], ["max"]),
    ("bench-onnx-context-beyond-capacity", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "64", "--context", "100"], ["context"]),
    ("bench-onnx-zero-repeats", "pnmix.bench.onnx", ["bench", "onnx", "--repeats", "0"], ["repeats"]),
    ("bench-onnx-missing-model", "pnmix.bench.onnx", ["bench", "onnx", "--model", "MISSING"], ["not found"]),
    ("bench-onnx-garbage-model", "pnmix.bench.onnx", ["bench", "onnx", "--model", "GARBAGE"], ["not an ONNX model"]),
    ("bench-onnx-json-folder-missing", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "200", "--repeats", "1", "--json", "MISSING_DIR/b.json"], ["does not exist"]),
    # doctor
    ("doctor-json-folder-missing", "pnmix.doctor", ["doctor", "--json", "MISSING_DIR/d.json"], ["does not exist"]),
    ("doctor-json-is-folder", "pnmix.doctor", ["doctor", "--json", "DIR"], ["directory"]),
    # build-engine: paths are checked before TensorRT is even imported
    ("build-engine-missing-model", "pnmix.backends.tensorrt.engine", ["build-engine", "MISSING", "--plugins", "GARBAGE", "-o", "OUT"], ["not found"]),
    ("build-engine-missing-plugins", "pnmix.backends.tensorrt.engine", ["build-engine", "FOREIGN_ONNX", "--plugins", "MISSING", "-o", "OUT"], ["plugin", "not found"]),
    ("build-engine-plugins-folder", "pnmix.backends.tensorrt.engine", ["build-engine", "FOREIGN_ONNX", "--plugins", "DIR", "-o", "OUT"], ["director"]),
    ("build-engine-garbage-model", "pnmix.backends.tensorrt.engine", ["build-engine", "GARBAGE", "--plugins", "GARBAGE", "-o", "OUT"], ["ONNX"]),
    ("build-engine-foreign-model", "pnmix.backends.tensorrt.engine", ["build-engine", "FOREIGN_ONNX", "--plugins", "GARBAGE", "-o", "OUT"], ["pnmix"]),
    # eval
    ("eval-missing-model", "pnmix.hf.evaluate", ["eval", "MISSING_DIR", "--text", "TEXT"], ["not found"]),
    ("eval-not-a-model", "pnmix.hf.evaluate", ["eval", "DIR", "--text", "TEXT"], ["config.json"]),
    ("eval-model-is-file", "pnmix.hf.evaluate", ["eval", "GARBAGE", "--text", "TEXT"], ["folder"]),
    ("eval-missing-text", "pnmix.hf.evaluate", ["eval", "DIR", "--text", "MISSING"], ["text", "not found"]),
    ("eval-binary-text", "pnmix.hf.evaluate", ["eval", "HF_MODEL", "--text", "GARBAGE"], ["UTF-8"]),
    ("eval-zero-context", "pnmix.hf.evaluate", ["eval", "DIR", "--text", "TEXT", "--contexts", "0"], ["--contexts"]),
    ("eval-context-too-long", "pnmix.hf.evaluate", ["eval", "HF_MODEL", "--text", "TEXT", "--contexts", "100000"], ["tokens"]),
    ("eval-bad-config", "pnmix.hf.evaluate", ["eval", "HF_MODEL", "--text", "TEXT", "--config", "BAD_CONFIG"], ["group_size"]),
    ("eval-missing-config", "pnmix.hf.evaluate", ["eval", "HF_MODEL", "--text", "TEXT", "--config", "MISSING"], ["not found"]),
    ("eval-truncated-weights", "pnmix.hf.evaluate", ["eval", "HF_TRUNCATED", "--text", "TEXT", "--contexts", "64", "--decode-tokens", "8"], ["hf-truncated"]),
    ("eval-broken-model-config", "pnmix.hf.evaluate", ["eval", "HF_BROKEN_CONFIG", "--text", "TEXT"], ["config.json"]),
    ("eval-json-folder-missing", "pnmix.hf.evaluate", ["eval", "HF_MODEL", "--text", "TEXT", "--contexts", "64", "--json", "MISSING_DIR/h.json"], ["does not exist"]),
    # out-of-range option values: one line naming the option, from the one place each command checks them
    ("export-max-seq-len--1", "pnmix.export.exporter", ["export", "-o", "OUT", "--max-seq-len", "-1"], ["max_seq_len"]),
    ("export-max-seq-len-1000000000000", "pnmix.export.exporter", ["export", "-o", "OUT", "--max-seq-len", "1000000000000"], ["max_seq_len"]),
    ("export-batch-0", "pnmix.export.exporter", ["export", "-o", "OUT", "--batch", "0"], ["batch"]),
    ("export-batch-1000000000000", "pnmix.export.exporter", ["export", "-o", "OUT", "--batch", "1000000000000"], ["batch"]),
    ("export-opset--1", "pnmix.export.exporter", ["export", "-o", "OUT", "--opset", "-1"], ["opset"]),
    ("export-opset-0", "pnmix.export.exporter", ["export", "-o", "OUT", "--opset", "0"], ["opset"]),
    ("export-opset-1000000000000", "pnmix.export.exporter", ["export", "-o", "OUT", "--opset", "1000000000000"], ["opset"]),
    ("export-seed-beyond-torch", "pnmix.export.exporter", ["export", "-o", "OUT", "--seed", "100000000000000000000000"], ["--seed"]),
    ("bench-onnx-max-seq-len--1", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "-1"], ["max_seq_len"]),
    ("bench-onnx-max-seq-len-1000000000000", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "1000000000000"], ["max_seq_len"]),
    ("bench-onnx-context--1", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "64", "--context", "-1"], ["--context"]),
    ("bench-onnx-context-0", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "64", "--context", "0"], ["--context"]),
    ("bench-onnx-repeats--1", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "64", "--repeats", "-1"], ["--repeats"]),
    ("bench-onnx-repeats-100000000000000000000000", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "64", "--repeats", "100000000000000000000000"], ["--repeats"]),
    ("bench-onnx-context-beyond-dataset", "pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "1000000", "--context", "500000"], ["--context", "dataset"]),
    ("bench-decode-context-0", "pnmix.bench.decode", ["bench", "decode", "--context", "0", "--repeats", "1"], ["--context"]),
    ("bench-decode-context-10000000000000000", "pnmix.bench.decode", ["bench", "decode", "--context", "10000000000000000", "--repeats", "1"], ["--context"]),
    ("bench-decode-batch--1", "pnmix.bench.decode", ["bench", "decode", "--batch", "-1", "--context", "64"], ["--batch"]),
    ("bench-decode-batch-100000000000000000000000", "pnmix.bench.decode", ["bench", "decode", "--batch", "100000000000000000000000", "--context", "64"], ["--batch"]),
    ("bench-decode-q-heads--1", "pnmix.bench.decode", ["bench", "decode", "--q-heads", "-1", "--context", "64"], ["--q-heads"]),
    ("bench-decode-q-heads-0", "pnmix.bench.decode", ["bench", "decode", "--q-heads", "0", "--context", "64"], ["--q-heads"]),
    ("bench-decode-q-heads-100000000000000000000000", "pnmix.bench.decode", ["bench", "decode", "--q-heads", "100000000000000000000000", "--context", "64"], ["--q-heads"]),
    ("bench-decode-kv-heads--1", "pnmix.bench.decode", ["bench", "decode", "--kv-heads", "-1", "--context", "64"], ["--kv-heads"]),
    ("bench-decode-kv-heads-0", "pnmix.bench.decode", ["bench", "decode", "--kv-heads", "0", "--context", "64"], ["--kv-heads"]),
    ("bench-decode-kv-heads-100000000000000000000000", "pnmix.bench.decode", ["bench", "decode", "--kv-heads", "100000000000000000000000", "--context", "64"], ["--kv-heads"]),
    ("bench-decode-head-dim--1", "pnmix.bench.decode", ["bench", "decode", "--head-dim", "-1", "--context", "64"], ["--head-dim"]),
    ("bench-decode-head-dim-0", "pnmix.bench.decode", ["bench", "decode", "--head-dim", "0", "--context", "64"], ["--head-dim"]),
    ("bench-decode-head-dim-100000000000000000000000", "pnmix.bench.decode", ["bench", "decode", "--head-dim", "100000000000000000000000", "--context", "64"], ["--head-dim"]),
    ("bench-decode-repeats--1", "pnmix.bench.decode", ["bench", "decode", "--repeats", "-1", "--context", "64"], ["--repeats"]),
    ("bench-decode-repeats-100000000000000000000000", "pnmix.bench.decode", ["bench", "decode", "--repeats", "100000000000000000000000", "--context", "64"], ["--repeats"]),
    ("bench-decode-threads--1", "pnmix.bench.decode", ["bench", "decode", "--threads", "-1", "--context", "64"], ["--threads"]),
    ("bench-decode-threads-100000000000000000000000", "pnmix.bench.decode", ["bench", "decode", "--threads", "100000000000000000000000", "--context", "64"], ["--threads"]),
    ("eval-decode-tokens-negative", "pnmix.hf.evaluate", ["eval", "DIR", "--text", "TEXT", "--decode-tokens", "-1"], ["--decode-tokens"]),
    ("reproduce-seed-beyond-torch", None, ["reproduce", "--seeds", "42,100000000000000000000000"], ["--seeds"]),
    ("verify-seed-beyond-torch", None, ["verify", "--backend", "torch", "--seeds", "-100000000000000000000000"], ["--seeds"]),
]


def _param(case):
    """A case with a 5th element is a known gap in another module: xfail, reason = the report."""
    marks = [pytest.mark.xfail(reason=case[4], strict=False)] if len(case) > 4 else []
    return pytest.param(case[:4], id=case[0], marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, files, tmp_path):
    name, module, args, words = case
    module_ready(module, args, files)
    out = tmp_path / ("out.onnx" if args[0] in ("export", "build-engine") else "out.json")
    out.write_bytes(SENTINEL)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(args, files, out)
    assert_one_line_error(result, words)
    # A failing command leaves an existing output as it was, and no temporary file beside it.
    assert out.read_bytes() == SENTINEL
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_cuda_asked_for_without_a_gpu_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for argv in (["reproduce", "--device", "cuda"], ["verify", "--backend", "core", "--device", "cuda"]):
        assert_one_line_error(runner.invoke(app, argv), ["cuda"])


def test_triton_on_cpu_without_the_interpreter_is_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from pnmix.backends import triton_ops

    if triton_ops.triton_available() and triton_ops._kernels().interpreting():
        pytest.skip("Triton's interpreter is on in this process")
    assert_one_line_error(runner.invoke(app, ["verify", "--backend", "triton", "--device", "cpu"]), ["triton"])


def test_unreadable_file_is_one_line(files, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: file permissions do not stop reads (folders and bad bytes are tested)")
    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0)
    assert_one_line_error(runner.invoke(app, ["reproduce", "--config", str(locked)]), ["cannot read"])


def test_usage_errors_exit_non_zero_without_traceback():
    for argv in (["reproduce", "--seeds"], ["export"], ["bench", "decode", "--context", "many"], ["nonsense"],
                 ["build-engine", "m.onnx", "--plugins", "p.so", "-o", "e.plan", "--bf16"]):  # no precision flags
        result = runner.invoke(app, argv)
        assert result.exit_code == 2 and "Traceback" not in result.output, argv


# ---------------------------------------------------------------------------------------
# As a new user would: the installed entry point in a fresh process
# ---------------------------------------------------------------------------------------


def run_pnmix(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "pnmix", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd or REPO, timeout=180)


@pytest.mark.slow  # a fresh process per case
def test_subprocess_bad_inputs_print_one_line_on_stderr(files):
    cases = (
        (["reproduce", "--manifest", files["TRUNC_MANIFEST"]], "not valid JSON"),
        (["reproduce", "--config", files["BAD_CONFIG"], "--seeds", "42"], "group_size"),
        (["verify", "--backend", "torch", "--json", files["MISSING_DIR"] / "x.json"], "does not exist"),
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="80")
    running = [subprocess.Popen([sys.executable, "-m", "pnmix", *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for args, _ in cases]
    for (args, words), process in zip(cases, running):
        stdout, stderr = process.communicate(timeout=180)
        done = subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in done.stderr, done.stderr
        assert done.stdout.strip() == ""


@pytest.mark.slow  # a fresh process
def test_debug_flag_shows_the_traceback(files):
    done = run_pnmix("--debug", "reproduce", "--manifest", files["MISSING"])
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "not found" in done.stderr


# ---------------------------------------------------------------------------------------
# Outputs: written to a temporary name, then renamed (pnmix/io.py)
# ---------------------------------------------------------------------------------------


def test_atomic_write_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    from pnmix import io
    from pnmix.errors import PnMixError

    target = tmp_path / "result.json"
    target.write_bytes(SENTINEL)

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.os, "replace", broken_replace)
    with pytest.raises(PnMixError, match="cannot write .*No space left"):
        io.write_json_atomic(target, {"passed": True})
    assert target.read_bytes() == SENTINEL
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_atomic_write_interrupted_mid_write_leaves_no_temporary(tmp_path):
    from pnmix import io

    target = tmp_path / "result.json"
    target.write_bytes(SENTINEL)

    class Unserializable:
        pass

    with pytest.raises(TypeError):  # a bug, not bad input: it propagates, and cleans up first
        io.write_json_atomic(target, {"x": Unserializable()})
    real_write = io.os.write

    def interrupted(fd, data):  # a write cut short by Ctrl-C after half the bytes
        real_write(fd, bytes(data[: len(data) // 2]))
        raise KeyboardInterrupt

    io.os.write = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            io.write_bytes_atomic(target, b"x" * 1000)
    finally:
        io.os.write = real_write
    assert target.read_bytes() == SENTINEL
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_successful_run_replaces_the_file_whole(tmp_path):
    out = tmp_path / "r.json"
    out.write_bytes(SENTINEL)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"prefill_tokens": 40, "decode_tokens": 4, "group_size": 8,
                                  "residual_size": 16, "sink_tokens": 4}))
    result = runner.invoke(app, ["reproduce", "--config", str(config), "--seeds", "42", "--json", str(out)])
    assert result.exit_code in (0, 1), result.output
    assert json.loads(out.read_text())["seeds"] == [42]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "r.json"]


def _fail_on_replace(monkeypatch, io, call: int) -> list:
    """os.replace fails (disk full) on its call-th use; returns the list of renames tried."""
    real, tried = io.os.replace, []

    def replace(src, dst):
        tried.append(Path(dst).name)
        if len(tried) == call:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    return tried


@pytest.mark.parametrize("failing_rename", [None, 1, 2])
def test_an_engine_and_its_description_are_never_left_mismatched(tmp_path, monkeypatch, failing_rename):
    """build-engine's write (pnmix.io.write_described_atomic): whatever fails, a reader finds the old
    pair, the new pair, or a plan without a description (refused) - never a new plan beside the
    old description - and no temporary file."""
    from pnmix import io
    from pnmix.errors import PnMixError

    plan, sidecar = tmp_path / "e.plan", tmp_path / "e.plan.json"
    plan.write_bytes(b"old plan")
    sidecar.write_text('{"plan": "old"}')
    tried = _fail_on_replace(monkeypatch, io, failing_rename or 0)
    if failing_rename is None:
        io.write_described_atomic(plan, b"new plan", sidecar, {"plan": "new"})
    else:
        with pytest.raises(PnMixError, match="No space left"):
            io.write_described_atomic(plan, b"new plan", sidecar, {"plan": "new"})
    assert tried[:2] == ["e.plan", "e.plan.json"][:len(tried)]  # the plan first, its description last
    names = sorted(p.name for p in tmp_path.iterdir())
    if failing_rename is None:
        assert (plan.read_bytes(), json.loads(sidecar.read_text())) == (b"new plan", {"plan": "new"})
    elif failing_rename == 1:
        assert plan.read_bytes() == b"old plan" and names == ["e.plan"]
    else:
        assert plan.read_bytes() == b"new plan" and names == ["e.plan"]
    assert all(not name.endswith(".tmp") for name in names)


def test_an_engine_write_that_cannot_stage_keeps_the_old_pair(tmp_path):
    from pnmix import io
    from pnmix.errors import PnMixError

    plan, sidecar = tmp_path / "e.plan", tmp_path / "e.plan.json"
    plan.write_bytes(b"old plan")
    sidecar.write_text('{"plan": "old"}')

    class Unserializable:
        pass

    with pytest.raises(TypeError):  # the description fails before anything is renamed
        io.write_described_atomic(plan, b"new plan", sidecar, {"x": Unserializable()})
    with pytest.raises(PnMixError, match="directory"):
        io.write_described_atomic(tmp_path, b"new plan", sidecar, {"plan": "new"})
    assert plan.read_bytes() == b"old plan" and json.loads(sidecar.read_text()) == {"plan": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.plan", "e.plan.json"]


@pytest.mark.slow  # an export and a benchmark
def test_bench_onnx_runs_a_capacity_without_group_slots(tmp_path):
    """Capacity 100 < sink_tokens + residual_size (160): the state has no group slot, and the
    exported graph still runs (the ONNX Runtime-vs-reference checks are in test_hardening_onnx)."""
    module_ready("pnmix.bench.onnx", [], {})
    out = tmp_path / "b.json"
    result = runner.invoke(app, ["bench", "onnx", "--max-seq-len", "100", "--repeats", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["max_seq_len"] == 100 and report["context"] == 99
    assert report["packed_bytes_identical_after_step"] is True


@pytest.mark.parametrize("module, args, available, words", [
    ("pnmix.bench.decode", ["bench", "decode", "--context", "4096", "--repeats", "1", "--device", "cpu"], 10**6, ["--context", "available"]),
    ("pnmix.export.exporter", ["export", "-o", "OUT", "--max-seq-len", "100000"], 10**6, ["max_seq_len", "available"]),
    ("pnmix.bench.onnx", ["bench", "onnx", "--max-seq-len", "64", "--repeats", "1"], 10**5, ["--context", "available"]),
])
def test_sizes_beyond_the_memory_available_are_refused_before_allocating(tmp_path, monkeypatch, module, args,
                                                                          available, words):
    """The memory check compares the run's bytes with what the machine has (pnmix/memory.py); here the
    machine is made small, so modest sizes stand for the huge ones."""
    module_ready(module, args, {})
    from pnmix import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: available)
    out = tmp_path / "out.onnx"
    out.write_bytes(SENTINEL)
    assert_one_line_error(runner.invoke(app, [str(out) if a == "OUT" else a for a in args]), words)
    assert out.read_bytes() == SENTINEL
