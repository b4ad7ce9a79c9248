"""Fixtures of the tests that build a C++ program from libpnmix_core's kernel sources with g++
(tools/loop_bench.cc, tests/backends/exp_accuracy.cc): one place for the compiler's command."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kernel_options(kernel: str) -> list[str]:
    """The COMPILE_OPTIONS that plugins/CMakeLists.txt gives a kernel file (e.g. attend_avx2.cc)."""
    text = (ROOT / "plugins/CMakeLists.txt").read_text()
    settings = r"set_source_files_properties\(([^)]*?)PROPERTIES\s+COMPILE_OPTIONS\s+\"([^\"]+)\""
    for sources, options in re.findall(settings, text):
        if f"src/{kernel}" in sources.split():
            return options.split(";")
    raise AssertionError(f"plugins/CMakeLists.txt gives {kernel} no COMPILE_OPTIONS")


def build_with_kernels(source: Path, flags: list[str], out: Path) -> Path:
    """g++ FLAGS source -o out, with the kernels' headers and sources on the include path."""
    done = subprocess.run(["g++", *flags, f"-I{ROOT / 'plugins/src'}", f"-I{ROOT / 'plugins/include'}", str(source),
                           "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="session")
def cmake_kernel_options():
    """kernel_options(kernel): a kernel file's flags as the library's build gives them."""
    return kernel_options


@pytest.fixture(scope="session")
def build_kernel_program():
    """build_with_kernels(source, flags, out) -> out."""
    return build_with_kernels
