"""The published manifest: loading it and comparing our figures with it (docs/METHOD.md section 5)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from .config import RunConfig, read_json_file, run_config
from .errors import PnMixError
from .format import CacheLayout
from .model import HEAD_DIM, KV_HEADS, SEED_RANGE

BUNDLED = "data/pn-mix-manifest.json"

# docs/METHOD.md sections 5.2 and 5.3: figures that must match exactly, and the quality bands.
EXACT_METRICS = (
    "key_bytes", "value_bytes", "persistent_cache_bytes", "quantized_tokens", "sink_tokens",
    "residual_tokens", "key_bits_per_element_including_sink_residual", "saliency_computations",
    "actual_attention_calls", "sink_key_max_error",
)
AT_MOST_TIMES = {  # metric -> factor: ours must be <= factor * manifest mean
    "key_mse": 1.15, "value_mse": 1.15, "attention_kl": 1.15, "attention_output_mse": 1.15,
    "online_vs_final_cache_attention_max_delta": 1.5,
}
AT_LEAST_MINUS = {"attention_output_cosine": 0.03}  # ours >= manifest mean - margin


def bundled_path() -> Path:
    return Path(str(resources.files("pnmix").joinpath(BUNDLED)))


def load_manifest(path: Optional[str | Path] = None) -> Dict[str, Any]:
    """Load and check the shape of a manifest; the bundled one by default."""
    where = Path(path) if path is not None else bundled_path()
    data = read_json_file(where, "manifest")
    if not isinstance(data, dict):
        raise PnMixError(f"manifest {where} must be a JSON object")
    for key in ("protocol", "metrics", "seeds"):
        if key not in data:
            raise PnMixError(f"manifest {where} has no '{key}' field")
    if not isinstance(data["metrics"], dict):
        raise PnMixError(f"manifest {where}: 'metrics' must be an object")
    for name, entry in data["metrics"].items():
        if not isinstance(entry, dict) or not _finite_number(entry.get("mean")):
            raise PnMixError(f"manifest {where}: metric '{name}' needs a finite numeric 'mean'")
        if "std" in entry and not _finite_number(entry["std"]):
            raise PnMixError(f"manifest {where}: metric '{name}' has a 'std' that is not a finite number")
    seeds = data["seeds"]
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise PnMixError(f"manifest {where}: 'seeds' must be a non-empty list of integers")
    outside = [s for s in seeds if not SEED_RANGE[0] <= s <= SEED_RANGE[1]]
    if outside:
        raise PnMixError(f"manifest {where}: seed {outside[0]} is outside {SEED_RANGE[0]}..{SEED_RANGE[1]} "
                         "(the seeds torch takes)")
    if not isinstance(data["protocol"], dict):
        raise PnMixError(f"manifest {where}: 'protocol' must be an object")
    return data


def _finite_number(value: Any) -> bool:
    """A JSON number usable in float arithmetic: not a bool, not NaN/Inf, not an int beyond float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def spec_formula_bytes(run: RunConfig, seq_len: int) -> Dict[str, int]:
    """docs/METHOD.md section 3.5's byte formula, written independently of the measured accounting."""
    cfg = run.config
    layout = CacheLayout(cfg, 1, KV_HEADS, HEAD_DIM, max(seq_len, 1))
    n = layout.lengths(seq_len)
    h, d = KV_HEADS, HEAD_DIM
    c_hi = 2 * cfg.high_pairs(d)
    c_lo = d - c_hi
    vg = min(cfg.value_group_size, d)
    full = 2 * h * d * (n.sink + n.residual)
    key = full + n.groups * (cfg.group_size * h * (c_hi * cfg.key_high_bits + c_lo * cfg.key_low_bits) // 8 + 4 * h * d)
    key += math.ceil(h * (d // 2) / 8) if seq_len > 0 else 0
    value = full + n.groups * cfg.group_size * h * (d * cfg.value_bits // 8 + 4 * d // vg)
    return {"key_bytes": key, "value_bytes": value, "persistent_cache_bytes": key + value}


@dataclass
class Row:
    metric: str
    manifest: Optional[Dict[str, float]]
    ours: Dict[str, float]
    verdict: str  # exact | better | within band | MISMATCH | n/a | ok

    @property
    def failed(self) -> bool:
        return self.verdict == "MISMATCH"


def matches_protocol(manifest: Mapping[str, Any], run: RunConfig) -> bool:
    """True when our run is the manifest's protocol (same config and lengths)."""
    return run_config(manifest) == run


def compare(manifest: Mapping[str, Any], run: RunConfig, ours: Dict[str, Dict[str, float]],
            per_run: List[Dict[str, Any]]) -> List[Row]:
    """One row per metric with its verdict. Off-protocol runs get formula and invariant checks."""
    theirs = manifest["metrics"]
    same = matches_protocol(manifest, run)
    rows: List[Row] = []
    for name, mine in ours.items():
        ref = theirs.get(name)
        if same and ref is not None:
            verdict = _verdict(name, mine["mean"], ref["mean"])
        else:
            verdict = _invariant_verdict(name, mine, run)
        rows.append(Row(name, ref, mine, verdict))
    unchanged = all(bool(r["metrics"].get("mask_unchanged_after_decode")) for r in per_run)
    rows.append(Row("mask_unchanged_after_decode", {"mean": 1, "std": 0.0, "n": len(per_run)} if same else None,
                    {"mean": int(unchanged), "std": 0.0, "n": len(per_run)},
                    "exact" if unchanged else "MISMATCH"))
    return rows


def _verdict(name: str, mine: float, ref: float) -> str:
    if name in EXACT_METRICS:
        return "exact" if mine == ref else "MISMATCH"
    if name in AT_MOST_TIMES:
        if mine <= ref:
            return "better"
        return "within band" if mine <= AT_MOST_TIMES[name] * ref else "MISMATCH"
    if name in AT_LEAST_MINUS:
        if mine >= ref:
            return "better"
        return "within band" if mine >= ref - AT_LEAST_MINUS[name] else "MISMATCH"
    return "n/a"


def _invariant_verdict(name: str, mine: Dict[str, float], run: RunConfig) -> str:
    """Checks that hold for any valid configuration: docs/METHOD.md section 3.5's bytes and the protocol's counts."""
    total = run.total_tokens
    if name in ("key_bytes", "value_bytes", "persistent_cache_bytes"):
        return "ok" if mine["mean"] == spec_formula_bytes(run, total)[name] else "MISMATCH"
    layout = CacheLayout(run.config, 1, KV_HEADS, HEAD_DIM, max(total, 1))
    n = layout.lengths(total)
    expected = {
        "saliency_computations": 1,
        "actual_attention_calls": run.decode_tokens + 2,
        "sink_key_max_error": 0,
        "quantized_tokens": n.groups * run.config.group_size,
        "sink_tokens": n.sink,
        "residual_tokens": n.residual,
    }
    if name in expected:
        return "ok" if mine["mean"] == expected[name] else "MISMATCH"
    return "n/a"
