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

import onnx

from pnmix.backends.tensorrt import engine as trt
from pnmix.export import exporter, modelfile

CONFIG = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4)
SLOW = pytest.mark.slow
CASES = {"corrupted exports": 0}


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


def test_external_data_inside_the_folder_loads(small_onnx_bytes, layout):
    folder, _ = layout
    path = with_external_weights(small_onnx_bytes, folder, "weights/table.bin", folder / "weights" / "table.bin")
    _, info = modelfile.load_checked(path)
    assert info.config == CONFIG


@pytest.mark.parametrize("location", [
    "../secret.bin", "weights/../../secret.bin", "..\\secret.bin", "weights\\..\\..\\secret.bin", "ABSOLUTE", "",
])
def test_external_data_escaping_the_folder_is_refused(small_onnx_bytes, layout, location):
    folder, secret = layout
    if location == "ABSOLUTE":
        location = str(secret)
    path = with_external_weights(small_onnx_bytes, folder, location, secret)
    with pytest.raises(PnMixError, match="external data") as info:
        modelfile.load_checked(path)
    assert "\n" not in str(info.value)


def test_external_data_through_a_symlink_out_of_the_folder_is_refused(small_onnx_bytes, layout):
    folder, secret = layout
    path = with_external_weights(small_onnx_bytes, folder, "link.bin", secret)
    os.symlink(secret, folder / "link.bin")
    with pytest.raises(PnMixError, match="outside the model's folder"):
        modelfile.load_checked(path)


def test_missing_external_data_is_named(small_onnx_bytes, layout):
    folder, _ = layout
    path = with_external_weights(small_onnx_bytes, folder, "weights.bin", None)
    with pytest.raises(PnMixError, match="external data file not found"):
        modelfile.load_checked(path)


def _cli(*args):
    from typer.testing import CliRunner

    from pnmix.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    return result.exit_code, lines


def test_every_command_that_reads_onnx_refuses_escaping_external_data(small_onnx_bytes, layout, tmp_path):
    folder, secret = layout
    path = with_external_weights(small_onnx_bytes, folder, "../secret.bin", secret)
    config = tmp_path / "c.json"
    config.write_text('{"group_size": 8, "residual_size": 16, "sink_tokens": 4, "prefill_tokens": 40, "decode_tokens": 4}')
    commands = [["verify", "--onnx", path, "--config", config, "--seeds", "42"],
                ["bench", "onnx", "--model", path, "--repeats", "1"]]
    for args in commands:
        code, lines = _cli(*args)
        assert code == 2 and len(lines) == 1 and "external data" in lines[0], (args, lines)


def test_build_engine_refuses_escaping_external_data_before_tensorrt(small_onnx_bytes, layout, tmp_path):
    folder, secret = layout
    path = with_external_weights(small_onnx_bytes, folder, "../secret.bin", secret)
    plugins = tmp_path / "libpnmix_trt_plugins.so"
    plugins.write_bytes(b"\x7fELF")
    code, lines = _cli("build-engine", path, "--plugins", plugins, "-o", tmp_path / "e.plan")
    assert code == 2 and len(lines) == 1 and "external data" in lines[0], lines


# ---------------------------------------------------------------------------------------
# Truncated and corrupted exports
# ---------------------------------------------------------------------------------------


def test_truncated_exports_are_refused(small_onnx_bytes, tmp_path):
    path = tmp_path / "cut.onnx"
    for fraction in (0.0001, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.9999):
        path.write_bytes(small_onnx_bytes[: int(len(small_onnx_bytes) * fraction)])
        with pytest.raises(PnMixError) as info:
            modelfile.load_checked(path)
        assert "\n" not in str(info.value), fraction


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_exports_load_or_fail_with_one_pnmix_error(small_onnx_bytes, tmp_path_factory, data):
    CASES["corrupted exports"] += 1
    blob = bytearray(small_onnx_bytes)
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
    plan = tmp_path / "e.plan"
    plan.write_bytes(b"junk")
    with pytest.raises(PnMixError, match="engine description not found"):
        trt.read_sidecar(plan)
    for content in ("{", "[]", '{"format": "other"}', "\udcff"):
        (tmp_path / "e.plan.json").write_text(content, errors="surrogateescape")
        with pytest.raises(PnMixError):
            trt.read_sidecar(plan)


@pytest.mark.parametrize("change, words", [
    ({"config": None}, "'config' is missing"),
    ({"config": {"group_size": "eight"}}, "group_size"),
    ({"config": {"group_size": 8}}, "lacks"),
    ({"config": [1, 2]}, "JSON object"),
    ({"capacity": None}, "'capacity' is missing"),
    ({"capacity": 0}, "'capacity'"),
    ({"capacity": "448"}, "'capacity'"),
    ({"capacity": 1 << 50}, "max_seq_len"),
    ({"batch": -1}, "'batch'"),
    ({"batch": True}, "'batch'"),
    ({"seed": 1.5}, "'seed'"),
    ({"seed": 1 << 70}, "'seed'"),
    ({"profiles": None}, "'profiles' is missing"),
    ({"profiles": {"decode": 0, "prefill": 1}}, "'profiles'"),
    ({"profiles": {"decode": 1, "prefill": 0, "max_prefill": 384}}, "profiles.decode"),
    ({"profiles": {"decode": 0, "prefill": 1, "max_prefill": 449}}, "profiles.max_prefill"),
    ({"profiles": {"decode": 0, "prefill": 1, "max_prefill": 0}}, "profiles.max_prefill"),
    ({"precision": 16}, "'precision'"),
    ({"refittable": "yes"}, "'refittable'"),
    ({"capacitty": 448}, "unknown field 'capacitty'"),
])
def test_every_engine_sidecar_field_is_checked(tmp_path, change, words):
    import json

    good = {"format": "pnmix-engine-1", "config": PnMixConfig().to_dict(), "capacity": 448, "batch": 1,
            "seed": 42, "precision": "fp32", "refittable": True,
            "profiles": {"decode": 0, "prefill": 1, "max_prefill": 384}}
    plan = tmp_path / "e.plan"
    plan.write_bytes(b"junk")
    trt.sidecar_path(plan).write_text(json.dumps(good))
    assert trt.read_sidecar(plan) == good
    bad = dict(good)
    for key, value in change.items():
        if value is None:
            del bad[key]
        else:
            bad[key] = value
    trt.sidecar_path(plan).write_text(json.dumps(bad))
    with pytest.raises(PnMixError) as info:
        trt.read_sidecar(plan)
    assert "\n" not in str(info.value) and words in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------
# Capacities with no group slot (capacity < sink_tokens + residual_size): the graph's group
# path is empty, and ONNX Runtime must still run prefill, decode and evaluation like the reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, capacity, prefill", [
    (CONFIG, 3, 2),                 # inside the sink
    # the rest export larger models: seconds each
    pytest.param(CONFIG, 12, 7, marks=SLOW),    # sink and part of the residual
    pytest.param(CONFIG, 19, 10, marks=SLOW),   # one token short of the first group
    pytest.param(CONFIG, 20, 10, marks=SLOW),   # exactly one group slot, flushed by the last decode
    pytest.param(PnMixConfig(group_size=8, residual_size=8, sink_tokens=0, value_bits=3, key_low_bits=3), 7, 4,
                 marks=SLOW),
    pytest.param(PnMixConfig(), 100, 90, marks=SLOW),  # the manifest's config: bench onnx --max-seq-len 100
])
def test_small_capacities_run_in_onnxruntime_like_the_reference(tmp_path, config, capacity, prefill):
    import torch

    from pnmix.backends.base import OpsBackend
    from pnmix.backends.onnxruntime.backend import OnnxBackend
    from pnmix.backends.torch_ops import TorchOps
    from pnmix.dataset import protocol_tokens
    from pnmix.dump import dump_state
    from pnmix.format import CacheLayout
    from pnmix.model import HEAD_DIM, KV_HEADS

    groups = CacheLayout(config, 1, KV_HEADS, HEAD_DIM, capacity).max_groups
    assert groups == (1 if capacity == config.sink_tokens + config.residual_size else 0)
    path = exporter.export_onnx(tmp_path / "small.onnx", config, max_seq_len=capacity, seed=42).path
    onnx_backend = OnnxBackend(config, 42, capacity, model=path)
    reference = OpsBackend(TorchOps(), config, 42, capacity)
    tokens = protocol_tokens(capacity)
    steps = [(0, prefill)] + [(at, 1) for at in range(prefill, capacity)]  # prefill, then decode to the full capacity
    for at, n in steps:
        got = onnx_backend.step(tokens[:, at:at + n], at, write=True)
        want = reference.step(tokens[:, at:at + n], at, write=True)
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 2e-3, (at, n)
    evaluated = min(capacity, 4)  # evaluation: the last tokens again, read-only
    got = onnx_backend.step(tokens[:, capacity - evaluated:], capacity, write=False)
    want = reference.step(tokens[:, capacity - evaluated:], capacity, write=False)
    assert (got - want).abs().max().item() <= 2e-3
    layout, state, seq_len = onnx_backend.state()
    assert seq_len == capacity
    assert dump_state(layout, state, capacity) == dump_state(*reference.state())
