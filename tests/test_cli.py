import json

import pytest
from typer.testing import CliRunner

from pnmix.cli import app

runner = CliRunner()


def run_cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def test_reproduce_writes_manifest_shaped_json_and_passes(tmp_path):
    out = tmp_path / "out.json"
    code, text = run_cli("reproduce", "--json", out)
    assert code == 0, text
    data = json.loads(out.read_text())
    assert data["passed"] is True
    assert data["metrics"]["key_bytes"] == {"mean": 15108, "std": 0.0, "n": 3}
    assert [r["seed"] for r in data["runs"]] == [42, 43, 44]
    run = data["runs"][0]
    assert set(run) >= {"seed", "metrics", "runtime", "dataset", "protocol"}
    assert run["dataset"]["revision"].startswith("sha256:bbe56356")
    assert set(run["runtime"]) >= {"device_kind", "accelerator_model", "elapsed_seconds", "peak_allocated_bytes"}
    assert "MISMATCH" not in text and "exact" in text


def test_reproduce_with_another_config_runs_and_prints_na(tmp_path):
    config = tmp_path / "other.json"
    config.write_text(json.dumps({"pair_layout": "half", "value_bits": 4, "key_high_bits": 4,
                                  "key_low_bits": 2, "group_size": 64, "residual_size": 96,
                                  "prefill_tokens": 200, "decode_tokens": 30}))
    out = tmp_path / "out2.json"
    code, text = run_cli("reproduce", "--config", config, "--seeds", "42", "--json", out)
    assert code == 0, text
    data = json.loads(out.read_text())
    assert data["runs"][0]["protocol"]["config"]["pair_layout"] == "half"
    assert data["runs"][0]["metrics"]["actual_attention_calls"] == 32
    assert "n/a" in text


@pytest.mark.parametrize("content, words", [
    ('{"group_size": 100}', "group_size"),
    ('{"pair_layout": "diag"}', "pair_layout"),
    ('{"group_size": ', "not valid JSON"),
    ('[1, 2]', "JSON object"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    out = tmp_path / "out.json"
    code, text = run_cli("reproduce", "--config", path, "--json", out)
    assert code == 2
    assert words in text and "Traceback" not in text
    assert len(text.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("content, words", [
    (None, "not found"),
    ("{}", "no 'protocol'"),
    ('{"protocol": {}, "metrics": {}, "seeds": []}', "seeds"),
    ("not json", "not valid JSON"),
])
def test_missing_or_malformed_manifest_is_one_line_exit_2(tmp_path, content, words):
    path = tmp_path / "m.json"
    if content is not None:
        path.write_text(content)
    code, text = run_cli("reproduce", "--manifest", path)
    assert code == 2 and words in text and "Traceback" not in text
    assert len(text.strip().splitlines()) == 1


def test_bad_seeds_and_device(tmp_path):
    assert run_cli("reproduce", "--seeds", "4x")[0] == 2
    code, text = run_cli("reproduce", "--device", "tpu")
    assert code == 2 and "--device" in text


def test_verify_torch_backend_passes(tmp_path):
    out = tmp_path / "r.json"
    code, text = run_cli("verify", "--backend", "torch", "--seeds", "42", "--json", out)
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["backend"] == "torch" and report["passed"] is True
    assert report["runs"][0]["packed_bytes_identical"] is True
    assert report["manifest"]["passed"] is True


def test_verify_needs_exactly_one_backend():
    code, text = run_cli("verify")
    assert code == 2 and "exactly one" in text
