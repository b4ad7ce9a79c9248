"""`pnmix doctor`: each backend available or not (with the reason), and a quick self-check of
each available one against the PyTorch reference.

The self-check runs a short protocol (the diagnostic model, a small config whose groups get
quantized within a few dozen tokens) through the backend and through the reference, and compares
the packed bytes (identical) and the attention outputs (within the backend's tolerance of
pnmix.verify). Other components' modules are imported lazily: a missing module, library, GPU or
package makes that line "not available" with the reason, never a crash.
"""

from __future__ import annotations

import importlib
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch

from .config import PnMixConfig, RunConfig
from .errors import describe

if TYPE_CHECKING:  # the modules are imported lazily (see the module doc)
    from .backends.base import Backend
    from .cache import CacheOps
    from .protocol import RunResult

# A small run with every part of the cache in use: 4 sink tokens, groups of 16, residual 32.
CHECK_RUN = RunConfig(
    PnMixConfig(group_size=16, residual_size=32, sink_tokens=4, value_group_size=16),
    prefill_tokens=72, decode_tokens=6,
)
CHECK_SEED = 42


@dataclass
class Component:
    name: str
    available: bool
    detail: str  # version / path when available, else the reason
    check: str = "skipped"  # pass, FAIL, skipped
    check_detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# The self-check: a short protocol through a backend vs through the reference
# ---------------------------------------------------------------------------------------

_reference_run: Dict[str, RunResult] = {}  # the reference's run of the check, made once


def _reference():
    if "run" not in _reference_run:
        from .verify import run_seeds

        _reference_run["run"] = run_seeds("torch", CHECK_RUN, [CHECK_SEED], "cpu")[0]
    return _reference_run["run"]


def compare_with_reference(make_backend: Callable[[int, int], Backend], device: str, tolerance: float) -> Tuple[bool, str]:
    from .protocol import run_protocol

    from .verify import compare_runs

    verdict = compare_runs(run_protocol(make_backend, CHECK_RUN, CHECK_SEED, device), _reference(), tolerance)
    diff = max(verdict["max_abs_diff_online"], verdict["max_abs_diff_final"])
    return verdict["passed"], (f"packed bytes {'identical' if verdict['packed_bytes_identical'] else 'DIFFER'}, "
                               f"max |diff| {diff:.2g} (tolerance {tolerance:g})")


def ops_factory(make_ops: Callable[[], CacheOps], device: str):
    from .backends.base import OpsBackend

    ops = make_ops()
    return lambda seed, max_seq_len: OpsBackend(ops, CHECK_RUN.config, seed, max_seq_len, device)


def _run_check(component: Component, check: Callable[[], Tuple[bool, str]]) -> None:
    began = time.perf_counter()
    try:
        passed, detail = check()
        component.check = "pass" if passed else "FAIL"
        component.check_detail = detail
    except Exception as exc:  # a self-check that crashes is a failed self-check, reported in one line
        component.check, component.check_detail = "FAIL", describe(exc)
    component.seconds = time.perf_counter() - began


# ---------------------------------------------------------------------------------------
# The components
# ---------------------------------------------------------------------------------------


def check_torch() -> Component:
    c = Component("torch (reference)", True, f"torch {torch.__version__}")

    def check():
        from .dump import dump_state, load_state

        dump = _reference().packed  # the final cache as a .pnkv dump
        layout, state, seq_len = load_state(dump)
        return dump_state(layout, state, seq_len) == dump, "the reference's cache survives a .pnkv dump round trip"

    _run_check(c, check)
    return c


def cuda_device() -> Tuple[bool, str]:
    if not torch.cuda.is_available():
        from .backends.tensorrt.engine import cuda_devices

        count, why = cuda_devices()
        if count:
            return False, f"the driver sees {count} GPU(s) but this torch build has no CUDA ({torch.__version__})"
        return False, why or "no CUDA device"
    return True, f"{torch.cuda.get_device_name(0)} (torch CUDA {torch.version.cuda})"


def check_cuda_device() -> Component:
    ok, detail = cuda_device()
    c = Component("CUDA device", ok, detail)
    if ok:
        def check():
            x = torch.arange(1024, device="cuda", dtype=torch.float32)
            return float(x.sum()) == 1024 * 1023 / 2, "a reduction on the GPU gives the exact sum"

        _run_check(c, check)
    return c


def check_triton(has_gpu: bool) -> Component:
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:
        return Component("triton", False, f"triton is not importable ({describe(exc)}); pip install triton")
    if not has_gpu:
        return Component("triton", False, f"triton {triton.__version__} installed, but the kernels need a CUDA "
                                          "device (TRITON_INTERPRET=1 runs them on CPU, slowly)")
    c = Component("triton", True, f"triton {triton.__version__}")

    def check():
        from .backends import make_ops
        from .verify import TOLERANCE

        return compare_with_reference(ops_factory(lambda: make_ops("triton", "cuda"), "cuda"), "cuda",
                                      TOLERANCE["triton"])

    _run_check(c, check)
    return c


def check_onnxruntime() -> Component:
    try:
        ort = importlib.import_module("onnxruntime")
    except Exception as exc:
        return Component("onnxruntime", False, f"onnxruntime is not importable ({describe(exc)})")
    c = Component("onnxruntime", True, f"onnxruntime {ort.__version__}, providers "
                                       f"{', '.join(ort.get_available_providers())}")
    _run_check(c, onnxruntime_check("functions"))
    return c


def check_native_ops() -> Component:
    """libpnmix_ort: whether it loads into ONNX Runtime, and the protocol through its kernels."""
    from ._native import library_status

    ok, detail = library_status("pnmix_ort")
    c = Component("ONNX Runtime native ops (libpnmix_ort)", ok, detail)
    if ok:
        _run_check(c, onnxruntime_check("native"))
    return c


def onnxruntime_check(ops: str) -> Callable[[], Tuple[bool, str]]:
    """The protocol through an exported file in ONNX Runtime with these ops, against the reference."""

    def check():
        from .backends import make_backend
        from .verify import TOLERANCE

        exporter = importlib.import_module("pnmix.export.exporter")
        with tempfile.TemporaryDirectory() as folder:
            model = Path(folder) / "doctor.onnx"
            exporter.export_onnx(model, CHECK_RUN.config, max_seq_len=CHECK_RUN.total_tokens, seed=CHECK_SEED)
            return compare_with_reference(
                lambda seed, n: make_backend("onnx", CHECK_RUN.config, seed, n, "cpu", model=model, ops=ops), "cpu",
                TOLERANCE["onnx"])

    return check


def check_core() -> Component:
    from ._native import library_status

    ok, detail = library_status("pnmix_core")
    c = Component("core library (libpnmix_core)", ok, detail)
    if ok:
        def check():
            from .backends.core_ops import CoreOps
            from .verify import TOLERANCE

            ops = CoreOps()
            c.extra["kernel"] = ops.isa()
            threads = "torch's OpenMP threads" if ops.team is not None else "its own thread pool"
            c.extra["threads"] = threads
            passed, text = compare_with_reference(ops_factory(lambda: ops, "cpu"), "cpu", TOLERANCE["core"])
            return passed, f"{text}; kernel {ops.isa()}; attention on {threads}"

        _run_check(c, check)
    return c


def check_cuda_kernels(has_gpu: bool) -> Component:
    try:
        cuda_ops = importlib.import_module("pnmix.backends.cuda_ops")
        ok, detail = cuda_ops.library_status()
    except Exception as exc:
        return Component("CUDA kernels (libpnmix_cuda)", False, describe(exc))
    if ok and not has_gpu:
        return Component("CUDA kernels (libpnmix_cuda)", False, f"built ({detail}), but there is no CUDA device to run them")
    c = Component("CUDA kernels (libpnmix_cuda)", ok, detail)
    if ok:
        def check():
            from .verify import TOLERANCE

            return compare_with_reference(ops_factory(lambda: cuda_ops.CudaOps("cuda"), "cuda"), "cuda",
                                          TOLERANCE["cuda"])

        _run_check(c, check)
    return c


def check_tensorrt(has_gpu: bool) -> Component:
    try:
        trt = importlib.import_module("tensorrt")
    except Exception as exc:
        return Component("TensorRT", False, f"tensorrt is not importable ({describe(exc)})")
    from ._native import find_library

    path, reason = find_library("pnmix_trt_plugins")
    if path is None:
        return Component("TensorRT", False, f"tensorrt {trt.__version__} installed; plugins: {reason}")
    if not has_gpu:
        return Component("TensorRT", False, f"tensorrt {trt.__version__} and {path} found, but no CUDA device")
    c = Component("TensorRT", True, f"tensorrt {trt.__version__}, plugins {path}")

    def check():
        from .backends.tensorrt.engine import load_plugins

        load_plugins(trt, path)
        return True, ("the plugin library loads and registers its creators; a full check is "
                      "`pnmix build-engine` then `pnmix verify --engine`")

    _run_check(c, check)
    return c


def run_doctor() -> List[Component]:
    components = [check_torch(), check_cuda_device()]
    has_gpu = components[1].available
    components += [check_triton(has_gpu), check_onnxruntime(), check_native_ops(), check_core(), check_cuda_kernels(has_gpu),
                   check_tensorrt(has_gpu)]
    return components


def print_components(components: List[Component]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title="pnmix doctor")
    for column in ("component", "available", "detail / reason", "self-check"):
        table.add_column(column)
    for c in components:
        style = {"pass": "green", "FAIL": "bold red"}.get(c.check, "dim")
        check = f"[{style}]{c.check}[/]" + (f": {c.check_detail}" if c.check_detail else "")
        table.add_row(c.name, "[green]yes[/]" if c.available else "[yellow]no[/]", c.detail, check)
    console.print(table)


def doctor_command(json_path: Optional[Path] = None) -> int:
    """The CLI's `pnmix doctor`: 0 when every available component passes its self-check, else 1."""
    from .io import JsonReport

    report_file = JsonReport(json_path)  # checks the path before the self-checks, not after them
    components = run_doctor()
    print_components(components)
    passed = all(c.check != "FAIL" for c in components)
    report_file.write({
        "passed": passed,
        "self_check_run": {"config": CHECK_RUN.config.to_dict(), "prefill_tokens": CHECK_RUN.prefill_tokens,
                           "decode_tokens": CHECK_RUN.decode_tokens, "seed": CHECK_SEED},
        "components": [asdict(c) for c in components],
    })
    return 0 if passed else 1
