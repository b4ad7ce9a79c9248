"""A short run of tools/fuzz_python.py's mutation loop on every target, in CI: no finding.

Longer campaigns: ``python3 tools/fuzz_python.py --runs 100000`` or, coverage-guided,
``python3 tools/fuzz_python.py --atheris -- -max_total_time=600``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import fuzz_python as fuzz  # noqa: E402  (tools/ is not a package)

RUNS = {"dump": 400, "config": 400, "manifest": 200, "onnx": 120, "json": 400, "sidecar": 200, "state": 300, "cache_api": 150, "gguf": 200, "llm_meta": 200}


@pytest.mark.parametrize("target", [pytest.param(target, marks=pytest.mark.slow) if target in ("onnx", "llm_meta")
                                    else target for target in sorted(RUNS)])  # onnx, llm_meta: an export per run
def test_mutation_fuzzing_finds_nothing(target, tmp_path):
    result = fuzz.run_loop(target, RUNS[target], 60.0, seed=1, crash_dir=tmp_path, log=lambda _: None)
    assert result["findings"] == [], result["findings"]
    assert result["cases"] == RUNS[target]
    outcomes = result["outcomes"]
    # The mutations must reach both sides of the parser, or the run proves little.
    assert outcomes.get("ok", 0) > 0 and outcomes.get("refused", 0) > 0, outcomes


def test_a_planted_bug_is_found(tmp_path, monkeypatch):
    """The loop reports an exception other than PnMixError (guards the test above)."""
    import pnmix.dump as dump_module

    real = dump_module.load_state

    def buggy(blob):
        if len(blob) % 7 == 3:
            raise IndexError("planted")
        return real(blob)

    monkeypatch.setattr(dump_module, "load_state", buggy)
    result = fuzz.run_loop("dump", 100, 30.0, seed=2, crash_dir=tmp_path, log=lambda _: None)
    assert any("IndexError: planted" in f for f in result["findings"])
    assert list(tmp_path.glob("dump-*.bin")), "the finding's input was not saved"


def test_the_state_target_finds_an_import_that_skips_the_mask_check(tmp_path, monkeypatch):
    """A planted gap: import_state without the pair-mask check accepts masks load_state refuses."""
    import pnmix.format as format_module

    monkeypatch.setattr(format_module, "check_state_values", lambda *args: None)
    result = fuzz.run_loop("state", 300, 60.0, seed=3, crash_dir=tmp_path, log=lambda _: None)
    assert any("load_state refuses" in f for f in result["findings"]), result


def test_the_cache_api_target_finds_a_batch_call_without_its_index_check(tmp_path, monkeypatch):
    """A planted gap: reorder_cache / batch_select_indices taking any index reach torch's raw
    IndexError / RuntimeError, which the target reports."""
    import pnmix.hf.cache as hf_cache

    monkeypatch.setattr(hf_cache, "batch_rows", lambda indices, batch, what: torch.as_tensor(indices).long())
    result = fuzz.run_loop("cache_api", 150, 60.0, seed=4, crash_dir=tmp_path, log=lambda _: None)
    assert any("reorder_cache" in f or "batch_select_indices" in f for f in result["findings"]), result
