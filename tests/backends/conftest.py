"""Fixtures of the tests that build a C++ program with g++ (tools/loop_bench.cc and
tests/backends/exp_accuracy.cc from libpnmix_core's kernel sources, tools/pipe_mix.cc): one place for
the compiler's command and for reading a tool's documented one."""

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


def documented_flags(tool: Path) -> list[str]:
    """The compiler flags of the `g++ ... -o` build command in a tool's header comment: its test
    builds it the way its users are told to."""
    header = tool.read_text().split("\n#include", 1)[0]
    command = header[header.index("//   g++") :]
    command = command[: command.index(" -o ")]
    return [word for word in command.replace("//", " ").split() if word.startswith(("-O", "-D", "-m"))]


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
def tool_flags():
    """documented_flags(tool): the flags of a tool's documented build command."""
    return documented_flags


@pytest.fixture(scope="session")
def build_kernel_program():
    """build_with_kernels(source, flags, out) -> out."""
    return build_with_kernels
