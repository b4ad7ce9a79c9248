"""Bad ONNX files and bad feeds: one-line PnMixError, exit 2 from the CLI."""

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from pnmix.export.exporter import build_model
from pnmix.export.modelfile import load_checked
from typer.testing import CliRunner

from pnmix.backends.onnxruntime.backend import OnnxBackend
from pnmix.cli import app
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError

CAPACITY = 300


@pytest.fixture(scope="module")
def model_file(diagnostic_file):
    return diagnostic_file(CAPACITY)


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(PnMixError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_cli_exits_2_with_one_line_on_garbage(tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    result = CliRunner().invoke(app, ["verify", "--onnx", str(garbage), "--seeds", "42"])
    assert result.exit_code == 2
    assert "not an ONNX model" in result.output


@pytest.mark.parametrize("keep", [0.01, 0.3, 0.6, 0.95, 0.9999])
def test_truncated_file_is_refused(model_file, tmp_path, keep):
    data = model_file.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: int(len(data) * keep)])
    one_line_error(load_checked, cut)


@pytest.mark.parametrize("content", [b"", b'{"not": "onnx"}\n', b"\x00" * 64])
def test_files_that_are_not_onnx_are_refused(tmp_path, content):
    path = tmp_path / "x.onnx"
    path.write_bytes(content)
    one_line_error(load_checked, path)


def test_missing_file_and_directory(tmp_path):
    assert "not found" in one_line_error(load_checked, tmp_path / "absent.onnx")
    assert "not a file" in one_line_error(load_checked, tmp_path)


def _with_external_table(folder, location):
    """The exported model with its v_table moved to external data at ``location``."""
    model = build_model(PnMixConfig(), max_seq_len=CAPACITY)
    table = next(t for t in model.graph.initializer if t.name == "v_table")
    array = numpy_helper.to_array(table)
    (folder / "weights.bin").write_bytes(array.tobytes())
    table.ClearField("raw_data")
    table.ClearField("float_data")
    table.data_location = onnx.TensorProto.EXTERNAL
    del table.external_data[:]
    for key, value in (("location", location), ("offset", "0"), ("length", str(array.nbytes))):
        entry = table.external_data.add()
        entry.key, entry.value = key, value
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("location", ["../weights.bin", "/etc/passwd", "sub/../../weights.bin"])
def test_external_data_outside_the_model_folder_is_refused(tmp_path, location):
    folder = tmp_path / "model"
    folder.mkdir()
    message = one_line_error(load_checked, _with_external_table(folder, location))
    assert "external data" in message


def test_external_data_inside_the_folder_loads(tmp_path):
    model, info = load_checked(_with_external_table(tmp_path, "weights.bin"))
    assert info.max_seq_len == CAPACITY


def test_file_for_another_config_names_the_field(model_file):
    other = PnMixConfig(pair_layout="half")
    message = one_line_error(OnnxBackend, other, 42, 200, model=model_file)
    assert "pair_layout" in message


def test_capacity_too_small_for_the_protocol(model_file):
    message = one_line_error(OnnxBackend, PnMixConfig(), 42, CAPACITY + 1, model=model_file)
    assert "capacity" in message


def test_step_past_capacity_is_refused(model_file):
    backend = OnnxBackend(PnMixConfig(), 42, CAPACITY, model=model_file)
    tokens = torch.zeros(1, CAPACITY, dtype=torch.int64)
    backend.step(tokens, 0, write=True)
    assert "capacity exceeded" in one_line_error(backend.step, tokens[:, :1], CAPACITY, True)


def test_wrong_input_shapes_are_refused(model_file):
    backend = OnnxBackend(PnMixConfig(), 42, CAPACITY, model=model_file)
    one_line_error(backend.step, torch.zeros(2, 4, dtype=torch.int64), 0, True)  # batch 2
    one_line_error(backend.step, torch.zeros(4, dtype=torch.int64), 0, True)  # 1-D
    one_line_error(backend.step, torch.full((1, 4), 300), 0, True)  # not a byte
    _, state, _ = backend.state()
    state = {name: t.numpy() for name, t in state.items()}
    state["key_codes"] = state["key_codes"][:, :, :1]
    assert "key_codes" in one_line_error(backend.run, np.zeros((1, 3)), 0, 3, state)
    bad = {name: torch.zeros(2, 2) for name in state}
    one_line_error(backend.load_state, bad, 0)


def test_graph_without_the_pnmix_interface_is_refused(model_file, tmp_path):
    model = onnx.load(model_file)
    model.graph.input[0].name = "input_ids"
    for node in model.graph.node:
        node.input[:] = ["input_ids" if i == "tokens" else i for i in node.input]
    path = tmp_path / "renamed.onnx"
    path.write_bytes(model.SerializeToString())
    assert "not a pnmix export" in one_line_error(load_checked, path)


def test_export_refuses_bad_arguments(tmp_path):
    result = CliRunner().invoke(app, ["export", "-o", str(tmp_path / "m.onnx"), "--opset", "11"])
    assert result.exit_code == 2 and "--opset" in result.output
    result = CliRunner().invoke(app, ["export", "-o", str(tmp_path / "no" / "m.onnx")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_cli_verify_refuses_a_file_too_small_for_the_protocol(model_file):
    result = CliRunner().invoke(app, ["verify", "--onnx", str(model_file), "--seeds", "42"])
    assert result.exit_code == 2
    assert "capacity exceeded" in result.output and "448" in result.output
