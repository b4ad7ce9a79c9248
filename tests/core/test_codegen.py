"""plugins/include/pnmix/generated.h is pnmix/codegen.py's output for the Python of today: the C++
side (params.h, format.h, plugin_fields.h, the C ABIs, the plugins, the example) reads every shared
fact from it, so a stale copy would let the two sides disagree."""

import re
from pathlib import Path

from pnmix import codegen, config, dump
from pnmix import format as fmt

# The checked-in header of this checkout (the tests may run against an installed pnmix).
HEADER = Path(__file__).resolve().parents[2] / "plugins" / "include" / "pnmix" / "generated.h"


def test_generated_header_is_current():
    assert HEADER.read_text(encoding="utf-8") == codegen.render(), (
        "plugins/include/pnmix/generated.h is stale: run `python -m pnmix.codegen --write`")


def test_generated_header_states_the_python_facts():
    text = codegen.render()
    fields = re.findall(r"^  X\((\w+), (RATIO|INT|LAYOUT)\)", text, re.M)
    assert [name for name, _ in fields] == list(config.CONFIG_FIELDS)
    assert dict(fields)["high_ratio"] == "RATIO" and dict(fields)["pair_layout"] == "LAYOUT"
    assert f"#define PNMIX_MAX_SEQ_LEN {config.MAX_SEQ_LEN}LL" in text
    states = re.findall(r"^  X\((\d+), \w+, (\w+), (\d), (\w+)\)", text, re.M)
    assert [name for _, name, _, _ in states] == list(fmt.STATE_NAMES)
    assert {name: int(size) for _, name, size, _ in states} == {n: d.itemsize for n, d in fmt.STATE_DTYPES.items()}
    offsets = dict(re.findall(r"^#define PNMIX_DUMP_AT_(\w+) (\d+)", text, re.M))
    assert int(offsets["HIGH_RATIO"]) == 44 and int(offsets["SEQ_LEN"]) == 52  # docs/FORMAT.md section 6
    assert f"#define PNMIX_DUMP_HEADER_BYTES {dump.DUMP_HEADER_BYTES}" in text and dump.DUMP_HEADER_BYTES == 64


def test_dump_header_offsets_follow_the_table():
    offsets = dump.dump_header_offsets()
    assert list(offsets) == [name for name, _ in dump.DUMP_HEADER_FIELDS]
    assert offsets["magic"] == 0 and offsets["pair_layout"] == 27 and offsets["reserved1"] == 60
