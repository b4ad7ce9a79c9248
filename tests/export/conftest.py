"""Fixtures of the export tests: the diagnostic file, exported once per (config, capacity) in a
session, so the modules that read the same file do not export it again."""

from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import pytest

from pnmix.config import PnMixConfig

TINY_CAPACITY = 96  # the tiny LLM export's capacity (CAPACITY in its modules)


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


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A 2-layer random Llama, a small-group config (groups quantize within a short run) and its
    export (capacity 96), made once for the export tests. Tests read it; a test that changes a
    file works on its own copy."""
    import json

    import numpy as np

    from pnmix.export.llm import export_llm
    from pnmix.testing import SMALL, WORDS, make_tiny_model

    root = tmp_path_factory.mktemp("tiny_llm")
    folder = make_tiny_model(root / "llama")
    config = root / "config.json"
    config.write_text(json.dumps(SMALL))
    result = export_llm(str(folder), root / "m.onnx", TINY_CAPACITY, config)
    text = root / "text.txt"
    text.write_text(" ".join(np.random.default_rng(0).choice(WORDS, 200)))
    return {"root": root, "folder": folder, "config": config, "onnx": result.path, "result": result, "text": text}
