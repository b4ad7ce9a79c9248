"""tools/pipe_mix.cc: which vector instructions take vpdpbusd's slots. Built with the command its
header documents; it runs where the CPU has AVX-512 VNNI and VBMI, and elsewhere names what it lacks."""

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pnmix.machine import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools/pipe_mix.cc"
HAS_VNNI = {"avx512vbmi", "avx512_vnni"} <= cpu_flags()
NUMBER = r"(-?[0-9]+\.[0-9]+)"
ROW = re.compile(rf"^(\w+)\s+{NUMBER}\s+{NUMBER}$")

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instructions"),
]


def listed_instructions() -> list[str]:
    """The instructions of the tool's table, in its order, as its source lists them."""
    return re.findall(r"^\s*X\((\w+), ", TOOL.read_text(), flags=re.MULTILINE)


@pytest.fixture(scope="module")
def program(tmp_path_factory, documented_tool) -> Path:
    return documented_tool(TOOL, tmp_path_factory.mktemp("pipe_mix"))


def test_the_documented_command_builds_with_vnni_and_vbmi(tool_flags):
    flags = tool_flags(TOOL)
    assert "-mavx512vnni" in flags and "-mavx512vbmi" in flags, flags


def test_prints_a_row_per_instruction_or_names_the_missing_ones(program):
    done = subprocess.run([str(program), "1"], capture_output=True, text=True, timeout=120)
    if not HAS_VNNI:
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.strip().startswith("error: this CPU has no AVX-512 VNNI")
        return
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.match(rf"^12 independent vpdpbusd: {NUMBER} ticks an iteration \(best of 1 runs\)$", lines[0])
    rows = [m[1] for line in lines[2:] if (m := ROW.match(line))]
    assert rows == listed_instructions() and rows[0] == "vpdpbusd" and len(rows) == len(lines) - 2


@pytest.mark.parametrize("rounds", ["0", "-1", "many", "3x", "1e2", "", "1001", "99999999999999999999"])
def test_refuses_a_bad_round_count(program, rounds):
    done = subprocess.run([str(program), rounds], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"error: rounds must be an integer from 1 to 1000, got '{rounds}'"


def test_refuses_extra_arguments(program):
    done = subprocess.run([str(program), "2", "3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: one argument at most (rounds), got 2"
