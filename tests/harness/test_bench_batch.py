"""`pnmix bench batch` on a tiny random Llama: rows against their prompts alone, the report's
figures consistent with each other, bad options one line.

Timing is never asserted (figures come from the command); only what the report says.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="bench batch needs transformers")
warnings.filterwarnings("ignore", category=FutureWarning)

from typer.testing import CliRunner  # noqa: E402

from pnmix.bench.batch import ForwardTimes, left_padded, random_prompts  # noqa: E402
from pnmix.bench.generate import random_llama  # noqa: E402
from pnmix.cli import app  # noqa: E402

LENGTHS = (20, 300, 170)  # 300: past the sink and the residual, so each row's cache holds groups


@pytest.fixture(scope="module")
def model_dir(random_llama_dir):
    return random_llama_dir


def test_each_row_is_its_prompt_alone_and_the_rates_add_up(model_dir, tmp_path):
    out = tmp_path / "b.json"
    result = CliRunner().invoke(app, ["bench", "batch", "--model", str(model_dir), "--lengths",
                                      ",".join(map(str, LENGTHS)), "--new-tokens", "6", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "pnmix bench batch" in result.output
    report = json.loads(out.read_text())
    rows = {r["cache"]: r for r in report["results"]}
    assert set(rows) == {"dynamic", "pnmix"}
    # the packed cache holds each row's own tokens only: its greedy tokens are the prompt's alone
    assert rows["pnmix"]["rows_equal_alone"] == [True] * len(LENGTHS)
    assert rows["pnmix"]["first_difference"] == [None] * len(LENGTHS)
    for r in rows.values():
        assert r["batch_tokens_per_s"] == pytest.approx(len(LENGTHS) / r["batch_median_step_seconds"])
        assert r["batch1_tokens_per_s"] == pytest.approx(sum(r["alone_tokens_per_s"]) / len(LENGTHS))
        assert r["batch_vs_batch1"] == pytest.approx(r["batch_tokens_per_s"] / r["batch1_tokens_per_s"])


def test_the_batch_is_left_padded_without_the_pad_id_in_any_prompt():
    prompts = random_prompts((3, 5), vocab=4, pad=2, seed=1)
    assert all(int((p == 2).sum()) == 0 and int(p.max()) < 4 for p in prompts)
    batch = left_padded(prompts, pad=2)
    assert batch["input_ids"].shape == (2, 5)
    assert batch["attention_mask"].tolist()[0] == [0, 0, 1, 1, 1]
    assert batch["input_ids"][0, :2].tolist() == [2, 2]
    assert torch.equal(batch["input_ids"][0, 2:], prompts[0])


def test_forward_times_keep_one_sample_per_call_and_drop_the_prefill():
    model = random_llama(1, 32, 2, 1, 16)
    times = ForwardTimes(model)
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=torch.ones(1, 2, dtype=torch.long))
    times.close()
    with torch.no_grad():
        model(input_ids=torch.ones(1, 2, dtype=torch.long))  # after close: not counted
    assert len(times.samples) == 3 and times.decode_timing().count == 2


@pytest.mark.parametrize("args, message", [
    (["--lengths", "5"], "--lengths must name 2.."),
    (["--lengths", "5,x"], "--lengths must be a comma list of positive integers"),
    (["--caches", "dynamic,foo"], "--caches: unknown cache 'foo'"),
    (["--new-tokens", "1"], "--new-tokens must be 2..4096"),
    (["--lengths", "10,70000"], "passes the model's"),
])
def test_bad_options_are_one_line(model_dir, args, message):
    result = CliRunner().invoke(app, ["bench", "batch", "--model", str(model_dir), *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
