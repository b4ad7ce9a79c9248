"""tools/loop_profile.py: a decode step's loops under Linux perf (the sampling clock of the kernel)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pnmix._native import library_status

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import loop_profile  # noqa: E402  (tools/ is not a package)

core_ok, core_reason = library_status("pnmix_core")


def perf_can_record() -> tuple[bool, str]:
    perf = shutil.which("perf")
    if perf is None:
        return False, "Linux perf is not installed"
    done = subprocess.run([perf, "record", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"],
                          capture_output=True, text=True)
    return done.returncode == 0, f"perf record cannot sample here: {done.stderr.strip()[-200:]}"


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "loop_profile.py"), *args],
                          capture_output=True, text=True, timeout=600)


def test_report_lines_are_read_by_their_tab_separated_fields():
    text = ("# Overhead\tShared Object\tSymbol\n"
            " 24.44% \tlibpnmix_core.so    \t[.] pnmix::(anonymous namespace)::attend_group  \t-   -\n"
            "  1.71% \tlibpython3.11.so.1.0\t[.] _PyEval_EvalFrameDefault\t-   -\n"
            " 0.60% \tlibtorch_cpu.so\t[.] at::f<float, true>::operator()(long, long)\t-\n"
            "\n#\n")
    assert loop_profile.parse_report(text) == [
        (24.44, "libpnmix_core.so", "pnmix::(anonymous namespace)::attend_group"),
        (1.71, "libpython3.11.so.1.0", "_PyEval_EvalFrameDefault"),
        (0.6, "libtorch_cpu.so", "at::f<float, true>::operator()(long, long)"),
    ]


def test_loops_close_at_backward_jumps_and_count_the_512_bit_copies():
    listing = """
    Percent |      Source code & Disassembly
    0.00 :   100: mov    %rdi,%rax
    1.00 :   104: vmovaps %zmm1,%zmm2
   10.00 :   10a: vfmadd132ps %zmm3,%zmm4,%zmm2
   20.00 :   110: vmovdqa64 %zmm2,%zmm5
    5.00 :   116: vmovaps %zmm1,(%rax)
    4.00 :   11c: jne    10a <f+0xa>
    2.00 :   122: add    $0x1,%rax
    3.00 :   126: jl     104 <f+0x4>
    0.00 :   12a: jmp    200 <f+0x100>
"""
    rows = loop_profile.parse_annotate(listing)
    assert [address for address, _, _ in rows] == [0x100, 0x104, 0x10A, 0x110, 0x116, 0x11C, 0x122, 0x126, 0x12A]
    found = loop_profile.loops(rows)
    assert [(loop.header, loop.back_edge) for loop in found] == [(0x104, 0x126), (0x10A, 0x11C)]
    outer, inner = found
    assert outer.share == pytest.approx(45.0) and outer.instructions == 7
    assert inner.share == pytest.approx(39.0) and inner.instructions == 4
    # register to register only: the store of zmm1 at 116 is not a copy
    assert outer.zmm_copies == 2 and inner.zmm_copies == 1
    assert loop_profile.innermost(found) == [inner]


def test_a_header_with_two_backward_jumps_is_one_loop_up_to_the_farthest():
    listing = """
   10.00 :   200: vpdpbusd %zmm1,%zmm2,%zmm3
   20.00 :   206: je     200 <g>
   30.00 :   20c: vpaddd %zmm3,%zmm4,%zmm4
   40.00 :   212: jne    200 <g>
    0.00 :   218: jmp    100 <g-0x100>
"""
    found = loop_profile.loops(loop_profile.parse_annotate(listing))
    assert [(loop.header, loop.back_edge, loop.share) for loop in found] == [(0x200, 0x212, 100.0)]
    assert loop_profile.innermost(found) == found  # (the jump to 100 leaves the function's listing)


def test_a_folder_without_the_library_is_refused_in_one_line(tmp_path):
    done = tool(f"{tmp_path}::int8", "--seconds", "1")
    assert done.returncode == 2
    assert "no libpnmix_core" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not core_ok, reason=core_reason)
def test_a_short_profile_names_the_kernel_and_its_loops():
    ok, reason = perf_can_record()
    if not ok:
        pytest.skip(reason)
    done = tool("--context", "2048", "--threads", "1", "--seconds", "1", "--functions", "2", "--loops", "3")
    assert done.returncode == 0, done.stderr
    assert "calls, kernel" in done.stdout
    assert "libpnmix_core" in done.stdout  # the kernel's functions are among the top ones
    assert "512-bit register copies" in done.stdout  # printed for a loop found, not for none


def test_a_bad_arithmetic_is_the_childs_one_line_error():
    ok, reason = perf_can_record()
    if not ok:
        pytest.skip(reason)
    done = tool("::int9", "--context", "256", "--seconds", "0.2")
    assert done.returncode == 1
    assert done.stderr.startswith("error: the profiled call failed:") and "int9" in done.stderr
    assert "Traceback" not in done.stderr
