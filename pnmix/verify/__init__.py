"""One verification harness for every backend: the protocol through the backend and through the
PyTorch reference, compared output for output and byte for byte, plus the manifest check."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from pnmix.backends import make_backend
from pnmix.config import RunConfig
from pnmix.manifest import compare
from pnmix.protocol import RunResult, aggregate, check_protocol_fits, run_protocol

# Largest allowed |backend - reference| on attention outputs, per backend (the issues' targets).
TOLERANCE = {"torch": 0.0, "core": 1e-3, "triton": 1e-3, "cuda": 1e-3, "onnx": 2e-3, "engine": 2e-3}


def run_seeds(backend: str, run: RunConfig, seeds: List[int], device: str = "cpu",
              **options: Any) -> List[RunResult]:
    check_protocol_fits(run)  # the reference's attention and metrics run on the host

    def factory(seed: int, max_seq_len: int):
        return make_backend(backend, run.config, seed, max_seq_len, device, **options)

    return [run_protocol(factory, run, seed, device) for seed in seeds]


def compare_runs(mine: RunResult, ref: RunResult, tolerance: float) -> Dict[str, Any]:
    """One seed's verdict: packed bytes identical and both attention outputs within tolerance."""
    online = _max_diff(mine.online, ref.online)
    final = _max_diff(mine.final, ref.final)
    identical = mine.packed == ref.packed
    return {
        "seed": mine.seed,
        "max_abs_diff_online": online,
        "max_abs_diff_final": final,
        "packed_bytes_identical": identical,
        "passed": identical and online <= tolerance and final <= tolerance,
    }


def verify(backend: str, run: RunConfig, manifest: Dict[str, Any], seeds: List[int],
           device: str = "cpu", **options: Any) -> Dict[str, Any]:
    """The common verify report: {backend, passed, tolerance, runs: [...], manifest: {...}}."""
    ours = run_seeds(backend, run, seeds, device, **options)
    refs = run_seeds("torch", run, seeds, "cpu")
    tolerance = TOLERANCE.get(backend, 2e-3)
    records = [{**compare_runs(mine, ref, tolerance), "metrics": mine.metrics, "runtime": mine.runtime}
               for mine, ref in zip(ours, refs)]
    rows = compare(manifest, run, aggregate(ours), [{"metrics": r.metrics} for r in ours])
    manifest_passed = not any(row.failed for row in rows)
    arith = core_arith(backend, options)
    return {
        "backend": backend,
        **({"ops": options["ops"]} if "ops" in options else {}),  # which implementation of the ONNX ops ran
        **({"attend_arith": arith} if arith else {}),  # libpnmix_core's arithmetic, where it ran
        "passed": manifest_passed and all(r["passed"] for r in records),
        "tolerance": tolerance,
        "config": run.config.to_dict(),
        "prefill_tokens": run.prefill_tokens,
        "decode_tokens": run.decode_tokens,
        "runs": records,
        "manifest": {
            "passed": manifest_passed,
            "rows": [{"metric": r.metric, "manifest": r.manifest, "ours": r.ours, "verdict": r.verdict} for r in rows],
        },
    }


def core_arith(backend: str, options: Dict[str, Any]) -> Any:
    """The attention arithmetic libpnmix_core was asked for (fp32, exact, or int8: PNMIX_ATTEND_ARITH)
    when the backend runs its kernels (the core backend, ONNX Runtime's native ops); else None."""
    if backend != "core" and options.get("ops") != "native":
        return None
    from pnmix._native import NativeLibraryError
    from pnmix.backends.core_ops import CoreOps

    try:
        return CoreOps().arith()
    except NativeLibraryError:
        return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    d = (a.float() - b.float()).abs().max().item()
    return d if d == d else float("inf")  # NaN counts as a failure
