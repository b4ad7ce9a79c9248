"""plugins/examples/pnmix_ort_run (docs/ORT.md): the C++ app generates through ONNX Runtime's C API
the same greedy ids as pnmix's Python session over the same LLM file, with the function bodies and
with libpnmix_ort's kernels, and reports the same cache bytes; bad input is one line and exit 2."""

import json
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="the LLM exporter needs transformers")
onnxruntime = pytest.importorskip("onnxruntime", reason="the app runs ONNX Runtime")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (pnmix[hf])")

from pnmix._native import find_library, search_dirs  # noqa: E402
from pnmix.backends.onnxruntime.llm_session import LlmSession, greedy  # noqa: E402
from pnmix.export.llm import export_llm  # noqa: E402
from pnmix.testing import SMALL, make_tiny_model  # noqa: E402

CAPACITY = 256
NEW_TOKENS = 8
# 6 tokens: the prefill fills sink and residual only; 40: it quantizes a group (SMALL: sink 5,
# residual 24, groups of 16) and the decode steps attend over packed keys and values.
PROMPTS = {"short": [5, 17, 42, 9, 3, 60], "long": [(7 * i + 3) % 120 + 3 for i in range(40)]}
BUILD = "cmake -S plugins -B build/dev && cmake --build build/dev --target pnmix_ort_run pnmix_ort"


def find_app():
    """pnmix_ort_run where pnmix._native looks for libraries (pnmix/lib, the build folders)."""
    for folder in search_dirs():
        for path in [folder / "pnmix_ort_run", *sorted(folder.glob("*/pnmix_ort_run"))]:
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


APP = find_app()
pytestmark = pytest.mark.skipif(APP is None, reason=f"pnmix_ort_run is not built ({BUILD})")


def ort_library() -> Path:
    """The onnxruntime wheel's shared library: the app is run from a build tree, not beside the wheel."""
    found = sorted((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    if not found:
        pytest.skip("the onnxruntime package has no capi/libonnxruntime.so*")
    return found[-1]


def run_app(*args):
    return subprocess.run([str(APP), "--ort-library", str(ort_library()), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def llm_file(tmp_path_factory) -> Path:
    """The tiny random Llama with the small-group config, exported with capacity 256."""
    root = tmp_path_factory.mktemp("ort_app")
    config = root / "config.json"
    config.write_text(json.dumps(SMALL))
    return export_llm(str(make_tiny_model(root / "llama")), root / "m.onnx", CAPACITY, config).path


def ops_arguments(ops: str):
    if ops == "functions":
        return ["--ops", "functions"]
    library, why = find_library("pnmix_ort")
    if library is None:
        pytest.skip(f"--ops native needs libpnmix_ort: {why}")
    return ["--ops", "native", "--pnmix-ort", library]


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("ops", ["functions", "native"])
def test_app_generates_the_python_sessions_greedy_ids_and_reports_its_cache_bytes(llm_file, ops, prompt):
    ids = PROMPTS[prompt]
    extra = ops_arguments(ops)
    result = run_app("--model", llm_file, "--tokens", ",".join(map(str, ids)), "--max-new-tokens", NEW_TOKENS, *extra)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)

    session = LlmSession(llm_file, ops=ops)
    want = greedy(session, ids, NEW_TOKENS)
    assert report["token_ids"] == want.new_ids
    assert report["ops"] == ops
    assert report["prompt_tokens"] == len(ids) and report["new_tokens"] == NEW_TOKENS
    bytes_python = session.cache_bytes()
    assert report["persistent_cache_bytes"] == bytes_python["persistent_cache_bytes"]
    assert report["state_bytes"] == bytes_python["allocated_bytes"]
    assert report["prefill_seconds"] > 0 and report["decode_seconds"] > 0
    assert report["prefill_tokens_per_s"] > 0 and report["decode_tokens_per_s"] > 0


def test_app_stops_at_the_files_capacity(llm_file):
    ids = [5] * (CAPACITY - 3)
    result = run_app("--model", llm_file, "--tokens", ",".join(map(str, ids)), "--max-new-tokens", 50,
                     "--ops", "functions")
    assert result.returncode == 0, result.stderr
    # the last new token is never appended: CAPACITY - len(ids) + 1 fit, as `pnmix generate` counts
    assert json.loads(result.stdout)["new_tokens"] == 4


def assert_one_line_error(result, *words):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize("tokens, words", [
    ("1,x", ["'x'", "0..127"]),
    ("1,128", ["'128'", "0..127"]),
    ("-1", ["'-1'"]),
    ("1,,2", ["''"]),
])
def test_bad_token_ids_are_one_line_and_exit_2(llm_file, tokens, words):
    assert_one_line_error(run_app("--model", llm_file, "--tokens", tokens, "--ops", "functions"), "--tokens", *words)


def test_a_prompt_over_the_capacity_is_one_line_and_exit_2(llm_file):
    tokens = ",".join(["5"] * (CAPACITY + 1))
    assert_one_line_error(run_app("--model", llm_file, "--tokens", tokens, "--ops", "functions"),
                          "cache capacity exceeded", f"max_seq_len {CAPACITY}")


def test_a_missing_model_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(run_app("--model", tmp_path / "missing.onnx", "--tokens", "1,2", "--ops", "functions"),
                          "missing.onnx")


def test_a_file_that_is_not_onnx_carries_onnx_runtimes_reason(tmp_path):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"not a model")
    assert_one_line_error(run_app("--model", path, "--tokens", "1", "--ops", "functions"),
                          "ONNX Runtime cannot load", "Protobuf")


def test_the_diagnostic_file_is_refused_as_not_an_llm_file(diagnostic_file):
    assert_one_line_error(run_app("--model", diagnostic_file(260), "--tokens", "1", "--ops", "functions"),
                          "not a pn-mix LLM file")


def test_a_library_that_is_not_onnx_runtime_is_one_line_and_exit_2(llm_file, tmp_path):
    fake = tmp_path / "libonnxruntime.so.1"
    fake.write_bytes(b"\x7fELF not really")
    result = subprocess.run([str(APP), "--ort-library", str(fake), "--model", str(llm_file), "--tokens", "1"],
                            capture_output=True, text=True, timeout=60)
    assert_one_line_error(result, "cannot load ONNX Runtime's library")
