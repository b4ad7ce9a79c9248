"""The ONNX export: one file, checker-clean, run by ONNX Runtime with no custom-op library,
packed bytes identical to the PyTorch reference (docs/METHOD.md section 3), attention within 2e-3."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, inliner, shape_inference
from pnmix.export import ops
from pnmix.export.exporter import export_onnx
from pnmix.export.modelfile import load_checked
from typer.testing import CliRunner

from pnmix.cli import app
from pnmix.config import CONFIG_FIELDS, PnMixConfig, RunConfig
from pnmix.manifest import load_manifest
from pnmix.testing import OTHER_CONFIG
from pnmix.verify import verify

CAPACITY = 512  # small capacity keeps the tests fast; the protocol needs 448


@pytest.fixture(scope="module")
def exported(diagnostic_file):
    return {"manifest": diagnostic_file(CAPACITY), "other": diagnostic_file(CAPACITY, PnMixConfig(**OTHER_CONFIG))}


def empty_feeds(layout):
    """An empty cache as the file's state inputs (codes and mask INT8)."""
    from pnmix.export.torch_ops import empty_graph_state

    from pnmix.format import STATE_NAMES

    return {name: t.numpy() for name, t in zip(STATE_NAMES, empty_graph_state(layout))}


def all_nodes(nodes):
    """Nodes with the nodes of their subgraphs (If branches), depth first."""
    for node in nodes:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g.node)


def all_value_types(graph):
    """Element type of every typed value of a graph and its subgraphs."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                types.update(all_value_types(attr.g))
    return types


def test_file_passes_full_check_and_strict_shape_inference(exported):
    model = onnx.load(exported["manifest"])
    onnx.checker.check_model(model, full_check=True)
    shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    names = [v.name for v in model.graph.input]
    assert names[:3] == ["tokens", "seq_len", "new_len"]
    codes = next(v for v in model.graph.input if v.name == "key_codes")
    assert codes.type.tensor_type.elem_type == TensorProto.INT8  # not UINT8: TensorRT has no uint8 I/O


def test_nodes_carry_every_config_field_and_plugin_fields(exported):
    model = onnx.load(exported["other"])
    custom = [n for n in model.graph.node if n.domain == ops.DOMAIN]
    assert sorted(n.op_type for n in custom) == sorted([ops.ATTENTION_OP, ops.APPEND_OP])
    for node in custom:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert set(attrs) == set(CONFIG_FIELDS) | {"plugin_version", "plugin_namespace"}
        assert attrs["plugin_version"] == b"1" and attrs["plugin_namespace"] == b""
        assert ops.config_from_attributes(node) == PnMixConfig(**OTHER_CONFIG)


def test_function_bodies_unpack_with_plain_arithmetic_and_standard_ops_only(exported):
    model = onnx.load(exported["manifest"])
    for function in model.functions:
        used = {n.op_type for n in all_nodes(function.node)}
        assert all(n.domain in ("", "ai.onnx") for n in all_nodes(function.node))
        assert not used & {"BitShift", "BitwiseAnd", "BitwiseOr", "TopK", "CumSum"}
        assert {"Div", "Sub", "Cast"} <= used
        if function.name == ops.ATTENTION_OP:  # key codes as floor(word / 2^s) mod 2^w in fp32
            assert "Floor" in used


def test_append_runs_the_quantizer_and_the_saliency_mask_only_under_if(exported):
    # A decode step completes a group once in group_size calls and the mask is computed once per
    # sequence: that work sits in If branches, so ONNX Runtime skips it on the other calls.
    model = onnx.load(exported["manifest"])
    append = next(f for f in model.functions if f.name == ops.APPEND_OP)
    top = {n.op_type for n in append.node}
    branches = {n.op_type for n in all_nodes(append.node)} - top
    assert "If" in top
    assert {"ScatterElements", "Round", "ReduceMin", "ReduceSum"} <= branches
    assert not top & {"ScatterElements", "Round", "ReduceMin", "ReduceMax"}


def test_fp16_tensors_only_feed_data_movement(exported):
    # ONNX Runtime has no fp16 kernels for arithmetic or Where on CPU; around such a node it
    # inserts fp32 casts and then removes the fp16 rounding of a step or offset as a redundant
    # cast pair, which changes codes. Every rounding to fp16 must therefore be a plain Cast.
    model = shape_inference.infer_shapes(inliner.inline_local_functions(onnx.load(exported["manifest"])))
    graph = model.graph
    types = all_value_types(graph)
    fed = {n.op_type for n in all_nodes(graph.node) for i in n.input if types.get(i) == TensorProto.FLOAT16}
    assert fed <= {"Cast", "Concat", "Gather", "Reshape", "Slice", "Squeeze", "Shape", "Identity", "Transpose"}


def test_generated_op_table_is_current():
    assert json.loads(ops.TABLE_JSON.read_text()) == ops.op_table()


def test_cli_export_then_verify_passes(tmp_path):
    model, report = tmp_path / "m.onnx", tmp_path / "r.json"
    runner = CliRunner()
    result = runner.invoke(app, ["export", "-o", str(model), "--max-seq-len", str(CAPACITY)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["verify", "--onnx", str(model), "--seeds", "42", "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["backend"] == "onnx" and data["passed"] and data["manifest"]["passed"]
    run = data["runs"][0]
    assert run["packed_bytes_identical"]
    assert run["max_abs_diff_online"] <= 2e-3 and run["max_abs_diff_final"] <= 2e-3
    assert run["metrics"]["actual_attention_calls"] == 66
    assert run["metrics"]["persistent_cache_bytes"] == 32516


@pytest.mark.parametrize("prefill, decode", [(384, 64), (5, 150)])
def test_other_config_matches_reference_bytes(exported, prefill, decode):
    # Seed 43 is not the file's seed: its weights come in through add_initializer. Prefill 5
    # fills the sink across decode steps and flushes groups during decode.
    run = RunConfig(PnMixConfig(**OTHER_CONFIG), prefill_tokens=prefill, decode_tokens=decode)
    report = verify("onnx", run, load_manifest(), [43], model=exported["other"])
    record = report["runs"][0]
    assert record["packed_bytes_identical"], record
    assert record["max_abs_diff_online"] <= 2e-3 and record["max_abs_diff_final"] <= 2e-3


def test_evaluation_mode_leaves_the_state_unchanged(exported):
    from pnmix.backends.onnxruntime.backend import OnnxBackend
    from pnmix.dataset import protocol_tokens

    backend = OnnxBackend(PnMixConfig(), 42, 300, model=exported["manifest"])
    tokens = protocol_tokens(300)
    backend.step(tokens, 0, write=True)
    _, before, _ = backend.state()
    out = backend.step(tokens[:, -7:], 300, write=False)
    _, after, seq_len = backend.state()
    assert seq_len == 300 and out.shape == (1, 4, 7, 32)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert np.isfinite(out.numpy()).all()


def test_batch_of_two_and_chunked_appends_match_the_reference_cache(tmp_path):
    # Two sequences in one state, a prefill then decode steps and multi-token chunks that
    # flush several groups at once, straight through ONNX Runtime.
    import onnxruntime as ort

    from pnmix.cache import PackedKVCache
    from pnmix.dump import dump_state
    from pnmix.format import STATE_NAMES
    from pnmix.model import DiagnosticModel

    config = PnMixConfig(group_size=16, residual_size=24, sink_tokens=4)
    path = export_onnx(tmp_path / "b2.onnx", config, max_seq_len=200, batch=2).path
    _, info = load_checked(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    tokens = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(1))
    model, cache = DiagnosticModel(42), PackedKVCache(config, 2, 32, 200, batch=2)
    state = empty_feeds(info.layout)
    seq_len = 0
    for n in (37, 1, 1, 50, 1, 60):
        chunk = tokens[:, seq_len:seq_len + n]
        feeds = {"tokens": chunk.numpy(), "seq_len": np.array(seq_len), "new_len": np.array(n), **state}
        out = dict(zip(names, session.run(None, feeds)))
        qkv = model.qkv(chunk, seq_len)
        expected = cache.attend(qkv.q, qkv.k, qkv.v)
        cache.append(qkv.k, qkv.v)
        assert np.abs(out["attention"] - expected.numpy()).max() <= 2e-3
        state = {name: out[f"present_{name}"] for name in STATE_NAMES}
        seq_len += n
    mine = {name: torch.from_numpy(a).view(cache.state[name].dtype) for name, a in state.items()}
    assert dump_state(info.layout, mine, seq_len) == dump_state(cache.layout, cache.state, seq_len)


def test_the_file_is_traced_from_the_reference_projection(tmp_path, monkeypatch):
    # One exporter: the diagnostic file's q/k/v are pnmix.model.project as traced, not a graph
    # written beside it. Patch the reference's RoPE away and the file's K follows the patch.
    import onnxruntime as ort

    from pnmix import model as reference_model

    config = PnMixConfig(group_size=16, residual_size=24, sink_tokens=4)
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))

    def sink_k(path):
        _, info = load_checked(path)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        state = empty_feeds(info.layout)
        out = session.run(["present_sink_k"], {"tokens": tokens.numpy(), "seq_len": np.array(0),
                                               "new_len": np.array(9), **state})[0]
        return torch.from_numpy(out[:, :, :4])

    expected = reference_model.DiagnosticModel(42).qkv(tokens, 0).k[:, :, :4]
    assert torch.equal(sink_k(export_onnx(tmp_path / "a.onnx", config, max_seq_len=64).path), expected)
    monkeypatch.setattr(reference_model, "apply_rope", lambda x, cos, sin, layout: x)
    unrotated = reference_model.DiagnosticModel(42).qkv(tokens, 0).k[:, :, :4]
    assert not torch.equal(unrotated, expected)
    assert torch.equal(sink_k(export_onnx(tmp_path / "b.onnx", config, max_seq_len=64).path), unrotated)
