"""Task ``kl``: a text's first P tokens are the prefill, the next D are teacher-forced; each step's
distribution is scored against the reference's (mean KL(p_ref || p), perplexity of the true next
tokens, top-1 agreement), with the cache's bytes and the decode speed."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...errors import PnMixError
from ..models import ModelDims
from .kv_bytes import cache_bytes
from .methods import Method, attention_for, reuse_dequantized, seeded_cache
from .prefill import Prefill, attention, decode_step, run_prefill


@dataclasses.dataclass
class Decoded:
    logp: torch.Tensor  # [steps, vocab]
    bytes: int
    seconds: float  # per decode step

    def first(self, steps: int) -> "Decoded":
        """The first ``steps`` steps: a shorter run's reference (the steps are the same tokens)."""
        return Decoded(self.logp[:steps], self.bytes, self.seconds)


# quanto's decode speed is timed over its first steps, each dequantizing its whole cache as
# transformers does; the remaining steps reuse unchanged dequantized tensors (DequantizeOnce).
QUANTO_TIMED_STEPS = 8


def teacher_forced(model, method: Method, prefill: Prefill, tokens: Sequence[int]) -> Decoded:
    """The tokens one per forward call; ``seconds``: per token, over the timed steps."""
    cache = seeded_cache(method, model.config, prefill)
    timed = min(len(tokens), QUANTO_TIMED_STEPS) if method.cache == "quanto" else len(tokens)
    with attention(model, attention_for(method)):
        start = time.perf_counter()
        rows = [decode_step(model, cache, t) for t in tokens[:timed]]
        seconds = (time.perf_counter() - start) / timed
        reuse_dequantized(cache)
        rows += [decode_step(model, cache, t) for t in tokens[timed:]]
    return Decoded(torch.stack(rows), cache_bytes(cache), seconds)


def score(run: Decoded, reference: Decoded, targets: torch.Tensor) -> Dict[str, float]:
    """Mean KL(p_ref || p) over the steps, the targets' perplexity, top-1 agreement with the reference."""
    ref = reference.logp
    kl = (ref.exp() * (ref - run.logp)).sum(-1).mean().item()
    nll = -run.logp.gather(1, targets.view(-1, 1)).mean().item()
    top1 = (run.logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"kl": max(kl, 0.0), "perplexity": math.exp(nll), "top1": top1}


@dataclasses.dataclass
class Teacher:
    """One context's shared work: the prefill (run once), the D tokens teacher-forced after it, their
    targets (the next true tokens) and the K/V elements a cache holds at the end (bits per element)."""

    context: int
    prefill: Prefill
    fed: List[int]
    targets: torch.Tensor
    elements: int

    @classmethod
    def run(cls, model, ids: torch.Tensor, context: int, decode_tokens: int) -> "Teacher":
        return cls(context, run_prefill(model, ids[:, :context]), ids[0, context:context + decode_tokens].tolist(),
                   ids[0, context + 1:context + decode_tokens + 1].to(torch.long).cpu(),
                   ModelDims.from_config(model.config).kv_bytes(context + decode_tokens, 1))

    def bits_per_element(self, cache_bytes: int) -> float:
        return 8 * cache_bytes / self.elements


def kl_task(model, methods: List[Method], ids: torch.Tensor, context: int, decode_tokens: int,
            progress: Callable[[str], None]) -> List[Dict[str, Any]]:
    """One context P: the prefill once, then every method's D teacher-forced steps."""
    teacher = Teacher.run(model, ids, context, decode_tokens)
    rows: List[Dict[str, Any]] = []
    reference: Optional[Decoded] = None
    for method in methods:  # METHODS[REFERENCE] first
        run = teacher_forced(model, method, teacher.prefill, teacher.fed)
        reference = reference or run
        figures = score(run, reference, teacher.targets)
        check_scores(model, figures, f"method {method.name} at context {context}")
        rows.append({"task": "kl", "context": context, "decode_tokens": decode_tokens, "method": method.name,
                     "kl": figures["kl"], "perplexity": figures["perplexity"],
                     "ppl_delta": figures["perplexity"] - (rows[0]["perplexity"] if rows else figures["perplexity"]),
                     "top1": figures["top1"], "bytes": run.bytes, "bits_per_element": teacher.bits_per_element(run.bytes),
                     "tokens_per_s": 1.0 / run.seconds})
        row = rows[-1]
        progress(f"kl P={context} {method.name}: KL {row['kl']:.4g}, perplexity {row['perplexity']:.4f} "
                 f"({row['ppl_delta']:+.4f}), top-1 {row['top1']:.4f}, {row['bytes']} bytes "
                 f"({row['bits_per_element']:.3f} bits/element), {row['tokens_per_s']:.2f} tokens/s")
    return rows


def check_scores(model, figures: Dict[str, float], what: str) -> None:
    for field in ("kl", "perplexity", "top1"):
        if not math.isfinite(figures[field]):
            raise PnMixError(f"eval of {getattr(model, 'name_or_path', '') or 'the model'}: {what} gave a non-finite "
                             f"{field} ({figures[field]}); the model's outputs are not finite numbers")
