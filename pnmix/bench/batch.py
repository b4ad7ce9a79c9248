"""`pnmix bench batch`: a left-padded batch of prompts of different lengths against each prompt
alone, through transformers' ``generate`` (docs/HF.md, "Left-padded batches").

Every batched ``generate`` of a decoder-only model left-pads, so this is how a user's batch meets
the cache. For each cache, the batch decodes greedily, then each prompt alone; each forward call
is timed (a forward hook), the first being the prefill. Reported per cache: whether each row's
tokens equal that prompt's alone, the batch's decode tokens/s (rows / median step) and batch 1's
(the mean over the prompts of 1 / median step), and their ratio. DynamicCache is the control: what
the model itself gains from a batch on this machine, with a cache that only concatenates.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from pnmix.bench.report import print_table, run_report
from pnmix.bench.timing import Timing
from pnmix.errors import PnMixError, parse_positive_ints
from pnmix.machine import check_threads, describe_machine

BATCH_CACHES = ("dynamic", "pnmix")
MAX_ROWS = 64


def parse_lengths(text: str) -> List[int]:
    lengths = parse_positive_ints(text, "--lengths")
    if not 2 <= len(lengths) <= MAX_ROWS:
        raise PnMixError(f"--lengths must name 2..{MAX_ROWS} prompts (one length each), got {len(lengths)}")
    return lengths


def parse_caches(text: str) -> List[str]:
    from pnmix.errors import parse_list

    caches = parse_list(text, "--caches")
    unknown = [c for c in caches if c not in BATCH_CACHES]
    if unknown or not caches:
        raise PnMixError(f"--caches: unknown cache {unknown[0] if unknown else text!r}; choose from "
                         f"{', '.join(BATCH_CACHES)}")
    return list(dict.fromkeys(caches))


def random_prompts(lengths: Sequence[int], vocab: int, pad: int, seed: int) -> List[torch.Tensor]:
    """One prompt of random token ids per length (never the pad id, so no row is mistaken for padding)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        ids = torch.randint(0, vocab - 1, (n,), generator=generator)
        prompts.append(ids + (ids >= pad).long())  # skip the pad id
    return prompts


def left_padded(prompts: Sequence[torch.Tensor], pad: int) -> Dict[str, torch.Tensor]:
    """input_ids and attention_mask of the batch, padded on the left as generate expects."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel():] = p
        mask[row, width - p.numel():] = 1
    return {"input_ids": ids, "attention_mask": mask}


class ForwardTimes:
    """Wall seconds of each forward call of a model (hooks), the prefill first."""

    def __init__(self, model):
        self.samples: List[float] = []
        self._start = 0.0
        self._hooks = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, module, args) -> None:
        self._start = time.perf_counter()

    def _after(self, module, args, output) -> None:
        self.samples.append(time.perf_counter() - self._start)

    def decode_timing(self) -> Timing:
        steps = tuple(self.samples[1:])
        return Timing(steps, steps)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def greedy(model, kind: str, inputs: Dict[str, torch.Tensor], new_tokens: int, pad: int) -> tuple:
    """(the new tokens [B, new_tokens], the decode steps' Timing) of one greedy generate with a
    fresh cache of `kind`, under the attention that reads it."""
    from pnmix.bench.generate import new_cache

    cache, attn = new_cache(kind, model)
    model.set_attn_implementation(attn)
    times = ForwardTimes(model)
    try:
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    finally:
        times.close()
    return out[:, inputs["input_ids"].shape[1]:], times.decode_timing()


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_batch_bench(model, lengths: Sequence[int], new_tokens: int = 32, caches: Sequence[str] = BATCH_CACHES,
                    seed: int = 0) -> Dict[str, Any]:
    """The benchmark as data: {"results": [{"cache", "rows_equal_alone", "batch_tokens_per_s",
    "alone_tokens_per_s", "batch_vs_batch1", ...}], ...}."""
    from pnmix.hf import register
    from pnmix.hf.models import max_positions

    register()
    if not 2 <= new_tokens <= 4096:
        raise PnMixError(f"--new-tokens must be 2..4096, got {new_tokens}")
    limit = max_positions(model.config)
    if limit and max(lengths) + new_tokens > limit:
        raise PnMixError(f"the longest prompt ({max(lengths)}) plus --new-tokens {new_tokens} passes the model's "
                         f"{limit} positions")
    vocab = int(model.config.vocab_size)
    pad = model.config.pad_token_id
    pad = 0 if pad is None or not 0 <= int(pad) < vocab else int(pad)
    prompts = random_prompts(lengths, vocab, pad, seed)
    batch = left_padded(prompts, pad)
    results = []
    for kind in caches:
        tokens, timing = greedy(model, kind, batch, new_tokens, pad)
        alone_rates, rows = [], []
        for row, prompt in enumerate(prompts):
            alone, alone_timing = greedy(model, kind, {"input_ids": prompt[None],
                                                       "attention_mask": torch.ones(1, prompt.numel(), dtype=torch.long)},
                                         new_tokens, pad)
            alone_rates.append(1.0 / alone_timing.median_s)
            rows.append(first_difference(tokens[row].tolist(), alone[0].tolist()))
        batch_rate = len(prompts) / timing.median_s
        alone_rate = sum(alone_rates) / len(alone_rates)
        results.append({"cache": kind, "rows_equal_alone": [d is None for d in rows], "first_difference": rows,
                        "batch_tokens_per_s": batch_rate, "batch_median_step_seconds": timing.median_s,
                        "alone_tokens_per_s": alone_rates, "batch1_tokens_per_s": alone_rate,
                        "batch_vs_batch1": batch_rate / alone_rate})
    return {"model": getattr(model.config, "_name_or_path", "") or model.config.model_type,
            "layers": model.config.num_hidden_layers, "threads": torch.get_num_threads(), "lengths": list(lengths),
            "new_tokens": new_tokens, "seed": seed, "results": results,
            "machine": describe_machine(str(model.device))}


BATCH_COLUMNS = ("cache", "rows = alone", "batch tok/s", "batch 1 tok/s", "batch vs batch 1")


def _batch_row(r: Dict[str, Any]) -> List[str]:
    equal = r["rows_equal_alone"]
    return [r["cache"], f"{sum(equal)}/{len(equal)}", f"{r['batch_tokens_per_s']:.2f}",
            f"{r['batch1_tokens_per_s']:.2f}", f"{r['batch_vs_batch1']:.2f}x"]


def print_batch_report(report: Dict[str, Any]) -> None:
    notes = [f"a left-padded batch of {len(report['lengths'])} random prompts of {report['lengths']} tokens, "
             f"{report['new_tokens']} greedy tokens each through generate; rows = alone: greedy tokens equal to that "
             "prompt's alone; tok/s from the median decode step (batch: rows per step; batch 1: the mean over "
             "the prompts alone); dynamic is the control (what the model itself gains from a batch)"]
    print_table(f"pnmix bench batch: {report['model']}, {report['layers']} layers, {report['threads']} threads",
                BATCH_COLUMNS, map(_batch_row, report["results"]), left=("cache",), notes=notes)


def batch_command(model: str, lengths: str, new_tokens: int, caches: str, threads: Optional[int],
                  json_path) -> int:
    """The CLI's `pnmix bench batch` (pnmix/cli.py): print the table, write JSON, return 0."""
    from pnmix.hf.models import load_causal_lm, load_model_config, resolve_model

    def run() -> Dict[str, Any]:
        wanted, kinds = parse_lengths(lengths), parse_caches(caches)
        chosen = check_threads(threads)
        if chosen is not None:
            torch.set_num_threads(chosen)
        source = resolve_model(model)
        lm = load_causal_lm(source, "fp32", model_config=load_model_config(source))
        return {**run_batch_bench(lm, wanted, new_tokens, kinds), "model": source.name}

    run_report(json_path, run, print_batch_report)
    return 0
