"""plugins/ort/ort_c_api.h against the official onnxruntime_c_api.h: the same offsets program
(plugins/ort/abi_offsets.cc) built against each prints offsetof(OrtApi, X) for every slot pnmix
calls and OrtCustomOp's field offsets; the two listings must agree on every name the official
header has. The official header is not in the repository (the wheel ships none): put it at
third_party/onnxruntime/include/onnxruntime_c_api.h (git-ignored), or set ONNXRUNTIME_INCLUDE_DIR."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_INCLUDE = REPO / "third_party" / "onnxruntime" / "include"


def official_include():
    folder = Path(os.environ.get("ONNXRUNTIME_INCLUDE_DIR", DEFAULT_INCLUDE))
    return folder if (folder / "onnxruntime_c_api.h").is_file() else None


def offsets(binary):
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return dict((name, int(value)) for name, value in (line.split() for line in out.splitlines()))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    include = official_include()
    if include is None:
        pytest.skip(f"no official onnxruntime_c_api.h (looked in ONNXRUNTIME_INCLUDE_DIR and {DEFAULT_INCLUDE})")
    if not shutil.which("cmake"):
        pytest.skip("cmake not found")
    build = tmp_path_factory.mktemp("ort_abi")
    subprocess.run(["cmake", "-S", str(REPO / "plugins"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DPNMIX_BUILD_CUDA=OFF", "-DPNMIX_BUILD_TRT=OFF", "-DPNMIX_BUILD_EXAMPLES=OFF",
                    f"-DONNXRUNTIME_INCLUDE_DIR={include}"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "pnmix_ort_abi_ours", "pnmix_ort_abi_official"],
                   check=True, capture_output=True)
    return offsets(build / "ort" / "pnmix_ort_abi_ours"), offsets(build / "ort" / "pnmix_ort_abi_official")


def test_every_called_slot_and_custom_op_field_sits_where_the_official_header_puts_it(builds):
    ours, official = builds
    assert set(official) <= set(ours)
    assert {name: ours[name] for name in official} == official
