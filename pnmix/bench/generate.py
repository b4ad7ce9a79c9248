"""`pnmix bench generate`: decode tokens/s and cache memory of transformers' caches and PnMixCache
on a real model at long context (run_generate_bench; docs/HF.md).

One prefill, at the longest context, fills every cache at every context; then each cache decodes
greedily, the caches taking turns in rounds of ROUND_TOKENS steps, each step timed (tokens/s from
the median step). Memory: the bytes each cache holds, and its peak with the full-precision K/V
copy one layer's update makes per step. ``pnmix`` runs libpnmix_core's attention in the arithmetic the
environment chooses (fp32 unless PNMIX_ATTEND_ARITH=int8), ``pnmix_int8`` on its integer path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from pnmix.bench.report import print_table, run_report, skipped_notes
from pnmix.bench.timing import Stopwatch, time_once
from pnmix.errors import PnMixError
from pnmix.hf._deps import quanto_unavailable_reason
from pnmix.machine import check_threads, describe_machine


def random_llama(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """A random Llama of these sizes (256-token vocabulary, no download): the tests' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=65536, eos_token_id=None,
                         bos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


GENERATE_CACHES = ("dynamic", "quanto4", "pnmix", "pnmix_int8")
# PnMixCache's rows and the arithmetic of libpnmix_core's attention each runs ("auto": the
# environment's, PNMIX_ATTEND_ARITH; pnmix_int8: the integer path)
PNMIX_ARITH = {"pnmix": "auto", "pnmix_int8": "int8"}
MAX_NEW_TOKENS = 1 << 16


def parse_contexts(text: str) -> List[int]:
    from pnmix.errors import parse_positive_ints

    return sorted(set(parse_positive_ints(text, "--contexts")))


def prefill_kv(model, ids: torch.Tensor) -> tuple[list, list]:
    """Per layer, the post-RoPE K/V [B, H, n, D] that the model hands its cache for prompt ids."""
    from pnmix.hf.evaluate.prefill import run_prefill

    kv = run_prefill(model, ids).kv
    return [k for k, _ in kv], [v for _, v in kv]


def new_cache(kind: str, model) -> tuple[Any, str]:
    """An empty cache of `kind` and the attention implementation that reads it."""
    from transformers import DynamicCache, QuantizedCache

    from pnmix.hf.cache import PnMixCache

    if kind == "dynamic":
        return DynamicCache(config=model.config), "sdpa"
    if kind == "quanto4":
        return QuantizedCache(backend="quanto", config=model.config, nbits=4), "sdpa"
    return PnMixCache(model_config=model.config), "pnmix"


def set_core_arith(kind: str) -> None:
    """Before a PnMixCache row's steps: the core attention's arithmetic for that row (process-wide)."""
    if kind in PNMIX_ARITH:
        from pnmix.backends.core_ops import CoreOps

        CoreOps().set_arith(PNMIX_ARITH[kind])


def int8_unavailable_reason() -> Optional[str]:
    """Why the pnmix_int8 row cannot run here (no libpnmix_core, no AVX2), or None."""
    from pnmix._native import NativeLibraryError

    try:
        set_core_arith("pnmix_int8")
        set_core_arith("pnmix")
    except (NativeLibraryError, PnMixError) as exc:
        return str(exc)
    return None


def filled_cache(kind: str, model, keys: list, values: list, context: int) -> tuple[Any, str]:
    """A cache of `kind` holding the first `context` prompt tokens, filled the way the model's
    prefill fills it (evaluate.hand_over_prefill), and the attention implementation that reads it."""
    from pnmix.hf.evaluate.prefill import hand_over_prefill

    cache, attn = new_cache(kind, model)
    return hand_over_prefill(cache, list(zip(keys, values)), context), attn


def cache_memory(kind: str, cache) -> tuple[int, int]:
    """(bytes the cache holds, bytes its own tensors take as allocated, capacity included)."""
    from pnmix.hf.evaluate.kv_bytes import dynamic_cache_bytes, quantized_cache_bytes

    if kind in PNMIX_ARITH:
        return cache.persistent_bytes(), cache.allocated_bytes()
    held = quantized_cache_bytes(cache) if kind == "quanto4" else dynamic_cache_bytes(cache)
    return held, held


def layer_copy_bytes(kind: str, model, tokens: int, batch: int) -> int:
    """The full-precision K/V one layer's update builds per decode step next to what it holds:
    DynamicCache's torch.cat makes the grown K/V while the old ones live; QuantizedCache
    dequantizes the layer and concatenates (two copies); the packed path makes none."""
    if kind in PNMIX_ARITH:
        return 0
    config = model.config
    from pnmix.hf.models import ModelDims

    dims = ModelDims.from_config(config)
    one = dims.kv_bytes(tokens, next(model.parameters()).element_size(), batch) // dims.layers  # one layer's
    return one if kind == "dynamic" else 2 * one


ROUND_TOKENS = 8  # decode steps per cache in each round of the interleaved timing


class DecodeRun:
    """One cache's greedy decode, advanced a few steps at a time (step), timing each step."""

    def __init__(self, model, kind: str, cache, attn: str, first: torch.Tensor):
        self.model, self.kind, self.attn = model, kind, attn
        self.batch = first.shape[0]
        model.set_attn_implementation(attn)
        set_core_arith(kind)
        with torch.no_grad():  # untimed warm-up: the first call of each layer path
            self.out = model(input_ids=first, cache=cache, use_cache=True)
        self.steps = Stopwatch()
        self.peak = 0

    @torch.no_grad()
    def step(self, count: int) -> None:
        self.model.set_attn_implementation(self.attn)
        set_core_arith(self.kind)
        for _ in range(count):
            token = self.out.logits[:, -1:].argmax(-1)
            self.out = self.steps.time(self.model, input_ids=token, cache=self.out.cache, use_cache=True)
            self.peak = max(self.peak, cache_memory(self.kind, self.out.cache)[1])

    def result(self) -> Dict[str, Any]:
        held, _ = cache_memory(self.kind, self.out.cache)
        tokens = self.out.cache.get_seq_length()
        timing = self.steps.timing()
        return {"tokens_per_s": self.batch / timing.median_s, "median_step_seconds": timing.median_s,
                "decode_seconds": timing.total_s, "mean_tokens_per_s": self.batch * timing.count / timing.total_s,
                "cache_bytes": held, "peak_bytes": self.peak + layer_copy_bytes(self.kind, self.model, tokens, self.batch),
                "backend": self.backend()}

    def backend(self) -> Optional[str]:
        name = getattr(self.out.cache, "ops_name", None)
        return f"{name} int8" if name and self.kind == "pnmix_int8" else name


def time_decodes(runs: List[DecodeRun], new_tokens: int) -> None:
    """new_tokens steps of every run, in rounds of ROUND_TOKENS steps per cache: a burst of load
    on a shared machine then falls on every cache alike instead of on the one timed at that moment."""
    for done in range(0, new_tokens, ROUND_TOKENS):
        for run in runs:
            run.step(min(ROUND_TOKENS, new_tokens - done))


def check_bench_size(model, longest: int, new_tokens: int, caches: tuple) -> None:
    """Before anything is allocated: a model with attention layers, a longest context within the
    model's positions (decoding may run past them; a prompt may not), and memory for the prefill's
    K/V plus one filled cache of each kind and its per-step copy (dense, at the model's precision)."""
    from pnmix.hf.models import ModelDims
    from pnmix.memory import check_fits, human

    dims = ModelDims.from_config(model.config)
    if dims.layers < 1:
        raise PnMixError(f"the model has {dims.layers} layers (num_hidden_layers): nothing to cache")
    if dims.max_positions and longest > dims.max_positions:
        raise PnMixError(f"--contexts {longest} is beyond the model's {dims.max_positions} positions "
                         "(max_position_embeddings)")
    element = next(model.parameters()).element_size()
    dense = dims.kv_bytes(longest + new_tokens + 1, element)
    # the prefill's K/V, then per context one filled cache of each kind at once (DynamicCache's
    # own copy, QuantizedCache's dequantized one), the prefill's logits over the vocabulary
    need = dense * (1 + 2 * len(caches)) + (longest + 1) * int(model.config.vocab_size) * 4
    check_fits(need, f"--contexts {longest} ({human(dense)} of K/V per cache)", "give shorter --contexts")


def run_generate_bench(model, contexts: List[int], new_tokens: int = 64, caches: tuple = GENERATE_CACHES,
                       seed: int = 0) -> Dict[str, Any]:
    """The benchmark as data: {"results": [{"cache", "context", "tokens_per_s", "cache_bytes",
    "peak_bytes", ...}], "skipped": [...], ...}. One prefill, at the longest context, serves every
    cache and context (random prompt tokens; the first decode input is the prompt's next token)."""
    from pnmix.hf import register

    register()
    if not 1 <= new_tokens <= MAX_NEW_TOKENS:
        raise PnMixError(f"--new-tokens must be 1..{MAX_NEW_TOKENS}, got {new_tokens}")
    longest = max(contexts)
    # RoPE takes any position: decoding past the trained length changes the tokens, not the speed
    from pnmix.hf.models import max_positions

    limit = max_positions(model.config)
    check_bench_size(model, longest, new_tokens, caches)
    past_trained = bool(limit) and longest + new_tokens + 1 > limit
    vocab = int(model.config.vocab_size)
    ids = torch.randint(1, vocab, (1, longest + 1), generator=torch.Generator().manual_seed(seed))
    model.set_attn_implementation("sdpa")
    (keys, values), prefill_seconds = time_once(prefill_kv, model, ids[:, :longest])
    skipped = {}
    if "quanto4" in caches and quanto_unavailable_reason() is not None:
        skipped["quanto4"] = quanto_unavailable_reason()
    if "pnmix_int8" in caches and int8_unavailable_reason() is not None:
        skipped["pnmix_int8"] = int8_unavailable_reason()
    results = []
    for context in contexts:
        first = ids[:, context:context + 1]
        runs = [DecodeRun(model, kind, *filled_cache(kind, model, keys, values, context), first)
                for kind in caches if kind not in skipped]
        try:
            time_decodes(runs, new_tokens)
        finally:
            set_core_arith("pnmix")  # back to the environment's arithmetic
        results += [{"cache": run.kind, "context": context, **run.result()} for run in runs]
        del runs
    _add_generate_ratios(results)
    return {"model": getattr(model.config, "_name_or_path", "") or model.config.model_type,
            "layers": model.config.num_hidden_layers, "dtype": str(model.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "new_tokens": new_tokens, "contexts": contexts,
            "prefill_tokens": longest, "prefill_seconds": prefill_seconds,
            "trained_positions": limit or None, "past_trained_positions": past_trained, "results": results,
            "skipped": [{"cache": name, "reason": why} for name, why in skipped.items()],
            "machine": describe_machine(str(model.device))}


def _add_generate_ratios(results: List[dict]) -> None:
    dynamic = {r["context"]: r for r in results if r["cache"] == "dynamic"}
    for r in results:
        base = dynamic.get(r["context"])
        if base is not None:
            r["speedup_vs_dynamic"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["memory_saving_vs_dynamic"] = base["cache_bytes"] / r["cache_bytes"]


GENERATE_COLUMNS = ("context", "cache", "backend", "decode tok/s", "vs dynamic", "cache MB", "peak MB",
                    "memory vs dynamic")


def _generate_row(r: Dict[str, Any]) -> List[str]:
    mb = 1e6
    ratio, saving = r.get("speedup_vs_dynamic"), r.get("memory_saving_vs_dynamic")
    return [str(r["context"]), r["cache"], r["backend"] or "-", f"{r['tokens_per_s']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x", f"{r['cache_bytes'] / mb:.2f}", f"{r['peak_bytes'] / mb:.2f}",
            "-" if saving is None else f"{saving:.1f}x smaller"]


def print_generate_report(report: Dict[str, Any]) -> None:
    notes = [f"one prefill of {report['prefill_tokens']} tokens ({report['prefill_seconds']:.1f} s) served every "
             "row; peak = the cache's tensors as allocated plus the full-precision K/V copy one layer's "
             "update makes per step; tokens/s from the median step, the caches taking turns in rounds of "
             f"{ROUND_TOKENS} steps"]
    if report["past_trained_positions"]:
        notes.append(f"note: the longest run decodes past the model's {report['trained_positions']} trained "
                     "positions (RoPE extends; the tokens change, the speed does not)")
    print_table(f"pnmix bench generate: {report['model']}, {report['layers']} layers, {report['dtype']}, "
                f"{report['threads']} threads, {report['new_tokens']} new tokens",
                GENERATE_COLUMNS, map(_generate_row, report["results"]), left=("cache", "backend"),
                notes=notes + skipped_notes(report["skipped"], "cache"))


def generate_command(model: str, contexts: str, new_tokens: int, threads: Optional[int],
                     json_path: Optional[Path]) -> int:
    """The CLI's `pnmix bench generate` (pnmix/cli.py): print the table, write JSON, return 0."""
    from pnmix.hf.models import load_causal_lm, load_model_config, resolve_model

    def run() -> Dict[str, Any]:
        wanted = parse_contexts(contexts)
        chosen = check_threads(threads)
        if chosen is not None:
            torch.set_num_threads(chosen)
        source = resolve_model(model)
        lm = load_causal_lm(source, "fp32", model_config=load_model_config(source))
        return {**run_generate_bench(lm, wanted, new_tokens), "model": source.name}

    run_report(json_path, run, print_generate_report)
    return 0
