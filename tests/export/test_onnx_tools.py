"""`pnmix bench onnx` and the TensorRT-EP helper (whose TensorRT part runs only where TensorRT is)."""

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from pnmix.export.modelfile import load_checked

from pnmix.backends.tensorrt import ort_ep as trt_ep
from pnmix.bench.onnx import bench_command
from pnmix.errors import PnMixError


@pytest.fixture(scope="module")
def model_file(diagnostic_file):
    return diagnostic_file(260)


def test_bench_reports_times_size_and_identical_bytes(tmp_path):
    report_path = tmp_path / "bench.json"
    assert bench_command(max_seq_len=260, context=None, repeats=2, model=None, json_path=report_path) == 0
    report = json.loads(report_path.read_text())
    assert report["context"] == 259 and report["max_seq_len"] == 260
    assert report["export_seconds"] > 0 and report["file_bytes"] > 100_000
    assert report["onnxruntime_ms_per_decode_step"] > 0 and report["torch_reference_ms_per_decode_step"] > 0
    assert report["packed_bytes_identical_after_step"] is True


def test_llm_bench_times_the_native_ops_with_each_arithmetic(tiny, monkeypatch):
    """auto: the native ops, the native ops on the core's integer arithmetic (where the core has
    it) and the function bodies; the int8 row sets PNMIX_ATTEND_ARITH for its session only."""
    from pnmix.backends.onnxruntime.session import resolve_ops
    from pnmix.bench import onnx_llm

    monkeypatch.setenv("PNMIX_ATTEND_ARITH", "fp32")
    rows = onnx_llm.bench_ops("auto")
    if resolve_ops("auto") != "native":
        pytest.skip("libpnmix_ort does not load here")
    assert rows == (["native", "native_int8", "functions"] if onnx_llm.core_has_int8() else ["native", "functions"])
    assert onnx_llm.bench_ops("functions") == ["functions"]
    seen = []
    real = onnx_llm.LlmSession

    def spy(path, threads, ops):
        seen.append((ops, os.environ.get("PNMIX_ATTEND_ARITH")))
        return real(path, threads, ops=ops)

    monkeypatch.setattr(onnx_llm, "LlmSession", spy)
    for name in ("native", "native_int8"):
        timing = onnx_llm.time_pnmix(tiny["onnx"], list(range(3, 43)), 2, None, name)
        assert timing["decode_tokens_per_s"] > 0 and timing["kv_bytes"] > 0
    assert seen == [("native", "fp32"), ("native", "int8")]
    assert os.environ["PNMIX_ATTEND_ARITH"] == "fp32"


def test_bench_refuses_a_context_beyond_capacity(model_file):
    with pytest.raises(PnMixError, match="--context"):
        bench_command(max_seq_len=260, context=260, repeats=1, model=model_file, json_path=None)


def test_trt_rewrite_moves_nodes_and_keeps_a_runnable_fallback(model_file, tmp_path):
    target = trt_ep.rewrite_file(model_file, tmp_path / "m.trt.onnx")
    rewritten = onnx.load(target)
    onnx.checker.check_model(rewritten, full_check=True)
    domains = {n.op_type: n.domain for n in rewritten.graph.node if n.op_type.startswith("PnMix")}
    assert domains == {"PnMixAttention": trt_ep.TRT_DOMAIN, "PnMixAppend": trt_ep.TRT_DOMAIN}
    # Without TensorRT the copied functions run the nodes: same outputs as the original file.
    _, info = load_checked(model_file)
    state = {name: np.zeros(shape, np.int8 if name in ("key_codes", "value_codes", "pair_mask") else np.float16)
             for name, shape in info.layout.state_shapes().items()}
    feeds = {"tokens": np.arange(40, dtype=np.int64)[None], "seq_len": np.array(0), "new_len": np.array(40), **state}
    before = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"]).run(None, feeds)
    after = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_trt_provider_options_name_the_plugin_library(tmp_path):
    options = trt_ep.trt_provider_options(tmp_path / "libpnmix_trt_plugins.so")
    assert options["trt_extra_plugin_lib_paths"].endswith("libpnmix_trt_plugins.so")


def test_trt_session_says_what_is_missing(model_file, tmp_path):
    has_trt = trt_ep.TRT_PROVIDER in ort.get_available_providers()
    missing = "plugin library not found" if has_trt else "TensorRT execution provider"
    with pytest.raises(PnMixError, match=missing):
        trt_ep.trt_session(model_file, tmp_path / "libpnmix_trt_plugins.so")
