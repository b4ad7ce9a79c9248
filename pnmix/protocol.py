"""The diagnostic protocol (docs/METHOD.md section 4) and its metrics, run through any backend."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

from . import reference
from .backends.base import Backend
from .config import RunConfig
from .machine import cpu_model
from .dataset import check_token_count, fingerprint, protocol_tokens
from .dump import dump_state
from .memory import check_fits
from .model import HEAD_DIM, KV_HEADS, Q_HEADS, DiagnosticModel

BackendFactory = Callable[[int, int], Backend]  # (seed, max_seq_len) -> Backend


@dataclass
class RunResult:
    seed: int
    metrics: Dict[str, float]
    runtime: Dict[str, object]
    online: torch.Tensor  # fp32 [B, Hq, decode, D]: each decode step's output
    final: torch.Tensor  # fp32 [B, Hq, decode, D]: the final evaluation's output
    packed: bytes  # the persistent bytes of the final cache, in .pnkv section order


def accelerator_model(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()


def _peak_bytes(device: str) -> tuple[int, str]:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(torch.device(device)), "torch.cuda.max_memory_allocated"
    # CPU tensors are not tracked by an allocator counter; the process's peak RSS is the
    # honest upper bound we can read.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"


# fp32 score-sized tensors alive at once in a dense attention (scores, masked scores,
# probabilities), and in the metrics' two attentions with their log-probabilities and KL terms.
ATTENTION_SCORE_COPIES = 2
METRIC_SCORE_COPIES = 10


def protocol_bytes(run: RunConfig) -> int:
    """Peak host bytes of one protocol run, from its lengths: the prefill's causal attention is
    prefill x prefill scores per query head, the evaluation and the metrics decode x total."""
    prefill, total = run.prefill_tokens, run.total_tokens
    scores = 4 * Q_HEADS * (ATTENTION_SCORE_COPIES * prefill * prefill
                            + METRIC_SCORE_COPIES * run.decode_tokens * total)
    activations = 64 * (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM * total  # q/k/v in fp16/fp32, outputs
    return scores + prefill * prefill + activations


def check_protocol_fits(run: RunConfig, device: str = "cpu") -> None:
    """Before a run: the dataset holds its tokens, and its attention fits in memory."""
    check_token_count(run.total_tokens)
    check_fits(protocol_bytes(run), f"the protocol's prefill_tokens {run.prefill_tokens} and decode_tokens "
               f"{run.decode_tokens}", "lower prefill_tokens or decode_tokens in --config")


def run_protocol(make: BackendFactory, run: RunConfig, seed: int, device: str = "cpu") -> RunResult:
    """Prefill, saliency once, decode steps each with one attention call, final evaluation."""
    prefill, decode = run.prefill_tokens, run.decode_tokens
    total = prefill + decode
    tokens = protocol_tokens(total)
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(torch.device(device))
        torch.cuda.synchronize()
    began = time.perf_counter()
    backend = make(seed, max(total, 1))
    calls = 0
    backend.step(tokens[:, :prefill], 0, write=True)  # 1. prefill attention (+ 2. mask, 3. append)
    calls += 1
    _, state, _ = backend.state()
    mask_after_prefill = state["pair_mask"].clone()
    online = []
    for t in range(prefill, total):  # 4. decode steps
        online.append(backend.step(tokens[:, t:t + 1], t, write=True))
        calls += 1
    final = backend.step(tokens[:, prefill:], total, write=False)  # 5. final evaluation
    calls += 1
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    peak, peak_source = _peak_bytes(device)
    online_out = torch.cat(online, dim=2) if online else final[:, :, :0]

    layout, state, seq_len = backend.state()
    metrics = compute_metrics(seed, run, tokens, layout, state, seq_len, online_out, final)
    metrics["saliency_computations"] = backend.saliency_computations
    metrics["mask_unchanged_after_decode"] = bool(torch.equal(mask_after_prefill, state["pair_mask"]))
    metrics["actual_attention_calls"] = calls
    runtime: Dict[str, object] = {
        "device_kind": "cuda" if device.startswith("cuda") else "cpu",
        "accelerator_model": accelerator_model(device),
        "elapsed_seconds": elapsed,
        "peak_allocated_bytes": peak,
        "peak_allocated_source": peak_source,
        "backend": backend.name,
    }
    packed = dump_state(layout, {k: v.cpu() for k, v in state.items()}, seq_len)
    return RunResult(seed, metrics, runtime, online_out.cpu(), final.cpu(), packed)


def compute_metrics(seed, run, tokens, layout, state, seq_len, online, final) -> Dict[str, float]:
    """docs/METHOD.md section 5.1's metrics from the final cache and the backend's outputs."""
    prefill, decode = run.prefill_tokens, run.decode_tokens
    model = DiagnosticModel(seed, run.config.pair_layout)
    ref = model.qkv(tokens, 0)  # fp16 q, k, v of every position, as the cache received them
    cpu_state = {k: v.cpu() for k, v in state.items()}
    k_hat, v_hat = reference.dequantize_cache(layout, cpu_state, seq_len)
    k_in, v_in = ref.k.float(), ref.v.float()
    n = layout.lengths(seq_len)

    q_eval = ref.q[:, :, prefill:]
    full_out, full_logp = _attention(q_eval, k_in, v_in)
    _, cache_logp = _attention(q_eval, k_hat, v_hat)
    p_full = full_logp.exp()
    kl = torch.where(p_full > 0, p_full * (full_logp - cache_logp), torch.zeros_like(p_full)).sum(-1)
    final = final.float().cpu()
    diff = final - full_out
    batch, heads, nq, dim = final.shape
    flat_cache = final.permute(0, 2, 1, 3).reshape(batch * nq, heads * dim)
    flat_full = full_out.permute(0, 2, 1, 3).reshape(batch * nq, heads * dim)
    cosine = torch.nn.functional.cosine_similarity(flat_cache, flat_full, dim=-1)
    delta = (online.float().cpu() - final).abs().max().item() if decode else 0.0
    sink = (k_hat[:, :, : n.sink] - k_in[:, :, : n.sink]).abs()
    nbytes = layout.persistent_bytes(seq_len, cpu_state)
    elements = seq_len * layout.kv_heads * layout.head_dim
    return {
        "key_mse": (k_hat - k_in).square().mean().item(),
        "value_mse": (v_hat - v_in).square().mean().item(),
        "attention_kl": kl.mean().item() if decode else 0.0,
        "attention_output_mse": diff.square().mean().item() if decode else 0.0,
        "attention_output_cosine": cosine.mean().item() if decode else 1.0,
        "sink_key_max_error": sink.max().item() if sink.numel() else 0.0,
        "online_vs_final_cache_attention_max_delta": delta,
        **nbytes,
        "quantized_tokens": n.groups * layout.config.group_size,
        "sink_tokens": n.sink,
        "residual_tokens": n.residual,
        "key_bits_per_element_including_sink_residual": nbytes["key_bytes"] * 8 / elements if elements else 0.0,
    }


def _attention(q, k, v):
    """Dense fp32 attention returning (output, log-probabilities), reference.attention_dense's rule."""
    out, probs = reference.attention_dense(q, k, v, return_probs=True)
    return out, torch.log(probs)


def aggregate(runs: List[RunResult]) -> Dict[str, Dict[str, float]]:
    """mean, sample std (ddof 1) and n of every metric over seeds: the manifest's shape."""
    out = {}
    for name, first in runs[0].metrics.items():
        if isinstance(first, bool):
            continue  # invariants such as mask_unchanged_after_decode are checked per run
        values = torch.tensor([float(r.metrics[name]) for r in runs], dtype=torch.float64)
        std = values.std(unbiased=True).item() if len(runs) > 1 else 0.0
        mean = values.mean().item()
        if isinstance(first, int) and mean == int(mean):
            mean = int(mean)
        out[name] = {"mean": mean, "std": std, "n": len(runs)}
    return out


def run_record(result: RunResult, run: RunConfig) -> Dict[str, object]:
    return {
        "seed": result.seed,
        "metrics": result.metrics,
        "runtime": result.runtime,
        "dataset": fingerprint(),
        "protocol": {
            "prefill_tokens": run.prefill_tokens,
            "decode_tokens": run.decode_tokens,
            "config": run.config.to_dict(),
            "input_precision": "torch.float16",
            "saliency_source": "prefill_only",
        },
    }
