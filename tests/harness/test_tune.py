"""`pnmix tune`: the search space, the front, and the command on a tiny random Llama (seconds): the
winner within the budget and on the front, its config file taken by `pnmix eval --config`, the
one-line errors."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest

pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from typer.testing import CliRunner  # noqa: E402

from pnmix.cli import app  # noqa: E402
from pnmix.config import PnMixConfig  # noqa: E402
from pnmix.hf.evaluate.methods import CONFIG_METHOD, METHODS, pnmix_config  # noqa: E402
from pnmix.hf.evaluate.tune import (  # noqa: E402
    KNOBS, PRESETS, Candidate, Space, describe, key, knob_fields, pareto_front, step,
)
from pnmix.testing import tiny_llama  # noqa: E402

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
CONTEXT, DECODE, EVALS = 400, 32, 6


def invoke(*args):
    result = CliRunner().invoke(app, [*map(str, args)])
    return result, [line for line in result.output.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_1k_dir):
    return tiny_llama_1k_dir


@pytest.fixture(scope="module")
def space():
    return Space(tiny_llama().config, CONTEXT + DECODE)


def grid_sample(space, count=300):
    """Every count-th config of the KNOBS grid that is valid (a spread over the whole space)."""
    combos = itertools.product(*KNOBS.values())
    picked = [space.canonical(dict(zip(KNOBS, c))) for c in itertools.islice(combos, 0, None, 97)]
    return [c for c in picked if c is not None][:count]


# ---- the space ------------------------------------------------------------------------------------
def test_a_step_goes_to_the_next_value_of_the_knob():
    assert step((1, 2, 3, 4), 2, 1) == 3 and step((1, 2, 3, 4), 2, -1) == 1
    assert step((1, 2, 3, 4), 4, 1) is None and step((1, 2, 3, 4), 1, -1) is None
    assert step((32, 64, 128), 100, 1) == 128 and step((32, 64, 128), 100, -1) == 64  # off the list


def test_neighbours_are_valid_distinct_canonical_configs_one_or_two_knobs_away(space):
    config = space.canonical(knob_fields(pnmix_config(METHODS["pnmix"], space.model_config)))
    neighbours = space.neighbours(config)
    assert neighbours and len({key(n) for n in neighbours}) == len(neighbours) and config not in neighbours
    for n in neighbours:
        n.check_head_dim(space.dims.head_dim)  # the config rules every backend applies
        assert PnMixConfig(**n.to_dict()) == n and space.canonical(knob_fields(n)) == n
        assert n.residual_size >= n.group_size and n.key_high_bits >= n.key_low_bits
        moved = [k for k in KNOBS if getattr(n, k) != getattr(config, k)]
        assert 1 <= len(moved) <= 3, moved  # a step, a trade, or a larger group with its residual


def test_two_moves_away_are_the_neighbours_and_their_neighbours(space):
    config = space.canonical(knob_fields(pnmix_config(METHODS["pnmix"], space.model_config)))
    one = {key(n) for n in space.neighbours(config)}
    two = {key(n) for n in space.around(config, 2)}
    assert {key(n) for n in space.around(config, 1)} == one
    assert one < two and key(config) not in two
    assert two == (one | {key(m) for n in space.neighbours(config) for m in space.neighbours(n)}) - {key(config)}


def test_predicted_bits_are_what_the_cache_holds(tiny_dir, tmp_path):
    """Space.bits (before any decode) against the bytes `pnmix eval` measures, for a config off the presets."""
    config = {"value_bits": 3, "key_high_bits": 4, "key_low_bits": 2, "high_ratio": 0.25, "group_size": 64,
              "value_group_size": 16, "residual_size": 128, "sink_tokens": 8}
    (tmp_path / "c.json").write_text(json.dumps(config))
    result, _ = invoke("eval", tiny_dir, "--methods", "pnmix", "--config", tmp_path / "c.json", "--contexts", CONTEXT,
                       "--decode-tokens", DECODE, "--json", tmp_path / "e.json")
    assert result.exit_code == 0, result.output
    row = next(r for r in json.loads((tmp_path / "e.json").read_text())["results"] if r["method"] == CONFIG_METHOD)
    model_config = tiny_llama().config
    assert Space(model_config, CONTEXT + DECODE).bits(Space(model_config, 1).canonical(config)) == \
        pytest.approx(row["bits_per_element"], rel=1e-12)


def test_no_config_of_the_space_is_below_the_lowest(space):
    lowest, config = space.lowest()
    assert space.bits(config) == lowest
    for c in grid_sample(space) + [pnmix_config(METHODS[p], space.model_config) for p in PRESETS]:
        assert space.bits(c) >= lowest, describe(c)


def candidate(bits, kl):
    return Candidate(PnMixConfig(), bits, 1, kl, 1.0, 1.0, 0, bits, kl)


def test_the_front_keeps_exactly_the_configs_nothing_beats_on_bits_and_kl():
    points = [candidate(b, k) for b, k in [(2.0, 0.5), (2.5, 0.6), (3.0, 0.2), (3.0, 0.3), (4.0, 0.05), (4.5, 0.1)]]
    front = pareto_front(points)
    assert [(c.bits_per_element, c.kl) for c in front] == [(2.0, 0.5), (3.0, 0.2), (4.0, 0.05)]
    for c in points:
        dominated = any(o.bits_per_element <= c.bits_per_element and o.kl < c.kl for o in points)
        assert (c in front) == (not dominated)


# ---- the command ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tuned(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    args = ["tune", tiny_dir, "--bits", 4.5, "--context", CONTEXT, "--decode-tokens", DECODE, "--budget-evals", EVALS,
            "--json", out / "front.json", "--config-out", out / "cfg.json"]
    if HAS_MATPLOTLIB:
        args += ["--plot", out / "front.png"]
    result, _ = invoke(*args)
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "front.json").read_text()), result.output


def test_the_winner_is_within_the_budget_the_best_measured_and_on_the_front(tuned):
    out, report, output = tuned
    winner, evaluated = report["winner"], report["evaluated"]
    assert winner["bits_per_element"] <= 4.5 and winner["steps"] == DECODE
    fits = [r for r in evaluated if r["bits_per_element"] <= 4.5]
    assert winner["kl"] == min(r["kl"] for r in fits)
    assert winner["config"] in [r["config"] for r in report["front"]]
    for row in evaluated:  # the front: exactly the rows no other row beats on both
        dominated = any(o["bits_per_element"] <= row["bits_per_element"] and o["kl"] < row["kl"] for o in evaluated)
        assert row["on_front"] == (not dominated)
        assert row["bits_per_element"] == pytest.approx(row["bits_predicted"], rel=1e-12)
        if row["preset"] is None:  # the search decodes no config over the budget
            assert row["bits_per_element"] <= 4.5
    assert sorted(r["preset"] for r in evaluated if r["preset"]) == sorted(PRESETS)
    assert len(evaluated) > len(PRESETS) and report["screened"]  # it searched
    assert report["decode_steps_spent"] <= EVALS * DECODE
    assert winner["name"] in output and "winner" in output
    if HAS_MATPLOTLIB:
        assert (out / "front.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_config_file_is_the_winner_and_eval_config_reproduces_it(tuned, tiny_dir, tmp_path):
    out, report, _ = tuned
    fields = json.loads((out / "cfg.json").read_text())
    assert fields == report["winner"]["config"] and set(fields) == set(KNOBS)
    result, _ = invoke("eval", tiny_dir, "--methods", "pnmix", "--config", out / "cfg.json", "--contexts", CONTEXT,
                       "--decode-tokens", DECODE, "--json", tmp_path / "e.json")
    assert result.exit_code == 0, result.output
    row = next(r for r in json.loads((tmp_path / "e.json").read_text())["results"] if r["method"] == CONFIG_METHOD)
    assert row["bytes"] == report["winner"]["bytes"]
    assert row["kl"] == pytest.approx(report["winner"]["kl"], rel=1e-6)  # the same prefill, steps and reference


@pytest.mark.parametrize("args, message", [
    (["--bits", 0.5], "--bits 0.5 is below what any pn-mix config reaches on"),
    (["--bits", 0], "--bits must be a positive number"),
    (["--bits", "nan"], "--bits must be a positive number"),
    (["--context", 0], "--context must be at least 1"),
    (["--budget-evals", 0], "--budget-evals must be at least 1"),
    (["--context", 1000], "longer than"),
    (["--text", "SHORT"], "the text has"),
    (["--json", "NOWHERE"], "output folder does not exist"),
    (["--json", "SAME", "--config-out", "SAME"], "name the same file"),
])
def test_bad_input_is_one_line(args, message, tiny_dir, tmp_path):
    (tmp_path / "short.txt").write_text("To be, or not to be.")
    swap = {"SHORT": tmp_path / "short.txt", "NOWHERE": tmp_path / "no" / "x.json", "SAME": tmp_path / "x.json"}
    args = [swap.get(a, a) if isinstance(a, str) else a for a in args]
    base = ["tune", tiny_dir, "--context", CONTEXT, "--decode-tokens", DECODE]
    if "--bits" not in args:
        base += ["--bits", 4]
    result, lines = invoke(*base, *args)
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output
