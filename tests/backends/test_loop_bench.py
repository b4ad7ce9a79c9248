"""tools/loop_bench.cc: the VNNI kernel's product loops alone. It includes the kernel's source, so a
change to the kernel that breaks it fails here, on any x86 machine with g++; it runs where the CPU
has AVX-512 VNNI and VBMI."""

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pnmix.machine import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools/loop_bench.cc"


NS_LINE = re.compile(r"^(key|value) products .*: (\d+) ticks, ([0-9.]+) ns per group$")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 kernel's loops"),
]


HAS_VNNI = {"avx512vbmi", "avx512_vnni"} <= cpu_flags()  # what the tool's kernel needs


@pytest.fixture(scope="module")
def program(tmp_path_factory, documented_tool) -> Path:
    return documented_tool(TOOL, tmp_path_factory.mktemp("loop_bench"))


def test_the_documented_command_builds_the_vnni_kernel_optimized(tool_flags):
    flags = tool_flags(TOOL)
    assert "-mavx512vnni" in flags and "-O3" in flags, flags


def test_runs_or_names_the_missing_instructions(program):
    done = subprocess.run([str(program), "50"], capture_output=True, text=True, timeout=120)
    if not HAS_VNNI:
        assert done.returncode == 1
        assert done.stderr.strip().startswith("error: this CPU has no AVX-512 VNNI")
        return
    assert done.returncode == 0, done.stderr
    found = {m[1]: float(m[3]) for line in done.stdout.splitlines() if (m := NS_LINE.match(line))}
    assert set(found) == {"key", "value"}
    assert all(ns > 0 for ns in found.values())


def test_reads_and_writes_only_its_buffers(tmp_path_factory, documented_tool):
    # AddressSanitizer over the kernel's loops on the tool's group: the wide key loads' reach past a
    # chunk must stay inside the codes' buffer (the tool once sized it for a layout without high
    # channels and read 2 KiB past it, unseen)
    if not HAS_VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI and VBMI, the kernel these loops belong to")
    sanitizers = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
    program = documented_tool(TOOL, tmp_path_factory.mktemp("loop_bench_asan"), sanitizers)
    done = subprocess.run([str(program), "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Sanitizer" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("calls", ["0", "-3", "many", "12x", "1e3", "", "100000001", "99999999999999999999"])
def test_refuses_a_bad_call_count(program, calls):
    done = subprocess.run([str(program), calls], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: calls must be an integer from 1 to 100000000, got '{calls}'"
    assert done.stdout == ""


def test_refuses_extra_arguments(program):
    done = subprocess.run([str(program), "5", "6"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: one argument at most (calls), got 2"
