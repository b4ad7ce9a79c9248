"""Fixtures of the command-line and hardening tests: one small ONNX export that several modules load,
truncate and tamper with, made once per session."""

import pytest

from pnmix.config import PnMixConfig

SMALL_EXPORT_CONFIG = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4)


@pytest.fixture(scope="session")
def small_onnx_bytes(tmp_path_factory) -> bytes:
    """The bytes of an export of SMALL_EXPORT_CONFIG (capacity 64, batch 1, seed 42)."""
    exporter = pytest.importorskip("pnmix.export.exporter")
    path = tmp_path_factory.mktemp("export") / "m.onnx"
    exporter.export_onnx(path, SMALL_EXPORT_CONFIG, max_seq_len=64, batch=1, seed=42)
    return path.read_bytes()
