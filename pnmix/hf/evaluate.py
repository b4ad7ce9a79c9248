"""`pnmix hf-eval`: teacher-forced KL and perplexity of PnMixCache and QuantizedCache vs full precision.

Protocol (docs/HF.md): the first ``prompt_tokens`` tokens of the text; the first half is one
prefill call, the second half is fed one token per forward call (teacher forcing: the true token,
not the model's choice). Each decode step's next-token distribution is compared with the same
step under a full-precision DynamicCache: mean KL(p_full || p_cache) over the decode steps, and
the perplexity of the text's next tokens. Cache bytes are measured after all prompt_tokens.
The prefill itself attends in full precision under every cache (SPEC), so it is not scored.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from ..config import PnMixConfig, read_json_file
from ..errors import PnMixError, describe
from ..io import check_input_file, check_output_path, read_text, write_json_atomic
from ._deps import quanto_unavailable_reason, require_transformers

MIN_PROMPT_TOKENS = 4
QUANTO_BITS = 2


# ---- inputs --------------------------------------------------------------------------------
def check_model_dir(model_dir: Path) -> Any:
    """The model's config from a local directory (never the hub), with one-line errors."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise PnMixError(f"model directory not found: {model_dir}")
    if not model_dir.is_dir():
        raise PnMixError(f"model path is not a directory: {model_dir}")
    if not (model_dir / "config.json").exists():
        raise PnMixError(f"not a Hugging Face model directory (no config.json): {model_dir}")
    for entry in sorted(model_dir.iterdir()):  # transformers opens them: a FIFO would hang it
        if not entry.is_dir():
            check_input_file(entry, "model")
    require_transformers()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:
        raise PnMixError(f"cannot read the model config in {model_dir}: {type(exc).__name__}: {exc}") from None


def load_model(model_dir: Path):
    """A causal LM from a local directory, in its stored dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the command prints one table, or one error line
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype="auto")
    except Exception as exc:
        raise PnMixError(f"cannot load a causal LM from {model_dir}: {type(exc).__name__}: {exc}") from None
    return model.eval()


def tokenize(model_dir: Path, text_path: Path, vocab_size: int) -> tuple[torch.Tensor, str]:
    """Token ids [1, n] of the text: the model's tokenizer when the directory has one, else the
    text's UTF-8 bytes as ids (byte-level models, and the tests' tokenizer-free random models)."""
    text = read_text(text_path, "text")
    has_tokenizer = any((Path(model_dir) / name).is_file()
                        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if has_tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:
            raise PnMixError(f"cannot load the tokenizer in {model_dir}: {type(exc).__name__}: {exc}") from None
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        return ids.to(torch.long), type(tokenizer).__name__
    if vocab_size < 256:
        raise PnMixError(f"{model_dir} has no tokenizer and a vocabulary of {vocab_size} < 256: "
                         "cannot feed the text as bytes")
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long).unsqueeze(0)
    return ids, "utf-8 bytes"


def load_config(path: Optional[Path], model_config: Any) -> PnMixConfig:
    from .cache import resolve_config

    fields: Dict[str, Any] = {}
    if path is not None:
        fields = read_json_file(path, "config")
        if not isinstance(fields, dict):
            raise PnMixError(f"config file {path} must hold a JSON object of pn-mix config fields")
    base = resolve_config(None, {}, model_config)
    return resolve_config(PnMixConfig.from_mapping(fields, base=base), {}, model_config)


# ---- caches and their bytes ------------------------------------------------------------------
def _tensor_bytes(t: Any) -> int:
    """Bytes of a tensor, or of the plain tensors inside a tensor subclass (quanto's packed tensors)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def dynamic_cache_bytes(cache) -> int:
    return sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values) for layer in cache.layers)


def quantized_cache_bytes(cache) -> int:
    """Quantized states (codes, scales, shifts) plus the full-precision residual, over layers."""
    return sum(_tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
               + _tensor_bytes(layer.keys) + _tensor_bytes(layer.values) for layer in cache.layers)


# ---- the teacher-forced run --------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_logprobs(model, ids: torch.Tensor, prefill: int, cache) -> torch.Tensor:
    """Log-probabilities [steps, vocab] after each decode step (tokens prefill..n-1, one per call)."""
    out = model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
    rows: List[torch.Tensor] = []
    for t in range(prefill, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True)
        rows.append(torch.log_softmax(out.logits[0, -1].float(), dim=-1))
    return torch.stack(rows)


def score(logp: torch.Tensor, logp_full: torch.Tensor, targets: torch.Tensor) -> Dict[str, float]:
    """Mean KL(p_full || p) over steps; perplexity of the targets (step i predicts targets[i])."""
    kl = (logp_full.exp() * (logp_full - logp)).sum(-1).mean().item()
    scored = logp[: targets.numel()]
    nll = -scored.gather(1, targets.view(-1, 1)).mean().item()
    return {"kl": max(kl, 0.0), "perplexity": float(torch.exp(torch.tensor(nll)))}


def run_cache(model, ids, prefill, make_cache: Callable, measure: Callable,
              attn: Optional[str] = None) -> Dict[str, Any]:
    """One teacher-forced run; attn: the attention implementation (None: the model's own)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn or previous)
    try:
        with torch.no_grad():  # warm-up, so that first-call costs do not land on one cache's time
            model(input_ids=ids[:, :8], use_cache=False)
        cache = make_cache()
        start = time.perf_counter()
        logp = teacher_forced_logprobs(model, ids, prefill, cache)
        seconds = time.perf_counter() - start
    finally:
        model.set_attn_implementation(previous)
    return {"logp": logp, "bytes": measure(cache), "seconds": seconds, "cache": cache}


def evaluate(model, ids: torch.Tensor, config: PnMixConfig) -> Dict[str, Any]:
    """The three runs and their figures (see the module docstring)."""
    from transformers import DynamicCache, QuantizedCache

    from .cache import PnMixCache

    n = ids.shape[1]
    prefill = n // 2
    targets = ids[0, prefill + 1:]
    full = run_cache(model, ids, prefill, lambda: DynamicCache(config=model.config), dynamic_cache_bytes)
    results: List[Dict[str, Any]] = [{
        "cache": "full precision (DynamicCache)", "available": True, "bytes": full["bytes"],
        "kl": 0.0, "perplexity": score(full["logp"], full["logp"], targets)["perplexity"],
        "seconds": round(full["seconds"], 3),
    }]
    pn = run_cache(model, ids, prefill, lambda: PnMixCache(config, model_config=model.config),
                   lambda c: c.persistent_bytes(), "pnmix")
    results.append({"cache": "PnMixCache", "available": True, "bytes": pn["bytes"],
                    **score(pn["logp"], full["logp"], targets), "seconds": round(pn["seconds"], 3),
                    "backend": pn["cache"].ops_name})
    reason = quanto_unavailable_reason()
    if reason is None:
        try:
            qc = run_cache(model, ids, prefill,
                           lambda: QuantizedCache(backend="quanto", config=model.config, nbits=QUANTO_BITS),
                           quantized_cache_bytes)
        except Exception as exc:  # a quanto failure must not hide the PnMixCache figures
            reason = f"QuantizedCache failed: {describe(exc)}"
    name = f"QuantizedCache (quanto, {QUANTO_BITS}-bit)"
    if reason is None:
        results.append({"cache": name, "available": True, "bytes": qc["bytes"],
                        **score(qc["logp"], full["logp"], targets), "seconds": round(qc["seconds"], 3)})
    else:
        results.append({"cache": name, "available": False, "reason": reason})
    return {"prompt_tokens": n, "prefill_tokens": prefill, "decode_tokens": n - prefill, "results": results}


# ---- the command -----------------------------------------------------------------------------
def hf_eval_command(model_dir: Path, text: Path, prompt_tokens: int, config: Optional[Path],
                    json_path: Optional[Path]) -> int:
    if prompt_tokens < MIN_PROMPT_TOKENS:
        raise PnMixError(f"--prompt-tokens must be at least {MIN_PROMPT_TOKENS}, got {prompt_tokens}")
    if not Path(text).is_file():  # checked before the (slow) model load
        raise PnMixError(f"text file not found: {text}")
    if json_path is not None:
        check_output_path(json_path)  # before the evaluation, not after it
    from .attention import register

    register()
    model_config = check_model_dir(model_dir)
    pn_config = load_config(config, model_config)
    ids, tokenizer = tokenize(model_dir, text, int(getattr(model_config, "vocab_size", 0) or 0))
    if ids.shape[1] < prompt_tokens:
        raise PnMixError(f"text {text} has {ids.shape[1]} tokens ({tokenizer}); --prompt-tokens asks for {prompt_tokens}")
    model = load_model(model_dir)
    ids = ids[:, :prompt_tokens].to(next(model.parameters()).device)
    report = {"model_dir": str(model_dir), "model_type": getattr(model.config, "model_type", None),
              "dtype": str(model.dtype).replace("torch.", ""), "tokenizer": tokenizer, "text": str(text),
              "config": pn_config.to_dict(), **evaluate(model, ids, pn_config)}
    _print_table(report)
    if json_path is not None:
        write_json_atomic(json_path, report)
    return 0


def _print_table(report: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=(f"hf-eval: {report['model_type']} ({report['dtype']}), {report['prompt_tokens']} tokens "
                         f"({report['prefill_tokens']} prefill + {report['decode_tokens']} teacher-forced), "
                         f"tokenizer: {report['tokenizer']}"))
    for column in ("cache", "bytes", "vs full", "KL vs full", "perplexity", "seconds"):
        table.add_column(column, justify="left" if column == "cache" else "right")
    full_bytes = report["results"][0]["bytes"]
    for row in report["results"]:
        if not row["available"]:
            table.add_row(row["cache"], "-", "-", "-", "-", f"unavailable: {row['reason']}")
            continue
        table.add_row(row["cache"], f"{row['bytes']:,}", f"{row['bytes'] / full_bytes:.3f}x",
                      f"{row['kl']:.3e}", f"{row['perplexity']:.3f}", f"{row['seconds']:.2f}")
    Console().print(table)
