import json

import pytest
from typer.testing import CliRunner

from pnmix.cli import app

runner = CliRunner()


def run_cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.slow  # the whole protocol
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


@pytest.mark.slow  # the whole protocol
def test_verify_torch_backend_passes(tmp_path):
    """The reference through the backend interface, in a second independent run, against the
    reference run of verify: bit-identical (tolerance 0), and the manifest's exact figures."""
    out = tmp_path / "r.json"
    code, text = run_cli("verify", "--backend", "torch", "--seeds", "42", "--json", out)
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["backend"] == "torch" and report["passed"] is True
    assert report["runs"][0]["packed_bytes_identical"] is True
    assert report["manifest"]["passed"] is True
    run = report["runs"][0]
    assert report["tolerance"] == 0.0 and run["max_abs_diff_online"] == 0.0 and run["max_abs_diff_final"] == 0.0
    assert run["metrics"]["persistent_cache_bytes"] == 32516 and run["metrics"]["actual_attention_calls"] == 66


class _Perturbed:
    """The reference's ops with one change: attention off by `attend_by`, or one key code flipped."""

    name = "perturbed"

    def __init__(self, attend_by=0.0, flip_code=False):
        from pnmix.cache import ReferenceOps

        self.reference, self.attend_by, self.flip_code = ReferenceOps(), attend_by, flip_code

    def append(self, layout, state, seq_len, k, v):
        self.reference.append(layout, state, seq_len, k, v)
        if self.flip_code and layout.lengths(seq_len + k.shape[2]).groups:
            state["key_codes"][0, 0, 0, 0] ^= 1

    def attend(self, q, layout, state, seq_len, k_new, v_new):
        return self.reference.attend(q, layout, state, seq_len, k_new, v_new) + self.attend_by


@pytest.mark.slow  # the whole protocol, twice
@pytest.mark.parametrize("change, failed_field", [
    (dict(attend_by=1e-3), "max_abs_diff_final"), (dict(flip_code=True), "packed_bytes_identical")])
def test_verify_fails_a_backend_that_differs_from_the_reference(monkeypatch, change, failed_field):
    """What makes the torch pass above mean something: the same harness fails a backend whose
    attention is off by 1e-3 (beyond torch's tolerance 0) or whose packed bytes differ by one bit."""
    from pnmix import verify as verify_module
    from pnmix.backends.base import OpsBackend
    from pnmix.config import run_config
    from pnmix.manifest import load_manifest

    real = verify_module.make_backend

    def make_backend(name, config, seed, max_seq_len, device="cpu", **options):
        if name != "perturbed":
            return real(name, config, seed, max_seq_len, device, **options)
        return OpsBackend(_Perturbed(**change), config, seed, max_seq_len, device)

    monkeypatch.setattr(verify_module, "make_backend", make_backend)
    monkeypatch.setitem(verify_module.TOLERANCE, "perturbed", 0.0)
    manifest = load_manifest()
    report = verify_module.verify("perturbed", run_config(manifest), manifest, [42])
    assert report["passed"] is False and report["runs"][0]["passed"] is False
    record = report["runs"][0]
    assert (record[failed_field] is False) if failed_field == "packed_bytes_identical" else record[failed_field] > 0


def test_verify_needs_exactly_one_backend():
    code, text = run_cli("verify")
    assert code == 2 and "exactly one" in text


# ---------------------------------------------------------------------------------------
# The options the commands share, and the --json report
# ---------------------------------------------------------------------------------------


def commands(group=None, prefix=()):
    """{"bench decode": click command, ...}: every command of the app, its groups walked."""
    import typer

    group = group or typer.main.get_command(app)
    found = {}
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a group (Typer may vendor click: no isinstance)
            found.update(commands(cmd, (*prefix, name)))
        else:
            found[" ".join((*prefix, name))] = cmd
    return found


def option(cmd, name):
    return next((p for p in cmd.params if p.name == name), None)


def test_every_json_option_is_the_shared_one():
    from pnmix.cli import JSON_HELP

    with_json = {name for name, cmd in commands().items() if option(cmd, "json_path") is not None}
    assert with_json == {"reproduce", "verify", "generate", "doctor", "eval", "tune",
                         "bench decode", "bench generate", "bench batch", "bench onnx"}
    for name in with_json:
        param = option(commands()[name], "json_path")
        assert param.opts == ["--json"] and param.help == JSON_HELP, name
    code, text = run_cli("doctor", "--help")
    assert code == 0 and JSON_HELP in text


def test_the_config_of_config_fields_is_one_option_and_model_is_spelled_once():
    from pnmix.cli import MODEL_KINDS

    found = commands()
    helps = {name: option(found[name], "config").help for name in ("reproduce", "verify", "export", "bench decode")}
    assert len(set(helps.values())) == 1, helps
    for name, param in (("verify", "model"), ("export", "model"), ("generate", "tokenizer"),
                        ("bench generate", "model"), ("bench onnx", "model"), ("eval", "model")):
        assert MODEL_KINDS in option(found[name], param).help, name
    threads = {option(found[name], "threads").help for name in ("generate", "bench decode", "bench generate")}
    assert len(threads) == 1


def test_a_bad_json_path_fails_before_the_work(monkeypatch, tmp_path):
    import pnmix.doctor

    def never():
        raise AssertionError("the work ran before the --json path was checked")

    monkeypatch.setattr(pnmix.doctor, "run_doctor", never)
    code, text = run_cli("doctor", "--json", tmp_path / "missing" / "d.json")
    assert code == 2 and "does not exist" in text and len(text.strip().splitlines()) == 1


def test_json_report_checks_its_path_at_once_and_writes_atomically(tmp_path):
    from pnmix.errors import PnMixError
    from pnmix.io import JsonReport

    with pytest.raises(PnMixError, match="does not exist"):
        JsonReport(tmp_path / "missing" / "r.json")
    with pytest.raises(PnMixError, match="directory"):
        JsonReport(tmp_path)
    JsonReport(None).write({"written": "nowhere"})  # no --json: nothing to do
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "r.json"
    report = JsonReport(out)
    assert not out.exists()  # created before the work, written after it
    report.write({"passed": True})
    assert json.loads(out.read_text()) == {"passed": True}
    with pytest.raises(TypeError):  # a report that cannot be written leaves the old one whole
        report.write({"passed": object()})
    assert json.loads(out.read_text()) == {"passed": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
