"""vLLM runs in its own virtual environment (docs/VLLM.md section 6): its CPU build pins a
transformers older than the one pnmix's tests use. Tests find its Python through
$PNMIX_VLLM_PYTHON, else ``.venv-vllm/bin/python`` in the checkout, and run vLLM in subprocesses.
Without it they skip, except where $PNMIX_REQUIRE_VLLM=1 (CI, which makes the environment first):
there a missing vLLM fails."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    path = Path(os.environ.get("PNMIX_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
    reason = None
    if not path.is_file():
        reason = f"vLLM's Python not found at {path} (docs/VLLM.md: python -m venv --system-site-packages .venv-vllm ...)"
    else:
        probe = subprocess.run([str(path), "-c", "import vllm, pnmix.vllm.plugin, pnmix.vllm.backend"], capture_output=True, text=True,
                               timeout=300)
        if probe.returncode != 0:
            reason = f"vLLM does not import with {path}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    if reason is not None:
        if os.environ.get("PNMIX_REQUIRE_VLLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def vllm_py() -> Path:
    return vllm_python()


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory, vllm_py):
    """The packaged SmolLM2-135M as a Hugging Face folder (vLLM's GGUF path does not take it)."""
    from pnmix.errors import PnMixError
    from pnmix.hf.models import resolve_model, save_hf_folder

    try:
        source = resolve_model("smollm2-135m")
    except PnMixError as exc:
        pytest.skip(str(exc))
    return save_hf_folder(source, tmp_path_factory.mktemp("smollm2-hf"))
