"""`pnmix doctor`: every component is listed with a reason or a passing self-check."""

import json

import pytest

from pnmix import doctor
from pnmix._native import library_status


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("doctor") / "d.json"
    code = doctor.doctor_command(path)
    return code, json.loads(path.read_text())


@pytest.mark.slow  # the report: every component's self-check, exports included
def test_every_component_listed_with_reason_or_passing_check(report):
    code, data = report
    names = [c["name"] for c in data["components"]]
    for word in ("torch", "CUDA device", "triton", "onnxruntime", "core library", "CUDA kernels", "TensorRT"):
        assert any(word in name for name in names), word
    for c in data["components"]:
        assert c["detail"].strip() and "\n" not in c["detail"]
        if c["available"]:
            assert c["check"] == "pass", c
        else:
            assert c["check"] == "skipped"
    assert code == 0 and data["passed"]


@pytest.mark.slow  # the same report
def test_core_line_follows_the_library(report):
    _, data = report
    core = next(c for c in data["components"] if c["name"].startswith("core library"))
    available, why = library_status("pnmix_core")
    assert core["available"] == available
    if available:
        from pnmix.backends.core_ops import CoreOps

        assert "identical" in core["check_detail"]
        on_torch = CoreOps().team is not None  # where CoreOps runs its attention (PNMIX_TORCH_THREADS as set)
        assert core["extra"]["threads"] == ("torch's OpenMP threads" if on_torch else "its own thread pool")
    else:
        assert core["detail"] == why


def test_a_differing_backend_fails_its_self_check(monkeypatch):
    if not library_status("pnmix_core")[0]:
        pytest.skip("libpnmix_core not built: nothing to self-check")
    real = doctor._reference()
    flipped = bytearray(real.packed)
    flipped[-1] ^= 1  # one bit of the reference's cache changed: the core must now differ
    monkeypatch.setattr(doctor, "_reference", lambda: type(real)(**{**real.__dict__, "packed": bytes(flipped)}))
    core = doctor.check_core()
    assert core.check == "FAIL" and "DIFFER" in core.check_detail
