"""`pnmix bench generate` on a tiny random Llama: the JSON's shape, the reused prefill, bad options.

Timing is never asserted (figures come from the command); only what the report says and that the
one shared prefill fills each cache exactly as the model's own prefill would.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="bench generate needs transformers")
warnings.filterwarnings("ignore", category=FutureWarning)

from typer.testing import CliRunner  # noqa: E402

from pnmix.cli import app  # noqa: E402
from pnmix.hf import register  # noqa: E402
from pnmix.hf._deps import quanto_unavailable_reason  # noqa: E402
from pnmix.bench.generate import (  # noqa: E402
    int8_unavailable_reason,
    GENERATE_CACHES, ROUND_TOKENS, filled_cache, new_cache, prefill_kv, random_llama, time_decodes)

CONTEXTS = (40, 300)  # 300: past the sink and the residual, so the pnmix cache holds groups


@pytest.fixture(scope="module")
def model_dir(random_llama_dir):
    return random_llama_dir


def test_report_has_every_cache_at_every_context(model_dir, tmp_path):
    out = tmp_path / "g.json"
    result = CliRunner().invoke(app, ["bench", "generate", "--model", str(model_dir), "--contexts",
                                      ",".join(map(str, CONTEXTS)), "--new-tokens", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "pnmix bench generate" in result.output
    report = json.loads(out.read_text())
    skipped = {s["cache"] for s in report["skipped"]}
    assert skipped == ({"quanto4"} if quanto_unavailable_reason() else set()) | (
        {"pnmix_int8"} if int8_unavailable_reason() else set())
    rows = {(r["cache"], r["context"]): r for r in report["results"]}
    assert set(rows) == {(c, n) for c in GENERATE_CACHES if c not in skipped for n in CONTEXTS}
    for r in report["results"]:
        assert {"cache", "context", "tokens_per_s", "cache_bytes", "peak_bytes"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] >= r["cache_bytes"] > 0
        # tokens/s from the median step; the total time holds the 3 timed steps
        assert r["tokens_per_s"] == pytest.approx(1 / r["median_step_seconds"])
        assert r["mean_tokens_per_s"] == pytest.approx(3 / r["decode_seconds"])
    # the bytes are the caches' own: full-precision fp32 K/V of 300 + 4 tokens (prefill, the untimed
    # first step, 3 timed steps) in 2 layers of 2 KV heads x 32 channels, and the packed state's
    dynamic = rows[("dynamic", 300)]
    assert dynamic["cache_bytes"] == 2 * 2 * 2 * (300 + 4) * 32 * 4
    assert rows[("pnmix", 300)]["cache_bytes"] < dynamic["cache_bytes"] / 4
    assert rows[("pnmix", 300)]["backend"] in ("core", "torch")
    if "pnmix_int8" not in skipped:  # the same cache, its attention on the core's integer path
        assert rows[("pnmix_int8", 300)]["backend"] == "core int8"
        assert rows[("pnmix_int8", 300)]["cache_bytes"] == rows[("pnmix", 300)]["cache_bytes"]
        from pnmix.backends.core_ops import CoreOps

        assert CoreOps().arith() == "fp32"  # the bench gave the process its arithmetic back
    assert report["prefill_tokens"] == max(CONTEXTS)


def test_the_caches_are_timed_in_interleaved_rounds():
    """A burst of load on a shared machine must hit every cache alike: each round advances every
    cache by ROUND_TOKENS steps, the last round by what is left."""
    log = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def step(self, count):
            log.append((self.name, count))

    time_decodes([Recorder("dynamic"), Recorder("pnmix")], 2 * ROUND_TOKENS + 3)
    assert log == [("dynamic", ROUND_TOKENS), ("pnmix", ROUND_TOKENS)] * 2 + [("dynamic", 3), ("pnmix", 3)]


@pytest.mark.parametrize("kind", GENERATE_CACHES)
def test_the_shared_prefill_fills_a_cache_as_the_model_does(kind):
    if kind == "quanto4" and quanto_unavailable_reason() is not None:
        pytest.skip(quanto_unavailable_reason())
    register()
    model = random_llama(2, 64, 4, 2, 32)
    ids = torch.randint(1, 256, (1, 301), generator=torch.Generator().manual_seed(1))
    keys, values = prefill_kv(model, ids[:, :300])  # the longest prompt; its causal prefix serves 200
    cache, attn = filled_cache(kind, model, keys, values, 200)
    model.set_attn_implementation(attn)
    with torch.no_grad():
        got = model(input_ids=ids[:, 200:201], cache=cache, use_cache=True).logits
        own, _ = new_cache(kind, model)  # the model's own prefill, then the same step
        model(input_ids=ids[:, :200], cache=own, use_cache=True)
        want = model(input_ids=ids[:, 200:201], cache=own, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["--contexts", "abc"], "--contexts must be"),
    (["--contexts", "0"], "--contexts must be a comma list of positive integers"),
    (["--new-tokens", "0"], "--new-tokens must be"),
    (["--model", "/no/such/model"], "model not found"),
])
def test_bad_options_are_one_line_errors(model_dir, args, message):
    base = ["bench", "generate", "--model", str(model_dir), "--contexts", "40"]
    result = CliRunner().invoke(app, base + args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
