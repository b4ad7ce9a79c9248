"""conftest.py's rule: a skip for a missing libpnmix_core fails where the library must exist."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

_spec = importlib.util.spec_from_file_location("pnmix_tests_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def _skipped(reason):
    return SimpleNamespace(skipped=True, outcome="skipped", longrepr=("test_x.py", 1, f"Skipped: {reason}"))


def test_a_core_skip_fails_when_the_core_is_required(monkeypatch):
    monkeypatch.setenv("PNMIX_REQUIRE_CORE", "1")
    report = _skipped("libpnmix_core not available: not found")
    conftest._fail_core_skip(report)
    assert report.outcome == "failed" and "must be built" in report.longrepr


def test_other_skips_stay_skips(monkeypatch):
    monkeypatch.setenv("PNMIX_REQUIRE_CORE", "1")
    report = _skipped("needs a CUDA device")
    conftest._fail_core_skip(report)
    assert report.outcome == "skipped"


def test_a_core_skip_stays_a_skip_in_a_checkout_without_the_requirement(monkeypatch):
    monkeypatch.delenv("PNMIX_REQUIRE_CORE", raising=False)
    monkeypatch.setattr(conftest, "core_is_required", lambda: False)
    report = _skipped("libpnmix_core not available: not found")
    conftest._fail_core_skip(report)
    assert report.outcome == "skipped"
