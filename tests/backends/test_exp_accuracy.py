"""The kernels' exponentials, measured: vexp (the fp32 path's softmax) and vexp_coarse (the integer
path's, whose probabilities are rounded to 8-bit levels). A wrong coefficient in vexp_coarse moves
the integer path's outputs by less than its rounding does (verify and the tests against the
reference did not see an error of 1.7%), so its accuracy is held here, against libm's double exp, by
tests/backends/exp_accuracy.cc built from each kernel file with that file's flags in
plugins/CMakeLists.txt."""

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pnmix.machine import cpu_flags

PROGRAM = Path(__file__).with_name("exp_accuracy.cc")
# (kernel file, the CPU flags it runs on)
KERNELS = [("attend_avx2.cc", {"avx2", "fma", "f16c"}),
           ("attend_avx512vnni.cc", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni"})]
# the largest relative errors allowed, near the maximum (x in [-16, 0]) and over [-87, 0]
BOUNDS = {"vexp": (2e-7, 2e-7), "vexp_coarse": (3.5e-6, 5e-6)}
LINE = re.compile(r"^(\w+) near (\S+) all (\S+) edges (\w+)$")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86 kernels' exponentials"),
]


@pytest.mark.parametrize("kernel, needs", KERNELS, ids=[k for k, _ in KERNELS])
def test_the_exponentials_are_as_accurate_as_their_comments_say(kernel, needs, tmp_path, cmake_kernel_options,
                                                                build_kernel_program):
    flags = ["-O3", "-DNDEBUG", *cmake_kernel_options(kernel), f'-DKERNEL="{kernel}"']
    out = build_kernel_program(PROGRAM, flags, tmp_path / "exp_accuracy")
    if not needs <= cpu_flags():
        pytest.skip(f"built; this CPU lacks {sorted(needs - cpu_flags())} to run the {kernel} build")
    done = subprocess.run([str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = {m[1]: (float(m[2]), float(m[3]), m[4]) for line in done.stdout.splitlines() if (m := LINE.match(line))}
    assert set(found) == set(BOUNDS), done.stdout
    for name, (near, everywhere) in BOUNDS.items():
        assert found[name][0] <= near and found[name][1] <= everywhere, (name, found[name])
        assert found[name][2] == "ok", f"{name}: not exactly 0 below -87 and for -inf, or not NaN for NaN"
