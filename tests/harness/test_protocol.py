import pytest

from pnmix.config import PnMixConfig, RunConfig
from pnmix.manifest import AT_LEAST_MINUS, AT_MOST_TIMES, compare, load_manifest
from pnmix.protocol import aggregate
from pnmix.verify import run_seeds


@pytest.fixture(scope="module")
def manifest_runs():
    manifest = load_manifest()
    run = RunConfig(PnMixConfig.from_manifest(manifest))
    return manifest, run, run_seeds("torch", run, manifest["seeds"])


def test_protocol_counts_and_bytes_match_the_manifest_exactly(manifest_runs):
    manifest, _, runs = manifest_runs
    for r in runs:
        m = r.metrics
        assert (m["key_bytes"], m["value_bytes"], m["persistent_cache_bytes"]) == (15108, 17408, 32516)
        assert (m["quantized_tokens"], m["sink_tokens"], m["residual_tokens"]) == (384, 32, 32)
        assert m["actual_attention_calls"] == 66 and m["saliency_computations"] == 1
        assert m["mask_unchanged_after_decode"] is True and m["sink_key_max_error"] == 0
        assert m["key_bits_per_element_including_sink_residual"] == manifest["metrics"][
            "key_bits_per_element_including_sink_residual"]["mean"]


def test_quality_means_inside_spec_bands(manifest_runs):
    manifest, run, runs = manifest_runs
    ours = aggregate(runs)
    for name, factor in AT_MOST_TIMES.items():
        assert ours[name]["mean"] <= factor * manifest["metrics"][name]["mean"], name
    for name, margin in AT_LEAST_MINUS.items():
        assert ours[name]["mean"] >= manifest["metrics"][name]["mean"] - margin, name
    rows = compare(manifest, run, ours, [{"metrics": r.metrics} for r in runs])
    assert not [row.metric for row in rows if row.failed]


def test_same_seed_gives_identical_metrics_and_bytes(manifest_runs):
    _, run, runs = manifest_runs
    again = run_seeds("torch", run, [runs[0].seed])[0]
    assert again.metrics == runs[0].metrics
    assert again.packed == runs[0].packed
    assert again.online.equal(runs[0].online) and again.final.equal(runs[0].final)


def test_different_seeds_differ(manifest_runs):
    _, _, runs = manifest_runs
    assert runs[0].metrics["key_mse"] != runs[1].metrics["key_mse"]


def test_worse_figures_are_reported_as_mismatch(manifest_runs):
    manifest, run, runs = manifest_runs
    ours = aggregate(runs)
    ours["key_mse"] = dict(ours["key_mse"], mean=manifest["metrics"]["key_mse"]["mean"] * 1.2)
    ours["key_bytes"] = dict(ours["key_bytes"], mean=15109)
    verdicts = {r.metric: r.verdict for r in compare(manifest, run, ours, [{"metrics": r.metrics} for r in runs])}
    assert verdicts["key_mse"] == "MISMATCH" and verdicts["key_bytes"] == "MISMATCH"


def test_off_manifest_config_checks_formula_bytes_and_invariants(other_config):
    manifest = load_manifest()
    run = RunConfig(other_config, prefill_tokens=200, decode_tokens=40)
    runs = run_seeds("torch", run, [7])
    rows = {r.metric: r.verdict for r in compare(manifest, run, aggregate(runs), [{"metrics": r.metrics} for r in runs])}
    assert rows["key_bytes"] == "ok" and rows["actual_attention_calls"] == "ok"
    assert rows["key_mse"] == "n/a"  # quality bands do not apply off the manifest's protocol
    assert runs[0].metrics["actual_attention_calls"] == 42
