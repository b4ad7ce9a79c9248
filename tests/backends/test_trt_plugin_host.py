"""libpnmix_trt_plugins driven as TensorRT drives it, on a CPU machine with TensorRT's headers only.

plugins/trt/plugin_probe.cpp (target pnmix_trt_probe) dlopens the plugin library and makes the calls
TensorRT's builder and runtime make: creators, fields from an exported node, capabilities, output
types and shapes, format support, configure, workspace, serialize -> runtime create, tampered
fields, and an enqueue that must fail cleanly without a GPU. Both are built only when CMake is given
-DTENSORRT_INCLUDE_DIR (docs/TENSORRT.md); elsewhere this test skips.
"""

import subprocess

import pytest

from pnmix import _native


def test_plugin_library_behaves_as_tensorrt_expects_without_a_gpu():
    library, reason = _native.find_library("pnmix_trt_plugins")
    if library is None:
        pytest.skip(f"libpnmix_trt_plugins is built only with TensorRT headers (-DTENSORRT_INCLUDE_DIR): {reason}")
    probe = library.parent / "pnmix_trt_probe"
    if not probe.is_file():
        pytest.skip(f"pnmix_trt_probe is not built next to {library}")
    result = subprocess.run([str(probe), str(library)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED: 0 failure(s)" in result.stdout
    assert "FAIL " not in result.stdout
