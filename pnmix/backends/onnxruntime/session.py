"""The one place pnmix opens ONNX Runtime: the import (its logger quieted), the session options and
every InferenceSession (the verify backend, the LLM sessions, the K/V probe, the TensorRT execution
provider, the benchmarks' peers), and which implementation of the pn-mix ops a session runs.

Two implementations of the ops (``--ops``): ``native``, libpnmix_ort (plugins/ort) registered as
ONNX Runtime custom ops, which runs libpnmix_core's kernels; ``functions``, the standard-op
function bodies every exported file carries, which run on any ONNX Runtime. ``auto`` (the
default) is native where the library loads, else functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from pnmix.errors import PnMixError, one_line

# ONNX Runtime's log severity: fatal only (4). Its warnings and errors are ANSI-coloured lines on
# stderr that would break the CLI's one-line errors (a session that cannot read its external data
# logs the error, then raises it); the errors themselves come back as exceptions, which pnmix turns
# into one PnMixError line.
ORT_LOG_SEVERITY = 4
CPU_PROVIDERS = ("CPUExecutionProvider",)

Provider = Union[str, Tuple[str, Dict[str, Any]]]  # a name, or (name, provider options)

OPS_CHOICES = ("auto", "native", "functions")
NATIVE_OPS_LIBRARY = "pnmix_ort"
# The session config entry libpnmix_ort reads its kernels' thread count from (0: all cores).
NATIVE_THREADS_ENTRY = "pnmix.threads"


def native_ops_library() -> Tuple[Optional[Path], str]:
    """(libpnmix_ort's path, "") where it is built, else (None, why not)."""
    from pnmix._native import find_library

    return find_library(NATIVE_OPS_LIBRARY)


def resolve_ops(ops: Optional[str]) -> str:
    """"native" or "functions" for --ops auto|native|functions (None: auto). auto is native where
    libpnmix_ort is found; an explicit native without the library is one PnMixError line."""
    ops = ops or "auto"
    if ops not in OPS_CHOICES:
        raise PnMixError(f"--ops must be one of {', '.join(OPS_CHOICES)}, got {ops!r}")
    if ops == "functions":
        return ops
    path, why = native_ops_library()
    if path is None:
        if ops == "native":
            raise PnMixError(f"--ops native needs libpnmix_ort: {why}")
        return "functions"
    return "native"


def use_native_ops(options: Any, threads: Optional[int]) -> None:
    """Register libpnmix_ort with these session options. ONNX Runtime then runs the pn-mix nodes
    with its kernels instead of inlining their function bodies. The kernels run on the core's own
    pool, as many threads as ONNX Runtime's intra-op pool; ONNX Runtime's threads keep spinning
    between ops, which measured faster than turning it off (docs/OPS.md section 5.1)."""
    path, why = native_ops_library()
    if path is None:
        raise PnMixError(f"--ops native needs libpnmix_ort: {why}")
    try:
        options.register_custom_ops_library(str(path))
    except Exception as exc:  # ONNX Runtime's own exception types; the library's reason is in the text
        raise PnMixError(f"ONNX Runtime cannot load {path.name}: {one_line(exc)}") from None
    options.add_session_config_entry(NATIVE_THREADS_ENTRY, str(threads or 0))


def import_onnxruntime() -> Any:
    """onnxruntime, its default logger quieted (sessions made anywhere, and their runs, log through it)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise PnMixError("onnxruntime is not installed: pip install onnxruntime") from None
    ort.set_default_logger_severity(ORT_LOG_SEVERITY)
    return ort


def session_options(threads: Optional[int] = None, inter_op_threads: Optional[int] = None,
                    ops: str = "functions") -> Any:
    """SessionOptions at the quiet log level; threads: intra-op threads (None or 0: ONNX Runtime's
    default), and the native kernels' too; ops: "native" registers libpnmix_ort (resolve_ops)."""
    options = import_onnxruntime().SessionOptions()
    options.log_severity_level = ORT_LOG_SEVERITY
    if threads:
        options.intra_op_num_threads = threads
    if inter_op_threads:
        options.inter_op_num_threads = inter_op_threads
    if ops == "native":
        use_native_ops(options, threads)
    return options


def run_options() -> Any:
    """RunOptions at the quiet log level (a run logs at its own level, not the session's)."""
    options = import_onnxruntime().RunOptions()
    options.log_severity_level = ORT_LOG_SEVERITY
    return options


def cuda_or_cpu() -> List[str]:
    """The CUDA execution provider where this ONNX Runtime has it, then the CPU one."""
    have = import_onnxruntime().get_available_providers()
    return ["CUDAExecutionProvider", *CPU_PROVIDERS] if "CUDAExecutionProvider" in have else list(CPU_PROVIDERS)


def open_session(model: Any, options: Any = None, providers: Sequence[Provider] = CPU_PROVIDERS,
                 runtime: str = "ONNX Runtime") -> Any:
    """An InferenceSession over model (a path, or a serialized model); options: session_options()
    by default. A model ONNX Runtime cannot load is one PnMixError line."""
    ort = import_onnxruntime()
    source = str(model) if not isinstance(model, bytes) else model
    try:
        return ort.InferenceSession(source, options if options is not None else session_options(),
                                    providers=list(providers))
    except Exception as exc:  # ONNX Runtime raises its own exception types
        what = "the model" if isinstance(model, bytes) else model
        raise PnMixError(f"{runtime} cannot load {what}: {one_line(exc)}") from None
