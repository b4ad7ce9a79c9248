"""tools/phase_times.py and the profiling build of libpnmix_core it reads (cmake -DPNMIX_PHASE_TIMES=ON).

The slow test builds that library (about a minute on two cores) and checks that its timers leave the
outputs bitwise as they were and print every phase.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pnmix._native import find_library, library_status

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import phase_times  # noqa: E402  (tools/ is not a package)

PHASES = ["setup", "key_weights", "key_scores", "softmax", "value_weights", "values", "tail"]
core_ok, core_reason = library_status("pnmix_core")
needs_core = pytest.mark.skipif(not core_ok, reason=core_reason)


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "phase_times.py"), *args],
                          capture_output=True, text=True, timeout=600)


def test_parse_reads_the_exit_lines_and_nothing_else():
    text = ("noise\npnmix phase times: 8 groups, 2.5000 ticks per ns\n"
            "pnmix phase setup 80\npnmix phase values 160\n")
    assert phase_times.parse(text) == (8, 2.5, {"setup": 80, "values": 160})
    assert phase_times.parse("pnmix phase times: 0 groups, 1.0 ticks per ns\n") is None
    assert phase_times.parse("") is None


@needs_core
def test_a_normal_build_is_refused_in_one_line():
    folder = find_library("pnmix_core")[0].parent
    run = tool(f"{folder}:auto:fp32", "--context", "1024", "--blocks", "1")
    assert run.returncode == 1
    assert run.stderr.strip().count("\n") == 0
    assert "not a PNMIX_PHASE_TIMES build" in run.stderr


def test_a_missing_folder_is_a_usage_error(tmp_path):
    run = tool(str(tmp_path / "none"))
    assert run.returncode == 2 and "no such folder" in run.stderr


def test_a_folder_without_the_library_is_a_usage_error(tmp_path):
    run = tool(str(tmp_path), "--context", "1024", "--blocks", "1")  # not another build found elsewhere
    assert run.returncode == 2 and "no libpnmix_core" in run.stderr


def test_core_ab_refuses_a_folder_without_the_library(tmp_path):
    # the loader would go on searching and time another build under this folder's name
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "core_ab.py"), f"{tmp_path}:auto:int8",
                          "--context", "1024", "--blocks", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "no libpnmix_core" in run.stderr
    assert "outputs bitwise equal" not in run.stdout


@needs_core
def test_core_ab_times_torch_threads_against_the_pool_and_refuses_other_names():
    folder = str(find_library("pnmix_core")[0].parent)
    # 8K tokens of the bench shape (4.8 MB): two threads by either rule, so the same split and bits
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "core_ab.py"), f"{folder}::fp32:torch",
                          f"{folder}::fp32:pool", "--context", "8192", "--blocks", "1", "--threads", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "outputs bitwise equal: True" in run.stdout
    assert ":fp32:torch: median" in run.stdout and ":fp32:pool: median" in run.stdout
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "core_ab.py"), f"{folder}::fp32:gpu",
                          "--context", "1024", "--blocks", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "THREADS_ON must be torch or pool" in run.stderr


@needs_core
def test_core_ab_cold_mode_calls_each_builds_own_caches_and_refuses_bad_counts():
    folder = str(find_library("pnmix_core")[0].parent)
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "core_ab.py"), f"{folder}::fp32", f"{folder}::fp32",
                          "--context", "1024", "--blocks", "1", "--layers", "3", "--cold", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "outputs bitwise equal: True" in run.stdout  # each build's copies hold the one cache's bytes
    assert run.stdout.count("3 caches, 1 MB read before each)") == 2
    for bad, message in ((["--layers", "0"], "--layers must be in 1..4096"), (["--cold", "-1"], "--cold must be")):
        run = subprocess.run([sys.executable, str(ROOT / "tools" / "core_ab.py"), f"{folder}::fp32",
                              "--context", "1024", "--blocks", "1", *bad], capture_output=True, text=True, timeout=600)
        assert run.returncode == 2 and message in run.stderr


@pytest.mark.slow  # builds libpnmix_core once more, with the timers
@needs_core
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_the_profiling_build_times_every_phase_and_changes_no_output(tmp_path, core_variant):
    build = core_variant(tmp_path / "phases", "-DPNMIX_PHASE_TIMES=ON")
    normal = find_library("pnmix_core")[0].parent
    for arith in ("fp32", "int8"):
        ab = subprocess.run([sys.executable, str(ROOT / "tools" / "core_ab.py"), f"{normal}:auto:{arith}",
                             f"{build}:auto:{arith}", "--context", "4096", "--blocks", "1"],
                            capture_output=True, text=True, timeout=600)
        assert ab.returncode == 0, ab.stderr[-2000:]
        assert "outputs bitwise equal: True" in ab.stdout
        parsed = phase_times.parse(ab.stderr)
        assert parsed is not None
        groups, rate, phases = parsed
        assert list(phases) == PHASES and groups > 0 and rate > 0
        assert phases["key_scores"] > 0 and phases["values"] > 0
        assert (phases["key_weights"] > 0) == (arith == "int8")  # the fp32 path rounds no weights
        if arith == "fp32":
            assert phases["value_weights"] == 0
    run = tool(f"{build}:auto:int8", "--context", "4096", "--blocks", "1", "--threads", "2")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines[-len(PHASES) - 1:]] == PHASES + ["all"]
    assert lines[-1].endswith("100.0%")
