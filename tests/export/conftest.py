"""Fixtures of the export tests: the diagnostic file, exported once per (config, capacity) in a
session, so the modules that read the same file do not export it again."""

from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import pytest

from pnmix.config import PnMixConfig


@pytest.fixture(scope="session")
def diagnostic_file(tmp_path_factory) -> Callable[..., Path]:
    """diagnostic_file(capacity, config=None) -> the path of that export (the manifest's config by
    default). Tests read it; a test that changes a file works on its own copy."""
    from pnmix.export.exporter import export_onnx

    made: Dict[Tuple[PnMixConfig, int], Path] = {}

    def export(capacity: int, config: Optional[PnMixConfig] = None) -> Path:
        key = (config or PnMixConfig(), capacity)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"onnx{capacity}")
            made[key] = export_onnx(folder / "m.onnx", key[0], max_seq_len=capacity).path
        return made[key]

    return export
