"""libpnmix_core under AddressSanitizer. The kernels read codes with wide loads that may reach a few
bytes past a chunk, and only where those bytes still lie inside the buffer they were handed
(attend_kernel.inc's GroupTensors::key_codes_tail); the core's own tests check outputs, which an
over-read into readable memory does not change. So this builds the library with -fsanitize=address
(a minute or two on two cores) and runs, in child processes with the sanitizer's runtime preloaded:
tests/backends/sanitized_caches.py (caches with every group slot full, every kernel this CPU has,
fp32 and int8), the core backend's tests and the paged-state tests. Any read or write outside a
buffer aborts the child with the sanitizer's report, and the test shows it."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sanitizer_runtime() -> Path | None:
    """g++'s AddressSanitizer runtime, or None (g++ then prints the bare name back)."""
    if shutil.which("g++") is None:
        return None
    name = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    path = Path(name)
    return path.resolve() if path.is_absolute() and path.exists() else None


RUNTIME = sanitizer_runtime()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="x86-64 Linux"),
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed"),
    pytest.mark.skipif(RUNTIME is None, reason="g++ has no AddressSanitizer runtime (libasan)"),
]


@pytest.fixture(scope="module")
def sanitized_library(tmp_path_factory, core_variant) -> Path:
    return core_variant(tmp_path_factory.mktemp("asan"), "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                        "-DCMAKE_CXX_FLAGS=-fsanitize=address -fno-omit-frame-pointer",
                        "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address")


def run_sanitized(folder: Path, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH: the pnmix of this checkout, as the library is built from it, not an installed one
    env = {**os.environ, "PNMIX_LIB_DIR": str(folder), "LD_PRELOAD": str(RUNTIME), "PYTHONPATH": str(ROOT),
           # Python's own allocations are not the subject (leaks); the first bad access stops the run.
           # torch's pages, not the huge-page mapping, which the sanitizer does not track
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1", "PNMIX_HUGE_PAGES": "0"}
    env.pop("PNMIX_ATTEND_ARITH", None)  # each case picks its arithmetic
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)


def test_full_caches_on_every_kernel_touch_only_their_buffers(sanitized_library):
    done = run_sanitized(sanitized_library, str(ROOT / "tests/backends/sanitized_caches.py"))
    assert done.returncode == 0 and "Sanitizer" not in done.stderr, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "done" and any(" int8 on " in line for line in lines), done.stdout[-2000:]


def test_the_core_and_paged_tests_pass_under_the_sanitizer(sanitized_library):
    done = run_sanitized(sanitized_library, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                         "tests/backends/test_core.py", "tests/vllm/test_paged.py")
    assert done.returncode == 0 and "Sanitizer" not in done.stderr + done.stdout, (done.stdout + done.stderr)[-4000:]
