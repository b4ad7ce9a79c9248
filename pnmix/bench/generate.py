"""Generation speed of the caches, with and without the pnmix attention path (docs/HF.md), and
`pnmix bench generate` (run_generate_bench: decode tokens/s and cache memory on a real model).

    PYTHONPATH=. python3 -m pnmix.bench.generate [--model-dir DIR] [--prompt-tokens 1024] [--new-tokens 64]

Without --model-dir it builds a random Llama (sizes from the options, no download). For each
cache it times a greedy generation (one prefill forward, then one forward per new token, the
fastest of --repeats runs) and reports the prefill time, decode tokens/s, the persistent cache
bytes and, for the dequantized path, the largest K/V copy one layer handed to
the model's attention.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from pnmix.errors import PnMixError
from pnmix.io import check_output_path, write_json_atomic
from pnmix.hf._deps import quanto_unavailable_reason, require_transformers


def random_llama(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=65536, eos_token_id=None,
                         bos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def caches(model) -> List[tuple[str, str, Callable[[], Any]]]:
    """(name, attention implementation, cache factory) of each run."""
    from transformers import DynamicCache, QuantizedCache

    from pnmix.hf.cache import PnMixCache

    runs = [("DynamicCache (full precision)", "sdpa", lambda: DynamicCache(config=model.config)),
            ("PnMixCache, dequantized path", "sdpa", lambda: PnMixCache(model_config=model.config)),
            ("PnMixCache, pnmix attention", "pnmix", lambda: PnMixCache(model_config=model.config)),
            # The reference attend dequantizes internally: the kernels, not the path, save the copy.
            ("PnMixCache, pnmix attention, reference backend", "pnmix",
             lambda: PnMixCache(model_config=model.config, backend="torch"))]
    if quanto_unavailable_reason() is None:
        runs.append(("QuantizedCache (quanto, 2-bit)", "sdpa",
                     lambda: QuantizedCache(backend="quanto", config=model.config, nbits=2)))
    return runs


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int, cache) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of a greedy generation: one prefill call, then one
    forward call per new token (what generate does, without its bookkeeping in the timing)."""
    start = time.perf_counter()
    out = model(input_ids=ids, cache=cache, use_cache=True)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=token, cache=out.cache, use_cache=True)
    return prefill, time.perf_counter() - start


@torch.no_grad()
def time_run(model, ids: torch.Tensor, new_tokens: int, attn: str, make_cache, repeats: int = 3) -> Dict[str, Any]:
    from pnmix.hf.evaluate import dynamic_cache_bytes, quantized_cache_bytes

    model.set_attn_implementation(attn)
    model(input_ids=ids[:, :8], use_cache=False)  # warm-up
    runs = []
    for _ in range(repeats):
        cache = make_cache()
        runs.append((*greedy(model, ids, new_tokens, cache), cache))
    prefill = min(run[0] for run in runs)  # the fastest: the least disturbed by other load
    _, decode, cache = min(runs, key=lambda run: run[1])
    if hasattr(cache, "persistent_bytes"):
        held, copy = cache.persistent_bytes(), cache.peak_copy_bytes()
    elif hasattr(cache.layers[0], "_quantized_keys"):
        held, copy = quantized_cache_bytes(cache), None
    else:
        held, copy = dynamic_cache_bytes(cache), None
    return {"prefill_seconds": round(prefill, 4), "decode_seconds": round(decode, 4),
            "decode_tokens_per_second": round(ids.shape[0] * new_tokens / decode, 2),
            "cache_bytes": held, "peak_dequantized_copy_bytes": copy,
            "backend": getattr(cache, "ops_name", None)}


# ---------------------------------------------------------------------------------------
# `pnmix bench generate`: decode tokens/s and cache memory on a real model at long context
# ---------------------------------------------------------------------------------------

GENERATE_CACHES = ("dynamic", "quanto4", "pnmix")
MAX_NEW_TOKENS = 1 << 16


def parse_contexts(text: str) -> List[int]:
    from pnmix.errors import parse_positive_ints

    return sorted(set(parse_positive_ints(text, "--contexts")))


def prefill_kv(model, ids: torch.Tensor) -> tuple[list, list]:
    """Per layer, the post-RoPE K/V [B, H, n, D] that the model hands its cache for prompt ids."""
    from pnmix.hf.evaluate import run_prefill

    kv = run_prefill(model, ids).kv
    return [k for k, _ in kv], [v for _, v in kv]


def new_cache(kind: str, model):
    """An empty cache of `kind` and the attention implementation that reads it."""
    from transformers import DynamicCache, QuantizedCache

    from pnmix.hf.cache import PnMixCache

    if kind == "dynamic":
        return DynamicCache(config=model.config), "sdpa"
    if kind == "quanto4":
        return QuantizedCache(backend="quanto", config=model.config, nbits=4), "sdpa"
    return PnMixCache(model_config=model.config), "pnmix"


def filled_cache(kind: str, model, keys: list, values: list, context: int):
    """A cache of `kind` holding the first `context` prompt tokens, filled the way the model's
    prefill fills it (evaluate.hand_over_prefill), and the attention implementation that reads it."""
    from pnmix.hf.evaluate import hand_over_prefill

    cache, attn = new_cache(kind, model)
    return hand_over_prefill(cache, list(zip(keys, values)), context), attn


def cache_memory(kind: str, cache) -> tuple[int, int]:
    """(bytes the cache holds, bytes its own tensors take as allocated, capacity included)."""
    from pnmix.hf.evaluate import dynamic_cache_bytes, quantized_cache_bytes

    if kind == "pnmix":
        return cache.persistent_bytes(), cache.allocated_bytes()
    held = quantized_cache_bytes(cache) if kind == "quanto4" else dynamic_cache_bytes(cache)
    return held, held


def layer_copy_bytes(kind: str, model, tokens: int, batch: int) -> int:
    """The full-precision K/V one layer's update builds per decode step next to what it holds:
    DynamicCache's torch.cat makes the grown K/V while the old ones live; QuantizedCache
    dequantizes the layer and concatenates (two copies); the packed path makes none."""
    if kind == "pnmix":
        return 0
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    one = 2 * batch * config.num_key_value_heads * tokens * head_dim * next(model.parameters()).element_size()
    return one if kind == "dynamic" else 2 * one


ROUND_TOKENS = 8  # decode steps per cache in each round of the interleaved timing


class DecodeRun:
    """One cache's greedy decode, advanced a few steps at a time (step), timing each step."""

    def __init__(self, model, kind: str, cache, attn: str, first: torch.Tensor):
        self.model, self.kind, self.attn = model, kind, attn
        self.batch = first.shape[0]
        model.set_attn_implementation(attn)
        with torch.no_grad():  # untimed warm-up: the first call of each layer path
            self.out = model(input_ids=first, cache=cache, use_cache=True)
        self.step_seconds: List[float] = []
        self.peak = 0

    @torch.no_grad()
    def step(self, count: int) -> None:
        self.model.set_attn_implementation(self.attn)
        for _ in range(count):
            token = self.out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            self.out = self.model(input_ids=token, cache=self.out.cache, use_cache=True)
            self.step_seconds.append(time.perf_counter() - start)
            self.peak = max(self.peak, cache_memory(self.kind, self.out.cache)[1])

    def result(self) -> Dict[str, Any]:
        held, _ = cache_memory(self.kind, self.out.cache)
        tokens = self.out.cache.get_seq_length()
        median = statistics.median(self.step_seconds)
        return {"tokens_per_s": self.batch / median, "median_step_seconds": median,
                "decode_seconds": sum(self.step_seconds),
                "mean_tokens_per_s": self.batch * len(self.step_seconds) / sum(self.step_seconds),
                "cache_bytes": held, "peak_bytes": self.peak + layer_copy_bytes(self.kind, self.model, tokens, self.batch),
                "backend": getattr(self.out.cache, "ops_name", None)}


def time_decodes(runs: List[DecodeRun], new_tokens: int) -> None:
    """new_tokens steps of every run, in rounds of ROUND_TOKENS steps per cache: a burst of load
    on a shared machine then falls on every cache alike instead of on the one timed at that moment."""
    for done in range(0, new_tokens, ROUND_TOKENS):
        for run in runs:
            run.step(min(ROUND_TOKENS, new_tokens - done))


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
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    past_trained = bool(limit) and longest + new_tokens + 1 > limit
    vocab = int(model.config.vocab_size)
    ids = torch.randint(1, vocab, (1, longest + 1), generator=torch.Generator().manual_seed(seed))
    model.set_attn_implementation("sdpa")
    start = time.perf_counter()
    keys, values = prefill_kv(model, ids[:, :longest])
    prefill_seconds = time.perf_counter() - start
    skipped = {}
    if "quanto4" in caches and quanto_unavailable_reason() is not None:
        skipped["quanto4"] = quanto_unavailable_reason()
    results = []
    for context in contexts:
        first = ids[:, context:context + 1]
        runs = [DecodeRun(model, kind, *filled_cache(kind, model, keys, values, context), first)
                for kind in caches if kind not in skipped]
        time_decodes(runs, new_tokens)
        results += [{"cache": run.kind, "context": context, **run.result()} for run in runs]
        del runs
    _add_generate_ratios(results)
    return {"model": getattr(model.config, "_name_or_path", "") or model.config.model_type,
            "layers": model.config.num_hidden_layers, "dtype": str(model.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "new_tokens": new_tokens, "contexts": contexts,
            "prefill_tokens": longest, "prefill_seconds": prefill_seconds,
            "trained_positions": limit or None, "past_trained_positions": past_trained, "results": results,
            "skipped": [{"cache": name, "reason": why} for name, why in skipped.items()]}


def _add_generate_ratios(results: List[dict]) -> None:
    dynamic = {r["context"]: r for r in results if r["cache"] == "dynamic"}
    for r in results:
        base = dynamic.get(r["context"])
        if base is not None:
            r["speedup_vs_dynamic"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["memory_saving_vs_dynamic"] = base["cache_bytes"] / r["cache_bytes"]


def print_generate_report(report: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mb = 1e6
    table = Table(title=(f"pnmix bench generate: {report['model']}, {report['layers']} layers, {report['dtype']}, "
                         f"{report['threads']} threads, {report['new_tokens']} new tokens"))
    for column in ("context", "cache", "backend", "decode tok/s", "vs dynamic", "cache MB", "peak MB",
                   "memory vs dynamic"):
        table.add_column(column, justify="left" if column in ("cache", "backend") else "right")
    for r in report["results"]:
        ratio = r.get("speedup_vs_dynamic")
        saving = r.get("memory_saving_vs_dynamic")
        table.add_row(str(r["context"]), r["cache"], r["backend"] or "-", f"{r['tokens_per_s']:.1f}",
                      "-" if ratio is None else f"{ratio:.2f}x", f"{r['cache_bytes'] / mb:.2f}",
                      f"{r['peak_bytes'] / mb:.2f}", "-" if saving is None else f"{saving:.1f}x smaller")
    console = Console(width=160)
    console.print(table)
    console.print(f"one prefill of {report['prefill_tokens']} tokens ({report['prefill_seconds']:.1f} s) served every "
                  "row; peak = the cache's tensors as allocated plus the full-precision K/V copy one layer's "
                  "update makes per step; tokens/s from the median step, the caches taking turns in rounds of "
                  f"{ROUND_TOKENS} steps", highlight=False)
    if report["past_trained_positions"]:
        console.print(f"note: the longest run decodes past the model's {report['trained_positions']} trained "
                      "positions (RoPE extends; the tokens change, the speed does not)", highlight=False)
    for s in report["skipped"]:
        console.print(f"[yellow]skipped[/] {s['cache']}: {s['reason']}", highlight=False)


def generate_command(model: str, contexts: str, new_tokens: int, threads: Optional[int],
                     json_path: Optional[Path]) -> int:
    """The CLI's `pnmix bench generate` (pnmix/cli.py): print the table, write JSON, return 0."""
    from pnmix.hf.models import load_causal_lm, load_model_config, resolve_model

    if json_path is not None:
        check_output_path(json_path)
    wanted = parse_contexts(contexts)
    if threads is not None:
        if not 1 <= threads <= 1024:
            raise PnMixError(f"--threads must be 1..1024, got {threads}")
        torch.set_num_threads(threads)
    source = resolve_model(model)
    config = load_model_config(source)
    lm = load_causal_lm(source, "fp32", model_config=config)
    report = run_generate_bench(lm, wanted, new_tokens)
    report["model"] = source.name
    print_generate_report(report)
    if json_path is not None:
        write_json_atomic(json_path, report)
    return 0


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pnmix.bench.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="a local Hugging Face causal LM (default: a random Llama)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cache; the fastest counts")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    args = parser.parse_args(argv)
    if args.json_path:
        check_output_path(args.json_path)
    require_transformers()
    from pnmix.hf import register
    from pnmix.hf.evaluate import load_model

    register()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_dir:
        model = load_model(args.model_dir)
    else:
        model = random_llama(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim)
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    ids = torch.randint(1, vocab, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    rows = []
    for name, attn, make_cache in caches(model):
        rows.append({"cache": name, "attention": attn, **time_run(model, ids, args.new_tokens, attn, make_cache, args.repeats)})
    report = {"model": args.model_dir or "random Llama", "layers": model.config.num_hidden_layers,
              "device": str(device), "threads": torch.get_num_threads(), "dtype": str(model.dtype),
              "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "results": rows}
    _print(report)
    if args.json_path:
        write_json_atomic(args.json_path, report)
    return 0


def _print(report: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=(f"{report['model']}, {report['layers']} layers, {report['dtype']}, {report['device']}, "
                         f"batch {report['batch']}, {report['prompt_tokens']} prompt + {report['new_tokens']} new"))
    for column in ("cache", "backend", "prefill s", "decode tok/s", "cache bytes", "dequantized copy"):
        table.add_column(column, justify="left" if column in ("cache", "backend") else "right")
    for row in report["results"]:
        copy = row["peak_dequantized_copy_bytes"]
        table.add_row(row["cache"], row["backend"] or "-", f"{row['prefill_seconds']:.3f}",
                      f"{row['decode_tokens_per_second']:.1f}", f"{row['cache_bytes']:,}",
                      "-" if copy is None else f"{copy:,}")
    Console(width=160).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
