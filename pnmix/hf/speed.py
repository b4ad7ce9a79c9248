"""Generation speed of the caches, with and without the pnmix attention path (docs/HF.md).

    PYTHONPATH=. python3 -m pnmix.hf.speed [--model-dir DIR] [--prompt-tokens 1024] [--new-tokens 64]

Without --model-dir it builds a random Llama (sizes from the options, no download). For each
cache it times a greedy generation (one prefill forward, then one forward per new token, the
fastest of --repeats runs) and reports the prefill time, decode tokens/s, the persistent cache
bytes and, for the dequantized path, the largest K/V copy one layer handed to
the model's attention.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any, Callable, Dict, List

import torch

from ..io import check_output_path, write_json_atomic
from ._deps import quanto_unavailable_reason, require_transformers


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

    from .cache import PnMixCache

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
    from .evaluate import dynamic_cache_bytes, quantized_cache_bytes

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


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pnmix.hf.speed", description=__doc__.split("\n\n")[0])
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
    from . import register
    from .evaluate import load_model

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
