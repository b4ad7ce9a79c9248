"""The one place pnmix opens ONNX Runtime: the import (its logger quieted), the session options and
every InferenceSession (the verify backend, the LLM sessions, the K/V probe, the TensorRT execution
provider, the benchmarks' peers)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from pnmix.errors import PnMixError, one_line

# ONNX Runtime's log severity: errors only (3). Its warnings are ANSI-coloured lines on stderr that
# would break the CLI's one-line errors; the errors themselves come back as exceptions, which pnmix
# turns into one PnMixError line.
ORT_LOG_SEVERITY = 3
CPU_PROVIDERS = ("CPUExecutionProvider",)

Provider = Union[str, Tuple[str, Dict[str, Any]]]  # a name, or (name, provider options)


def import_onnxruntime() -> Any:
    """onnxruntime, its default logger quieted (sessions made anywhere, and their runs, log through it)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise PnMixError("onnxruntime is not installed: pip install onnxruntime") from None
    ort.set_default_logger_severity(ORT_LOG_SEVERITY)
    return ort


def session_options(threads: Optional[int] = None, inter_op_threads: Optional[int] = None) -> Any:
    """SessionOptions at the quiet log level; threads: intra-op threads (None or 0: ONNX Runtime's
    default)."""
    options = import_onnxruntime().SessionOptions()
    options.log_severity_level = ORT_LOG_SEVERITY
    if threads:
        options.intra_op_num_threads = threads
    if inter_op_threads:
        options.inter_op_num_threads = inter_op_threads
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
