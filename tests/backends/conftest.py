"""Fixtures of the tests that build C++ themselves: programs with g++ (tools/loop_bench.cc and
tests/backends/exp_accuracy.cc from libpnmix_core's kernel sources, tools/pipe_mix.cc) and variants
of libpnmix_core with CMake (the phase timers, AddressSanitizer): one place for each command and for
reading a tool's documented one."""

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


def build_core_variant(build: Path, *options: str) -> Path:
    """libpnmix_core alone (no CUDA, TensorRT or examples) configured with extra CMake options into
    the folder build, which is returned."""
    for step in (["cmake", "-S", str(ROOT / "plugins"), "-B", str(build), *options,
                  "-DPNMIX_BUILD_CUDA=OFF", "-DPNMIX_BUILD_TRT=OFF", "-DPNMIX_BUILD_EXAMPLES=OFF"],
                 ["cmake", "--build", str(build), "--target", "pnmix_core", "-j", "2"]):
        done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return build


@pytest.fixture(scope="session")
def core_variant():
    """build_core_variant(build, *cmake_options) -> build."""
    return build_core_variant


@pytest.fixture(scope="session")
def tool_flags():
    """documented_flags(tool): the flags of a tool's documented build command."""
    return documented_flags


@pytest.fixture(scope="session")
def documented_tool():
    """build(tool, folder, extra_flags=()) -> the tool built with its documented flags (then extra_flags,
    whose -O replaces the documented one) as folder/<tool's stem>."""
    def build(tool: Path, folder: Path, extra_flags: tuple[str, ...] = ()) -> Path:
        flags = documented_flags(tool)
        if any(f.startswith("-O") for f in extra_flags):
            flags = [f for f in flags if not f.startswith("-O")]
        return build_with_kernels(tool, [*flags, *extra_flags], folder / tool.stem)
    return build


@pytest.fixture(scope="session")
def cmake_kernel_options():
    """kernel_options(kernel): a kernel file's flags as the library's build gives them."""
    return kernel_options


@pytest.fixture(scope="session")
def build_kernel_program():
    """build_with_kernels(source, flags, out) -> out."""
    return build_with_kernels
