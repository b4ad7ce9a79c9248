"""Model files from elsewhere: ONNX loading refuses external-data locations that escape the
model's folder and files that are not (whole) ONNX models; TensorRT engine and plugin paths are
checked before TensorRT sees them. Every refusal is one PnMixError line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError

onnx = pytest.importorskip("onnx")
exporter = pytest.importorskip("pnmix.export.exporter", reason="the ONNX exporter is not built yet")
modelfile = pytest.importorskip("pnmix.export.modelfile", reason="the ONNX model reader is not built yet")

CONFIG = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4)
CASES = {"corrupted exports": 0}


@pytest.fixture(scope="module")
def export_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("export") / "m.onnx"
    exporter.export_onnx(path, CONFIG, max_seq_len=64, batch=1, seed=42)
    return path.read_bytes()


def with_external_weights(data: bytes, folder: Path, location: str, write_to: Path | None) -> Path:
    """The export with its largest initializer moved to external data at `location`; the bytes
    are written to `write_to` (None: nowhere). Returns the model's path inside `folder`."""
    from onnx import external_data_helper

    model = onnx.ModelProto()
    model.ParseFromString(data)
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    raw = tensor.raw_data
    if write_to is not None:
        write_to.parent.mkdir(parents=True, exist_ok=True)
        write_to.write_bytes(raw)
    external_data_helper.set_external_data(tensor, location=location, offset=0, length=len(raw))
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture
def layout(tmp_path):
    """tmp/models/ holds the model; tmp/secret.bin is outside it."""
    return tmp_path / "models", tmp_path / "secret.bin"


def test_external_data_inside_the_folder_loads(export_bytes, layout):
    folder, _ = layout
    path = with_external_weights(export_bytes, folder, "weights/table.bin", folder / "weights" / "table.bin")
    _, info = modelfile.load_checked(path)
    assert info.config == CONFIG


@pytest.mark.parametrize("location", [
    "../secret.bin", "weights/../../secret.bin", "..\\secret.bin", "weights\\..\\..\\secret.bin", "ABSOLUTE", "",
])
def test_external_data_escaping_the_folder_is_refused(export_bytes, layout, location):
    folder, secret = layout
    if location == "ABSOLUTE":
        location = str(secret)
    path = with_external_weights(export_bytes, folder, location, secret)
    with pytest.raises(PnMixError, match="external data") as info:
        modelfile.load_checked(path)
    assert "\n" not in str(info.value)


def test_external_data_through_a_symlink_out_of_the_folder_is_refused(export_bytes, layout):
    folder, secret = layout
    path = with_external_weights(export_bytes, folder, "link.bin", secret)
    os.symlink(secret, folder / "link.bin")
    with pytest.raises(PnMixError, match="outside the model's folder"):
        modelfile.load_checked(path)


def test_missing_external_data_is_named(export_bytes, layout):
    folder, _ = layout
    path = with_external_weights(export_bytes, folder, "weights.bin", None)
    with pytest.raises(PnMixError, match="external data file not found"):
        modelfile.load_checked(path)


def _cli(*args):
    from typer.testing import CliRunner

    from pnmix.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    return result.exit_code, lines


def test_every_command_that_reads_onnx_refuses_escaping_external_data(export_bytes, layout, tmp_path):
    folder, secret = layout
    path = with_external_weights(export_bytes, folder, "../secret.bin", secret)
    config = tmp_path / "c.json"
    config.write_text('{"group_size": 8, "residual_size": 16, "sink_tokens": 4, "prefill_tokens": 40, "decode_tokens": 4}')
    commands = [["verify", "--onnx", path, "--config", config, "--seeds", "42"],
                ["bench", "onnx", "--model", path, "--repeats", "1"]]
    for args in commands:
        code, lines = _cli(*args)
        assert code == 2 and len(lines) == 1 and "external data" in lines[0], (args, lines)


def test_build_engine_refuses_escaping_external_data_before_tensorrt(export_bytes, layout, tmp_path):
    pytest.importorskip("pnmix.trt", reason="pnmix.trt is not built yet")
    folder, secret = layout
    path = with_external_weights(export_bytes, folder, "../secret.bin", secret)
    plugins = tmp_path / "libpnmix_trt_plugins.so"
    plugins.write_bytes(b"\x7fELF")
    code, lines = _cli("build-engine", path, "--plugins", plugins, "-o", tmp_path / "e.plan")
    if code == 2 and lines and "external data" not in lines[0]:
        pytest.xfail("reported: build-engine reads the model with onnx.load_model(load_external_data=False) and "
                     "never checks external-data locations (TensorRT's parser would follow them); "
                     f"it said: {lines[0]}")
    assert code == 2 and len(lines) == 1 and "external data" in lines[0], lines


# ---------------------------------------------------------------------------------------
# Truncated and corrupted exports
# ---------------------------------------------------------------------------------------


def test_truncated_exports_are_refused(export_bytes, tmp_path):
    path = tmp_path / "cut.onnx"
    for fraction in (0.0001, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.9999):
        path.write_bytes(export_bytes[: int(len(export_bytes) * fraction)])
        with pytest.raises(PnMixError) as info:
            modelfile.load_checked(path)
        assert "\n" not in str(info.value), fraction


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_exports_load_or_fail_with_one_pnmix_error(export_bytes, tmp_path_factory, data):
    CASES["corrupted exports"] += 1
    blob = bytearray(export_bytes)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("corrupt") / "m.onnx"
    path.write_bytes(bytes(blob))
    try:
        modelfile.load_checked(path)
    except PnMixError as exc:
        assert "\n" not in str(exc)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# TensorRT paths: checked before TensorRT is imported
# ---------------------------------------------------------------------------------------


def test_plugin_paths_are_checked_before_tensorrt(tmp_path):
    trt = pytest.importorskip("pnmix.trt", reason="pnmix.trt is not built yet")
    with pytest.raises(PnMixError, match="--plugins"):
        trt.check_plugin_path(None)
    with pytest.raises(PnMixError, match="plugin library not found"):
        trt.check_plugin_path(tmp_path / "missing.so")
    with pytest.raises(PnMixError, match="directory"):
        trt.check_plugin_path(tmp_path)
    library = tmp_path / "libpnmix_trt_plugins.so"
    library.write_bytes(b"\x7fELF")
    assert trt.check_plugin_path(library) == library


def test_engine_sidecar_problems_are_one_line(tmp_path):
    trt = pytest.importorskip("pnmix.trt", reason="pnmix.trt is not built yet")
    plan = tmp_path / "e.plan"
    plan.write_bytes(b"junk")
    with pytest.raises(PnMixError, match="engine description not found"):
        trt.read_sidecar(plan)
    for content in ("{", "[]", '{"format": "other"}', "\udcff"):
        (tmp_path / "e.plan.json").write_text(content, errors="surrogateescape")
        with pytest.raises(PnMixError):
            trt.read_sidecar(plan)
