"""`pnmix eval --task passkey|passkey-long`: the classic haystack, where the needle sits, the long keys,
the flag on a cell the full-precision reference fails, and the options' one-line errors (a tiny
random Llama: seconds)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from typer.testing import CliRunner  # noqa: E402

from pnmix.cli import app  # noqa: E402
from pnmix.hf.evaluate.inputs import Text  # noqa: E402
from pnmix.hf.evaluate.methods import METHODS, REFERENCE  # noqa: E402
from pnmix.hf.evaluate.passkey import (  # noqa: E402
    CLASSIC_FILLER, HEADER, NEEDLE, REFERENCE_PASS, VARIANTS, cell_rows, classic_filler, haystack, passkey_key,
    text_filler,
)

BYTES = Text()  # UTF-8 bytes as ids: a token is a character, so positions read as text


def invoke(*args):
    result = CliRunner().invoke(app, ["eval", *map(str, args)])
    return result, [line for line in result.output.splitlines() if line.strip()]


def assert_one_line_error(result, lines, message):
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_1k_dir):
    return tiny_llama_1k_dir


def test_the_classic_haystack_is_the_filler_sentence_repeated():
    filler = classic_filler(BYTES, 2000)
    assert filler.name == "classic" and filler.unit == len(" " + CLASSIC_FILLER) and len(filler.ids) >= 2000
    text = BYTES.decode(filler.ids)
    assert text == (" " + CLASSIC_FILLER) * (len(filler.ids) // filler.unit)
    assert text.count("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.") \
        == len(filler.ids) // filler.unit


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
def test_the_needle_sits_at_its_depth_between_two_filler_sentences(depth):
    filler = classic_filler(BYTES, 3000)
    key = passkey_key(0, 2000, depth, 0)
    hay = haystack(BYTES, filler, 2000, depth, key, VARIANTS["passkey"].answer_tokens)
    header, needle = BYTES.encode(HEADER), BYTES.encode(NEEDLE.format(key=key))
    room = len(hay.prefix) + len(hay.suffix) - len(header) - len(needle)
    before = len(hay.prefix) - len(header)
    assert hay.prefix[:len(header)] == header and hay.suffix[:len(needle)] == needle
    assert before % filler.unit == 0 and abs(before - depth * room) <= filler.unit  # whole sentences before it
    assert BYTES.decode(hay.prefix[len(header):]).count(CLASSIC_FILLER) == before // filler.unit
    if before < room - filler.unit:
        assert BYTES.decode(hay.suffix[len(needle):]).startswith(" " + CLASSIC_FILLER)
    assert len(hay.prefix) + len(hay.suffix) + len(hay.question) + VARIANTS["passkey"].answer_tokens == 2000


def test_a_text_haystack_puts_the_needle_at_the_token_of_its_depth():
    ids = BYTES.encode("To be, or not to be, that is the question. " * 80)
    hay = haystack(BYTES, text_filler(ids), 1500, 0.3, "12345")
    header, needle = BYTES.encode(HEADER), BYTES.encode(NEEDLE.format(key="12345"))
    room = 1500 - len(header) - len(needle) - len(hay.question) - 8
    assert hay.prefix == header + ids[:round(0.3 * room)]
    assert hay.suffix == needle + ids[round(0.3 * room):room]


def test_long_keys_have_every_digit_and_differ_per_trial():
    digits = VARIANTS["passkey-long"].key_digits
    keys = [passkey_key(0, 4096, 0.5, trial, digits) for trial in range(10)]
    assert all(len(k) == digits and k.isdigit() and k[0] != "0" for k in keys) and len(set(keys)) == 10
    assert keys == [passkey_key(0, 4096, 0.5, trial, digits) for trial in range(10)]  # seeded
    assert len(passkey_key(0, 4096, 0.5, 0)) == 5 and VARIANTS["passkey-long"].answer_tokens > digits


@pytest.mark.parametrize("reference_right, flagged", [(10, False), (9, False), (8, True), (0, True)])
def test_a_cell_is_flagged_where_the_reference_is_right_on_fewer_than_nine_in_ten(reference_right, flagged):
    methods = [METHODS[REFERENCE], METHODS["pnmix"], METHODS["kivi2-g128"]]
    right = {REFERENCE: reference_right, "pnmix": 10, "kivi2-g128": 3}
    rows = cell_rows(VARIANTS["passkey"], classic_filler(BYTES, 100), methods, 4096, 0.5, right, 10)
    assert [r["method"] for r in rows] == [REFERENCE, "pnmix", "kivi2-g128"]
    assert [r["accuracy"] for r in rows] == [reference_right / 10, 1.0, 0.3]
    assert all(r["reference_fails"] is flagged and r["reference_accuracy"] == reference_right / 10 for r in rows)
    assert (reference_right / 10 < REFERENCE_PASS) is flagged


def test_both_tasks_on_a_random_model_report_and_flag_the_reference(tiny_dir, tmp_path):
    out = tmp_path / "pk.json"
    result, lines = invoke(tiny_dir, "--task", "passkey,passkey-long", "--methods", "pnmix", "--lengths", 600,
                           "--depths", "0.2,0.8", "--trials", 2, "--json", out)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["passkey"]
    assert {(r["task"], r["key_digits"]) for r in rows} == {("passkey", 5), ("passkey-long", 20)}
    assert all(r["haystack"] == "classic" and r["trials"] == 2 for r in rows)
    for row in rows:
        reference = next(r for r in rows if r["method"] == REFERENCE and r["task"] == row["task"]
                         and r["depth"] == row["depth"] and r["length"] == row["length"])
        assert row["reference_accuracy"] == reference["accuracy"]
        assert row["reference_fails"] == (reference["accuracy"] < REFERENCE_PASS)
    flagged = [r for r in rows if r["reference_fails"]]
    assert bool(flagged) == ("the reference fails at" in result.output)
    for row in flagged:  # the table names the failed cells
        assert f"d={row['depth']:g}" in result.output


def test_the_text_haystack_reads_the_text(tiny_dir, tmp_path):
    text, out = tmp_path / "hay.txt", tmp_path / "pk.json"
    text.write_text("Some words about nothing at all. " * 60)
    result, _ = invoke(tiny_dir, "--task", "passkey", "--haystack", "text", "--text", text, "--methods", "pnmix",
                       "--lengths", 500, "--depths", 0.5, "--trials", 1, "--json", out)
    assert result.exit_code == 0, result.output
    assert {r["haystack"] for r in json.loads(out.read_text())["passkey"]} == {"text"}


@pytest.mark.parametrize("args, message", [
    (["--haystack", "hamlet"], "--haystack must be one of classic, text, got 'hamlet'"),
    (["--trials", 0], "--trials must be at least 1"),
    (["--task", "passkey-longer"], "--task must be a comma list of kl, passkey, passkey-long"),
    (["--lengths", 200], "--lengths 200 is too short for the passkey prompt"),
    (["--task", "passkey-long", "--lengths", 290], "--lengths 290 is too short for the passkey prompt"),
    (["--haystack", "text", "--text", "SHORT"], "the text has"),
    (["--depths", "0.5,x"], "--depths must be a comma list of numbers in [0, 1]"),
])
def test_bad_passkey_options_are_one_line(args, message, tiny_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.")
    args = [short if a == "SHORT" else a for a in args]
    assert_one_line_error(*invoke(tiny_dir, "--task", "passkey", "--lengths", 600, *args), message)


# ---- --resume: keys an earlier report asked are not asked again ----------------------------------
RESUME_ARGS = ("--task", "passkey,passkey-long", "--methods", "pnmix", "--lengths", 600, "--depths", "0.2,0.8")


def counting_answers(monkeypatch, stop_after=None):
    """Count the answers asked (and raise KeyboardInterrupt at answer ``stop_after``: a killed run)."""
    from pnmix.hf.evaluate import passkey

    asked, real = [], passkey.answer

    def answer(*args, **kwargs):
        if stop_after is not None and len(asked) == stop_after:
            raise KeyboardInterrupt
        asked.append(args[1].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(passkey, "answer", answer)
    return asked


def cells(path):
    return sorted((r["task"], r["method"], r["length"], r["depth"], r["trials"], r["accuracy"])
                  for r in json.loads(path.read_text())["passkey"])


def test_resume_asks_only_the_keys_the_earlier_report_lacks(tiny_dir, tmp_path, monkeypatch):
    fresh, first, more = tmp_path / "fresh.json", tmp_path / "first.json", tmp_path / "more.json"
    assert invoke(tiny_dir, *RESUME_ARGS, "--trials", 3, "--json", fresh)[0].exit_code == 0
    assert invoke(tiny_dir, *RESUME_ARGS, "--trials", 1, "--json", first)[0].exit_code == 0
    asked = counting_answers(monkeypatch)
    result, _ = invoke(tiny_dir, *RESUME_ARGS, "--trials", 3, "--resume", first, "--json", more)
    assert result.exit_code == 0, result.output
    assert len(asked) == 2 * 2 * 2 * 2  # tasks x depths x methods x the two keys the first run lacked
    assert cells(more) == cells(fresh) and "answers from --resume" in result.output


def test_an_interrupted_run_resumes_from_its_own_report(tiny_dir, tmp_path, monkeypatch):
    fresh, out = tmp_path / "fresh.json", tmp_path / "out.json"
    assert invoke(tiny_dir, *RESUME_ARGS, "--trials", 2, "--json", fresh)[0].exit_code == 0
    counting_answers(monkeypatch, stop_after=5)  # killed in the second cell
    assert invoke(tiny_dir, *RESUME_ARGS, "--trials", 2, "--json", out)[0].exit_code != 0
    saved = json.loads(out.read_text())["passkey"]
    assert [(r["depth"], r["trials"]) for r in saved] == [(0.2, 2), (0.2, 2)]  # the one finished cell
    monkeypatch.undo()
    asked = counting_answers(monkeypatch)
    result, _ = invoke(tiny_dir, *RESUME_ARGS, "--trials", 2, "--resume", out, "--json", out)
    assert result.exit_code == 0, result.output
    assert len(asked) == 3 * 2 * 2 and cells(out) == cells(fresh)  # the three cells it had not finished


def test_a_resumed_cell_that_asked_more_keys_runs_again(tiny_dir, tmp_path, monkeypatch):
    first, out = tmp_path / "first.json", tmp_path / "out.json"
    assert invoke(tiny_dir, *RESUME_ARGS, "--trials", 2, "--json", first)[0].exit_code == 0
    asked = counting_answers(monkeypatch)
    result, _ = invoke(tiny_dir, *RESUME_ARGS, "--trials", 1, "--resume", first, "--json", out)
    assert result.exit_code == 0, result.output
    assert len(asked) == 4 * 2 and all(r["trials"] == 1 for r in json.loads(out.read_text())["passkey"])


@pytest.mark.parametrize("change, message", [
    (["--seed", 1], "was run with seed 0, this run with 1: its keys are other prompts"),
    (["--haystack", "text"], "was run with haystack 'classic', this run with 'text'"),
    (["--config", "CONFIG"], "ran method config with other settings"),
])
def test_resume_refuses_a_report_of_another_setup(change, message, tiny_dir, tmp_path):
    first, config, other = tmp_path / "first.json", tmp_path / "a.json", tmp_path / "b.json"
    config.write_text(json.dumps({"value_bits": 2}))
    other.write_text(json.dumps({"value_bits": 3}))
    args = ("--task", "passkey", "--methods", "pnmix", "--lengths", 600, "--depths", 0.5, "--trials", 1)
    assert invoke(tiny_dir, *args, "--config", config, "--json", first)[0].exit_code == 0
    change = [other if a == "CONFIG" else a for a in change]
    assert_one_line_error(*invoke(tiny_dir, *args, *change, "--resume", first), message)


@pytest.mark.parametrize("content, message", [
    ('{"results": []}', "is not a `pnmix eval --json` report (no passkey rows)"),
    ('{"passkey": []}', "does not record its passkey setup"),
    ('[1, 2', "JSON"),
])
def test_resume_refuses_a_file_that_is_no_report(content, message, tiny_dir, tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(content)
    assert_one_line_error(*invoke(tiny_dir, "--task", "passkey", "--lengths", 600, "--resume", earlier), message)
