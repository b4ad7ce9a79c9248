"""`pnmix bench onnx`: export time, file size and the time of one decode step through ONNX
Runtime (CPU) against the PyTorch reference backend, on the same packed cache.

Both sides run the whole model step (q/k/v, attention over the packed cache, append with
flush) from the same cache of ``context`` tokens; the state is restored before every timed
step, so each repetition does the same work.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from pnmix import defaults
from pnmix.bench.report import print_table, run_report
from pnmix.bench.timing import time_interleaved
from pnmix.errors import PnMixError
from pnmix.machine import describe_machine


MAX_REPEATS = 1_000_000
# Peak host bytes per token of context while timing: ONNX Runtime's unpacked groups and the
# reference's dequantized cache (measured: about 7.5 KB between contexts 1k and 170k). The
# export's own memory is checked by the exporter.
RUN_BYTES_PER_TOKEN = 8192


def _check_context(context: Optional[int], capacity: int) -> int:
    """The context to time at (default: capacity - 1), checked against the capacity and the
    dataset that supplies its tokens."""
    from pnmix.dataset import hamlet_bytes

    context = capacity - 1 if context is None else context
    if not 1 <= context < capacity:
        raise PnMixError(f"--context must be 1..{capacity - 1} (the model holds {capacity} tokens), got {context}")
    have = len(hamlet_bytes())
    if context + 1 > have:
        raise PnMixError(f"--context {context} needs {context + 1} tokens, the dataset has {have} bytes; "
                         f"lower --context (or --max-seq-len, whose default context is capacity - 1)")
    return context


def _check_run_fits(context: int) -> None:
    from pnmix.memory import check_fits

    check_fits(RUN_BYTES_PER_TOKEN * context, f"--context {context}", "lower --context")


def _fill(reference, tokens: torch.Tensor) -> None:
    """The reference cache as a prefill of these tokens leaves it, without the prefill's attention
    (the cache does not depend on it; its n x n scores would not fit for a long context)."""
    qkv = reference.model.qkv(tokens, 0, reference.tables)
    reference.cache.append(qkv.k, qkv.v)


def bench(max_seq_len: int = defaults.EXPORT_MAX_SEQ_LEN, context: Optional[int] = None,
          repeats: int = defaults.BENCH_REPEATS, model: Optional[Path] = None,
          seed: int = defaults.MODEL_SEED, ops: Optional[str] = None) -> Dict[str, Any]:
    from pnmix.backends.base import OpsBackend
    from pnmix.backends.onnxruntime.backend import OnnxBackend
    from pnmix.backends.torch_ops import TorchOps
    from pnmix.config import run_config
    from pnmix.dataset import protocol_tokens
    from pnmix.manifest import load_manifest

    from pnmix.export.exporter import DEFAULT_OPSET, check_export_args, export_onnx
    from pnmix.export.modelfile import load_checked

    if not 1 <= repeats <= MAX_REPEATS:
        raise PnMixError(f"--repeats must be 1..{MAX_REPEATS}, got {repeats}")
    config = run_config(load_manifest()).config
    if model is None:  # the export's own checks (capacity, file size, memory) before any work
        check_export_args(config, max_seq_len, 1, DEFAULT_OPSET)
        _check_run_fits(_check_context(context, max_seq_len))
    with tempfile.TemporaryDirectory(prefix="pnmix-bench-") as folder:
        export_seconds: Optional[float] = None
        if model is None:
            result = export_onnx(Path(folder) / "model.onnx", config, max_seq_len=max_seq_len, seed=seed)
            model, export_seconds = result.path, result.seconds
        info = load_checked(model)[1]
        config, capacity = info.config, info.max_seq_len
        context = _check_context(context, capacity)
        _check_run_fits(context)
        tokens = protocol_tokens(context + 1)
        step_token = tokens[:, context:context + 1]

        reference = OpsBackend(TorchOps(), config, info.seed, capacity)
        _fill(reference, tokens[:, :context])
        layout, filled, _ = reference.state()
        saved = {name: t.clone() for name, t in filled.items()}

        onnx_backend = OnnxBackend(config, info.seed, capacity, model=model, ops=ops)
        # The two sides take turns, each from the saved state (restored untimed before every
        # step); one untimed round warms both up. Wall and CPU time are both reported.
        onnx_timing, torch_timing = time_interleaved(
            [lambda: onnx_backend.step(step_token, context, write=True),
             lambda: reference.step(step_token, context, write=True)],
            repeats, warmup_rounds=1,
            before=[lambda: onnx_backend.load_state(saved, context),
                    lambda: reference.cache.import_state(saved, context)])
        _, onnx_state, _ = onnx_backend.state()
        _, torch_state, _ = reference.state()
        from pnmix.dump import dump_state

        identical = dump_state(onnx_backend.layout, onnx_state, context + 1) == dump_state(layout, torch_state, context + 1)
        machine = describe_machine(onnxruntime=True)  # after the run: its load average is the run's
        return {
            "model": str(model) if export_seconds is None else None,
            "max_seq_len": capacity,
            "context": context,
            "repeats": repeats,
            "export_seconds": export_seconds,
            "file_bytes": Path(model).stat().st_size,
            "onnxruntime_ms_per_decode_step": onnx_timing.median_s * 1e3,
            "torch_reference_ms_per_decode_step": torch_timing.median_s * 1e3,
            "onnxruntime_over_torch": onnx_timing.median_s / torch_timing.median_s,
            "onnxruntime_cpu_ms_per_decode_step": onnx_timing.cpu_mean_s * 1e3,
            "torch_reference_cpu_ms_per_decode_step": torch_timing.cpu_mean_s * 1e3,
            "load_average_1min": (machine["load_average"] or [None])[0],
            "packed_bytes_identical_after_step": identical,
            "threads": machine["threads"],
            "onnxruntime_version": machine["onnxruntime"],
            "ops": onnx_backend.ops,
            "config": config.to_dict(),
            "machine": machine,
        }


def print_bench(report: Dict[str, Any]) -> None:
    export = report["export_seconds"]
    rows = [("export time", "-" if export is None else f"{export:.3f} s"),
            ("file size", f"{report['file_bytes']:,} bytes"),
            (f"ONNX Runtime CPU ({report['ops']} ops), per decode step", f"{report['onnxruntime_ms_per_decode_step']:.3f} ms"),
            ("PyTorch reference, per decode step", f"{report['torch_reference_ms_per_decode_step']:.3f} ms"),
            ("ONNX Runtime / reference", f"{report['onnxruntime_over_torch']:.2f}x"),
            ("CPU time per step: ONNX Runtime / reference",
             f"{report['onnxruntime_cpu_ms_per_decode_step']:.3f} / {report['torch_reference_cpu_ms_per_decode_step']:.3f} ms")]
    if report["load_average_1min"] is not None:
        rows.append(("load average (1 min) after the run", f"{report['load_average_1min']:.1f}"))
    rows.append(("packed bytes identical after the step", str(report["packed_bytes_identical_after_step"])))
    print_table(f"pnmix bench onnx: decode step at context {report['context']} (capacity {report['max_seq_len']}), "
                f"median of {report['repeats']}", ("figure", "value"), rows, left=("figure",))


def bench_command(max_seq_len: int, context: Optional[int], repeats: int, model: Optional[Path],
                  json_path: Optional[Path], ops: Optional[str] = None) -> int:
    """The CLI's `pnmix bench onnx` (pnmix/cli.py): print the table, write JSON; 1 when the packed
    bytes of the two sides differ after the step."""
    report = run_report(json_path, lambda: bench(max_seq_len, context, repeats, model, ops=ops), print_bench)
    return 0 if report["packed_bytes_identical_after_step"] else 1
