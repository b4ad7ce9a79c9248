"""`pnmix build-engine` and `pnmix verify --engine` on a machine without TensorRT or a GPU, and the
ONNX rewrite TensorRT's parser gets (pnmix/backends/tensorrt/engine.py), which needs neither."""

from __future__ import annotations

import importlib.util
import json

import onnx
import pytest
from typer.testing import CliRunner

from pnmix.backends.tensorrt import engine as trt
from pnmix.cli import app
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.export import ops
from pnmix.export.exporter import build_model

runner = CliRunner()
HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def run_cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def one_line_error(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert lines[0].startswith("error:"), text
    return lines[0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trt")
    path = folder / "m.onnx"
    onnx.save(build_model(PnMixConfig(), max_seq_len=512), str(path))
    plugins = folder / "libpnmix_trt_plugins.so"
    plugins.write_bytes(b"\x7fELF not really")  # never loaded: the TensorRT check comes first
    return path, plugins


# ---- the ONNX file as TensorRT sees it -------------------------------------------------------------


def test_prepare_drops_our_functions_and_orders_the_append_after_the_attention(exported):
    model = onnx.load(str(exported[0]))
    prepared = trt.prepare_onnx(model)
    assert {f.name for f in model.functions} == {ops.ATTENTION_OP, ops.APPEND_OP}  # input untouched
    assert len(prepared.functions) == 0
    nodes = list(prepared.graph.node)
    attention = next(n for n in nodes if n.op_type == ops.ATTENTION_OP)
    append = next(n for n in nodes if n.op_type == ops.APPEND_OP)
    assert list(append.input) == list(next(n for n in model.graph.node if n.op_type == ops.APPEND_OP).input) + [
        attention.output[0]]
    assert nodes.index(append) > nodes.index(attention)
    assert len(append.input) == len(ops.APPEND_INPUTS) + 1
    # still a valid graph: every node reads only graph inputs, initializers or earlier outputs
    available = {i.name for i in prepared.graph.input} | {i.name for i in prepared.graph.initializer}
    for node in nodes:
        assert all(name in available or name == "" for name in node.input), node.op_type
        available |= set(node.output)
    onnx.checker.check_model(prepared)


def test_read_onnx_gives_config_capacity_batch_and_seed(exported):
    _, info = trt.read_onnx(exported[0])
    assert (info.config, info.max_seq_len, info.batch, info.seed) == (PnMixConfig(), 512, 1, 42)


def test_read_onnx_refuses_a_foreign_model(tmp_path):
    path = tmp_path / "foreign.onnx"
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [])), str(path))
    with pytest.raises(PnMixError, match="not a pnmix export"):
        trt.read_onnx(path)


def test_profiles_cover_decode_and_prefill():
    decode, prefill = trt.profile_shapes(4096, 2, None)
    assert decode["tokens"] == ((2, 1), (2, 1), (2, 1))
    assert prefill["tokens"] == ((2, 1), (2, 2048), (2, 4096))
    assert trt.profile_shapes(4096, 1, 384)[1]["tokens"][2] == (1, 384)
    with pytest.raises(PnMixError, match="exceeds the model's cache capacity 4096"):
        trt.profile_shapes(4096, 1, 5000)
    with pytest.raises(PnMixError, match="positive"):
        trt.profile_shapes(4096, 1, 0)


# ---- build-engine: one-line errors, exit 2 ------------------------------------------------------------


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed here; this checks the message without it")
def test_build_engine_without_tensorrt_says_so(exported, tmp_path):
    model, plugins = exported
    code, text = run_cli("build-engine", model, "--plugins", plugins, "-o", tmp_path / "m.plan")
    assert code == 2
    line = one_line_error(text)
    assert "TensorRT is not installed" in line
    assert not (tmp_path / "m.plan").exists()


def test_build_engine_bad_options(exported, tmp_path):
    model, plugins = exported
    code, text = run_cli("build-engine", model, "--plugins", plugins, "-o", tmp_path / "m.plan", "--max-seq-len", "600")
    assert code == 2
    assert "capacity 512" in one_line_error(text)


@pytest.mark.parametrize("flag", ["--fp16", "--bf16"])
def test_build_engine_has_no_precision_flags(exported, tmp_path, flag):
    """The engine is strongly typed (the file's fp16/INT8/fp32): a precision flag could only lie."""
    model, plugins = exported
    code, text = run_cli("build-engine", model, "--plugins", plugins, "-o", tmp_path / "m.plan", flag)
    assert code == 2 and "No such option" in text and not (tmp_path / "m.plan").exists()


def test_build_engine_missing_files(exported, tmp_path):
    model, plugins = exported
    code, text = run_cli("build-engine", tmp_path / "nope.onnx", "--plugins", plugins, "-o", tmp_path / "m.plan")
    assert code == 2 and "ONNX model file not found" in one_line_error(text)
    code, text = run_cli("build-engine", model, "--plugins", tmp_path / "nope.so", "-o", tmp_path / "m.plan")
    assert code == 2 and "plugin library not found" in one_line_error(text)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01 not a protobuf \xff" * 10)
    code, text = run_cli("build-engine", garbage, "--plugins", plugins, "-o", tmp_path / "m.plan")
    assert code == 2 and "ONNX" in one_line_error(text)


# ---- verify --engine ------------------------------------------------------------------------------------


def _fake_plan(tmp_path, config: PnMixConfig):
    plan = tmp_path / "m.plan"
    plan.write_bytes(b"not an engine")
    trt.sidecar_path(plan).write_text(json.dumps({
        "format": "pnmix-engine-1", "config": config.to_dict(), "capacity": 512, "batch": 1, "seed": 42,
        "profiles": {"decode": 0, "prefill": 1, "max_prefill": 512}}))
    return plan


def test_verify_engine_errors(exported, tmp_path):
    _, plugins = exported
    code, text = run_cli("verify", "--engine", tmp_path / "missing.plan", "--plugins", plugins, "--seeds", "42")
    assert code == 2 and "engine not found" in one_line_error(text)
    plan = _fake_plan(tmp_path, PnMixConfig(pair_layout="half"))
    code, text = run_cli("verify", "--engine", plan, "--plugins", plugins, "--seeds", "42")
    assert code == 2 and "built for config" in one_line_error(text)
    plan = _fake_plan(tmp_path, PnMixConfig())
    code, text = run_cli("verify", "--engine", plan, "--seeds", "42")
    assert code == 2 and "--plugins" in one_line_error(text)


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed here; this checks the message without it")
def test_verify_engine_without_tensorrt_says_so(exported, tmp_path):
    _, plugins = exported
    plan = _fake_plan(tmp_path, PnMixConfig())
    code, text = run_cli("verify", "--engine", plan, "--plugins", plugins, "--seeds", "42")
    assert code == 2 and "TensorRT is not installed" in one_line_error(text)
