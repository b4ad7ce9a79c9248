"""`pnmix eval MODEL`: KV-cache methods on a real model, scored against full precision (docs/EVAL.md).

Every method is a named preset in METHODS, one table: transformers' DynamicCache (the reference),
PnMixCache with the manifest's config and with pn-mix configs that reproduce other schemes
(uniform 2-bit keys, KIVI), and transformers' QuantizedCache (quanto).

Protocol. The prefill attends in full precision under every cache (SPEC section 2), so it is run
ONCE per text with a DynamicCache, and each method's fresh cache is handed that prefill's K/V
layer by layer through ``cache.update(k, v, layer_idx)``, exactly what the prefill forward call
would have handed it (tests/harness/test_eval.py checks the results are identical). Each method then runs
only its decode steps, one token per forward call, PnMixCache under the ``pnmix`` attention:

* task ``kl``: the text's first P tokens are the prefill, the next D are teacher-forced; step i's
  distribution is scored against the reference's: mean KL(p_ref || p), the perplexity of the true
  next tokens, top-1 agreement with the reference, decode tokens/s.
* task ``passkey``: a haystack of Hamlet with a pass-key sentence at a depth is the prefill, the
  question goes through the decode path token by token, then greedy generation; a trial is right
  when the first number generated is the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import random
import re
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..config import PnMixConfig, read_json_file
from ..errors import PnMixError, describe, parse_positive_ints
from ..io import check_output_path, write_bytes_atomic, write_json_atomic
from ._deps import quanto_unavailable_reason, require_transformers

TASKS = ("kl", "passkey")
DEFAULT_CONTEXTS = (1024,)
DEFAULT_DECODE_TOKENS = 256
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_TRIALS = 5
CONFIG_METHOD = "config"  # the name of the --config FILE method


# ---- the methods: one table ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Method:
    """A KV-cache method: which cache class, with which settings.

    cache: "dynamic" (transformers' DynamicCache), "pnmix" (PnMixCache; ``settings`` are pn-mix
    config fields laid over the manifest's) or "quanto" (QuantizedCache; ``settings`` are its
    keyword arguments)."""

    name: str
    cache: str
    about: str
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def kivi(bits: int, group: int) -> Dict[str, Any]:
    """KIVI (Liu et al. 2024) as a pn-mix config: keys per channel over G-token groups, values per
    token in blocks of G channels, an fp16 residual of 128 tokens, no sink, one key bit width."""
    return {"sink_tokens": 0, "key_high_bits": bits, "key_low_bits": bits, "value_bits": bits,
            "group_size": group, "value_group_size": group, "residual_size": 128}


REFERENCE = "fp16"
METHODS: Dict[str, Method] = {m.name: m for m in (
    Method(REFERENCE, "dynamic", "transformers' DynamicCache in the model's dtype: the reference"),
    Method("pnmix", "pnmix", "PnMixCache, the manifest's config (3/1-bit keys by pair energy, 2-bit values, "
                             "32-token sink)"),
    Method("uniform2", "pnmix", "PnMixCache with 2-bit keys everywhere (same bytes, no saliency mixing)",
           {"key_high_bits": 2, "key_low_bits": 2}),
    Method("kivi2-g128", "pnmix", "KIVI 2-bit, group 128, as a pn-mix config", kivi(2, 128)),
    Method("kivi2-g32", "pnmix", "KIVI 2-bit, group 32, as a pn-mix config", kivi(2, 32)),
    Method("kivi4-g128", "pnmix", "KIVI 4-bit, group 128, as a pn-mix config", kivi(4, 128)),
    Method("quanto2", "quanto", "transformers' QuantizedCache, quanto backend, 2-bit", {"nbits": 2}),
    Method("quanto4", "quanto", "transformers' QuantizedCache, quanto backend, 4-bit", {"nbits": 4}),
)}


def parse_methods(text: Optional[str], config_path: Optional[Path]) -> List[Method]:
    """--methods (comma list; default every preset this machine can run) plus --config FILE.
    The reference always runs first: every other method is scored against it."""
    if text is None:
        names = [n for n, m in METHODS.items() if m.cache != "quanto" or quanto_unavailable_reason() is None]
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise PnMixError("--methods is empty: name at least one method (--methods list shows them)")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise PnMixError(f"unknown method {unknown[0]!r} in --methods; known: {', '.join(METHODS)}")
    if any(METHODS[n].cache == "quanto" for n in names):
        reason = quanto_unavailable_reason()
        if reason is not None:
            raise PnMixError(f"the quanto methods need optimum-quanto: {reason}")
    methods = [METHODS[REFERENCE]] + [METHODS[n] for n in dict.fromkeys(names) if n != REFERENCE]
    if config_path is not None:
        fields = read_json_file(config_path, "config")
        if not isinstance(fields, dict):
            raise PnMixError(f"config file {config_path} must hold a JSON object of pn-mix config fields")
        PnMixConfig.from_mapping(fields, base=PnMixConfig(pair_layout="half"))  # field errors now, not after loading
        methods.append(Method(CONFIG_METHOD, "pnmix", f"PnMixCache with {config_path}", fields))
    return methods


def pnmix_config(method: Method, model_config: Any) -> PnMixConfig:
    from .cache import resolve_config

    base = resolve_config(None, {}, model_config)
    config = resolve_config(PnMixConfig.from_mapping(dict(method.settings), base=base), {}, model_config)
    config.check_head_dim(head_dim_of(model_config))
    return config


def make_cache(method: Method, model_config: Any):
    from transformers import DynamicCache, QuantizedCache

    from .cache import PnMixCache

    if method.cache == "dynamic":
        return DynamicCache(config=model_config)
    if method.cache == "pnmix":
        return PnMixCache(pnmix_config(method, model_config), model_config=model_config)
    return QuantizedCache(backend="quanto", config=model_config, **method.settings)


def attention_for(method: Method) -> Optional[str]:
    """PnMixCache decodes under the pnmix attention (the packed path); the rest under the model's own."""
    return "pnmix" if method.cache == "pnmix" else None


def methods_table() -> str:
    lines = [f"{m.name:<12} {m.about}" for m in METHODS.values()]
    lines.append(f"{CONFIG_METHOD:<12} --config FILE: PnMixCache with that file's pn-mix config fields")
    return "\n".join(lines)


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


def cache_bytes(cache) -> int:
    """Persistent bytes, whatever the cache: pn-mix's own count (SPEC section 2), else its tensors."""
    if hasattr(cache, "persistent_bytes"):
        return cache.persistent_bytes()
    if cache.layers and hasattr(cache.layers[0], "_quantized_keys"):
        return quantized_cache_bytes(cache)
    return dynamic_cache_bytes(cache)


def head_dim_of(model_config: Any) -> int:
    head_dim = getattr(model_config, "head_dim", None)
    return int(head_dim or model_config.hidden_size // model_config.num_attention_heads)


def kv_elements(model_config: Any, tokens: int) -> int:
    """K and V elements a cache of ``tokens`` tokens holds (batch 1)."""
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    return 2 * model_config.num_hidden_layers * int(kv_heads) * head_dim_of(model_config) * tokens


# ---- the shared prefill ------------------------------------------------------------------------
@dataclasses.dataclass
class Prefill:
    """The full-precision prefill every method starts from: per-layer K/V and the last logits."""

    kv: List[Tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor  # [vocab], the distribution after the prefill's last token

    @property
    def tokens(self) -> int:
        return self.kv[0][0].shape[2]


@torch.no_grad()
def run_prefill(model, ids: torch.Tensor, start: Optional[Prefill] = None) -> Prefill:
    """The prefill of ``ids`` [1, n] under a DynamicCache; ``start``: a prefill of the tokens before
    ids (a shared prefix: passkey trials at one depth share the filler before the key)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if start is not None:
        for layer_idx, (k, v) in enumerate(start.kv):
            cache.update(k, v, layer_idx)
    # logits_to_keep=1: the last position's logits only (all of them are 8192 x 49152 fp32 = 1.6 GB
    # for SmolLM2 at 8K).
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return Prefill([(layer.keys, layer.values) for layer in cache.layers], out.logits[0, -1].float())


def hand_over_prefill(cache, kv: List[Tuple[torch.Tensor, torch.Tensor]], tokens: Optional[int] = None):
    """Fill an empty cache with a prefill's per-layer K/V (its first ``tokens``: the causal prefix of a
    longer prompt has the same K/V), one update per layer as the model's prefill call does; a
    PnMixCache then decodes under the pnmix attention, as a prefill call under it would mark."""
    from .cache import PnMixCache

    for layer_idx, (k, v) in enumerate(kv):
        if tokens is not None and tokens != k.shape[2]:
            k, v = k[:, :, :tokens].clone(), v[:, :, :tokens].clone()
        cache.update(k, v, layer_idx)
    if isinstance(cache, PnMixCache):
        cache.mark_packed_attention()
    return cache


def seeded_cache(method: Method, model_config: Any, prefill: Prefill):
    """A fresh cache of the method holding the prefill, as if the prefill had run with it."""
    cache = hand_over_prefill(make_cache(method, model_config), prefill.kv)
    if method.cache == "quanto":
        for layer in cache.layers:
            layer._dequantize = DequantizeOnce(layer._dequantize)
    return cache


class DequantizeOnce:
    """transformers' quantized layer dequantizes its whole quantized K/V at every decode step (9 s
    a step for SmolLM2 at 4K on two cores), though those tensors change only when the residual is
    flushed (every residual_length steps). Once ``reuse`` is on, an unchanged quantized tensor's
    dequantized copy is reused: bit-identical results, timed steps excepted (see QUANTO_TIMED_STEPS)."""

    def __init__(self, dequantize: Callable):
        self.dequantize = dequantize
        self.reuse = False
        self.memo: Dict[int, Tuple[Any, torch.Tensor]] = {}

    def __call__(self, quantized: Any) -> torch.Tensor:
        if not self.reuse:
            return self.dequantize(quantized)
        hit = self.memo.get(id(quantized))
        if hit is not None and hit[0] is quantized:
            return hit[1]
        if len(self.memo) >= 2:  # a flush replaced the keys' and the values' tensors
            self.memo.clear()
        out = self.dequantize(quantized)
        self.memo[id(quantized)] = (quantized, out)
        return out


def reuse_dequantized(cache, on: bool = True) -> None:
    for layer in cache.layers:
        if isinstance(getattr(layer, "_dequantize", None), DequantizeOnce):
            layer._dequantize.reuse = on


@contextlib.contextmanager
def attention(model, name: Optional[str]):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name or previous)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def decode_step(model, cache, token: int) -> torch.Tensor:
    """One forward call of one token; the next-token log-probabilities [vocab]."""
    ids = torch.tensor([[token]], dtype=torch.long, device=model.device)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


# ---- task kl -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Decoded:
    logp: torch.Tensor  # [steps, vocab]
    bytes: int
    seconds: float  # per decode step


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


def kl_task(model, methods: List[Method], ids: torch.Tensor, context: int, decode_tokens: int,
            progress: Callable[[str], None]) -> List[Dict[str, Any]]:
    """One context P: the prefill once, then every method's D teacher-forced steps."""
    prefill = run_prefill(model, ids[:, :context])
    fed = ids[0, context:context + decode_tokens].tolist()
    targets = ids[0, context + 1:context + decode_tokens + 1].to(torch.long).cpu()
    elements = kv_elements(model.config, context + decode_tokens)
    rows: List[Dict[str, Any]] = []
    reference: Optional[Decoded] = None
    for method in methods:  # METHODS[REFERENCE] first
        run = teacher_forced(model, method, prefill, fed)
        reference = reference or run
        figures = score(run, reference, targets)
        rows.append({"task": "kl", "context": context, "decode_tokens": decode_tokens, "method": method.name,
                     "kl": figures["kl"], "perplexity": figures["perplexity"],
                     "ppl_delta": figures["perplexity"] - (rows[0]["perplexity"] if rows else figures["perplexity"]),
                     "top1": figures["top1"], "bytes": run.bytes, "bits_per_element": 8 * run.bytes / elements,
                     "tokens_per_s": 1.0 / run.seconds})
        row = rows[-1]
        progress(f"kl P={context} {method.name}: KL {row['kl']:.4g}, perplexity {row['perplexity']:.4f} "
                 f"({row['ppl_delta']:+.4f}), top-1 {row['top1']:.4f}, {row['bytes']} bytes "
                 f"({row['bits_per_element']:.3f} bits/element), {row['tokens_per_s']:.2f} tokens/s")
    return rows


# ---- task passkey --------------------------------------------------------------------------------
HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8  # room for a 5-digit key however the tokenizer splits it


def passkey_key(seed: int, length: int, depth: float, trial: int) -> str:
    return str(random.Random(f"{seed}:{length}:{depth}:{trial}").randint(10000, 99999))


def first_number(text: str) -> Optional[str]:
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


@dataclasses.dataclass
class Haystack:
    """A passkey sequence of ``length`` tokens in all: haystack (prefix, needle, rest), question,
    and ANSWER_TOKENS of room for the answer."""

    prefix: List[int]   # header + the filler before the needle: shared by every key at this depth
    suffix: List[int]   # needle + the rest of the filler
    question: List[int]


def haystack(text, filler: List[int], length: int, depth: float, key: str) -> Haystack:
    header, needle, question = text.encode(HEADER), text.encode(NEEDLE.format(key=key)), text.encode(QUESTION)
    room = length - len(header) - len(needle) - len(question) - ANSWER_TOKENS
    if room < 1:
        raise PnMixError(f"--lengths {length} is too short for the passkey prompt "
                         f"({length - room + 1} tokens at least)")
    if room > len(filler):
        raise PnMixError(f"--lengths {length} needs {room} filler tokens; the text has {len(filler)}")
    at = int(round(depth * room))
    return Haystack(header + filler[:at], needle + filler[at:room], question)


def answer(model, method: Method, prefill: Prefill, question: List[int], text) -> str:
    """The question token by token, then greedy tokens (stopping once a number is complete)."""
    cache = seeded_cache(method, model.config, prefill)
    reuse_dequantized(cache)  # not timed
    with attention(model, attention_for(method)):
        for t in question:
            logp = decode_step(model, cache, t)
        generated: List[int] = []
        while len(generated) < ANSWER_TOKENS:
            generated.append(int(logp.argmax()))
            said = text.decode(generated)
            if re.search(r"\d+\D", said):
                break
            logp = decode_step(model, cache, generated[-1])
    return text.decode(generated)


def passkey_task(model, methods: List[Method], text, filler: List[int], lengths: Sequence[int],
                 depths: Sequence[float], trials: int, seed: int,
                 progress: Callable[[str], None]) -> List[Dict[str, Any]]:
    rows = []
    for length in lengths:
        for depth in depths:
            right = {m.name: 0 for m in methods}
            shared: Optional[Prefill] = None
            for trial in range(trials):
                key = passkey_key(seed, length, depth, trial)
                hay = haystack(text, filler, length, depth, key)
                if shared is None:  # the filler before the needle does not depend on the key
                    shared = run_prefill(model, torch.tensor([hay.prefix], device=model.device))
                prefill = run_prefill(model, torch.tensor([hay.suffix], device=model.device), start=shared)
                for method in methods:
                    said = answer(model, method, prefill, hay.question, text)
                    right[method.name] += first_number(said) == key
            rows += [{"method": m.name, "length": length, "depth": depth, "accuracy": right[m.name] / trials,
                      "trials": trials} for m in methods]
            progress(f"passkey L={length} d={depth}: "
                     + ", ".join(f"{m.name} {right[m.name]}/{trials}" for m in methods))
    return rows


# ---- text and tokens ----------------------------------------------------------------------------
class Text:
    """The model's tokenizer, or UTF-8 bytes as ids for a folder without one (random test models)."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer
        self.name = type(tokenizer).__name__ if tokenizer is not None else "utf-8 bytes"

    def encode(self, text: str) -> List[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: List[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_text_tokens(source, model_config: Any) -> Text:
    from .models import load_tokenizer

    has_tokenizer = source.gguf_file is not None or any(
        (source.folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if has_tokenizer:
        return Text(load_tokenizer(source))
    vocab = int(getattr(model_config, "vocab_size", 0) or 0)
    if vocab < 256:
        raise PnMixError(f"{source.spec} has no tokenizer and a vocabulary of {vocab} < 256: "
                         "cannot feed text as bytes")
    return Text()


def read_text(path: Optional[Path]) -> str:
    """The text file, or the bundled Hamlet."""
    from ..dataset import text_or_hamlet

    return text_or_hamlet(path)


def load_model(model_dir: Path):
    """A causal LM from a local folder or GGUF file (pnmix.hf.models), for the speed tool."""
    from .models import load_causal_lm, resolve_model

    return load_causal_lm(resolve_model(model_dir))


# ---- options ----------------------------------------------------------------------------------
def parse_ints(text: str, option: str) -> List[int]:
    return parse_positive_ints(text, option)


def parse_depths(text: str) -> List[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise PnMixError(f"--depths must be a comma list of numbers in [0, 1], got {text!r}")
    return values


def parse_tasks(text: str) -> List[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise PnMixError(f"--task must be a comma list of {', '.join(TASKS)}, got {text!r}")
    return list(dict.fromkeys(tasks))


def check_positions(model_config: Any, source_name: str, contexts: Sequence[int], decode_tokens: int,
                    lengths: Sequence[int]) -> None:
    from .models import max_positions

    limit = max_positions(model_config)
    if not limit:
        return
    for context in contexts:
        if context + decode_tokens > limit:
            raise PnMixError(f"--contexts {context} + --decode-tokens {decode_tokens} = {context + decode_tokens} "
                             f"tokens is longer than {source_name}'s {limit} positions")
    for length in lengths:
        if length > limit:
            raise PnMixError(f"--lengths {length} is longer than {source_name}'s {limit} positions")


# ---- the command ------------------------------------------------------------------------------
def eval_command(model: Optional[str], methods: Optional[str], config: Optional[Path], task: str,
                 contexts: str, decode_tokens: int, text: Optional[Path], lengths: str, depths: str,
                 trials: int, seed: int, dtype: str, json_path: Optional[Path], plot: Optional[Path]) -> int:
    if methods is not None and methods.strip() == "list":
        print(methods_table())
        return 0
    if model is None:
        raise PnMixError("MODEL is missing: a Hugging Face folder, a .gguf file or smollm2-135m")
    tasks = parse_tasks(task)
    context_list = parse_ints(contexts, "--contexts") if "kl" in tasks else []
    length_list = parse_ints(lengths, "--lengths") if "passkey" in tasks else []
    depth_list = parse_depths(depths)
    if decode_tokens < 1:
        raise PnMixError(f"--decode-tokens must be at least 1, got {decode_tokens}")
    if trials < 1:
        raise PnMixError(f"--trials must be at least 1, got {trials}")
    for path in (json_path, plot):
        if path is not None:
            check_output_path(path)  # before the (long) run, not after it
    if plot is not None:
        require_matplotlib()
    method_list = parse_methods(methods, config)
    source_text = read_text(text)
    from .attention import register
    from .models import load_causal_lm, load_model_config, resolve_model

    source = resolve_model(model)
    model_config = load_model_config(source)
    for method in method_list:
        if method.cache == "pnmix":
            pnmix_config(method, model_config)  # a config the model's shape refuses fails now
    check_positions(model_config, source.name, context_list, decode_tokens, length_list)
    tokens = load_text_tokens(source, model_config)
    ids = tokens.encode(source_text)
    longest = max(context_list, default=0) + decode_tokens + 1
    if context_list and len(ids) < longest:
        raise PnMixError(f"the text has {len(ids)} tokens ({tokens.name}); --contexts {max(context_list)} "
                         f"+ --decode-tokens {decode_tokens} needs {longest}")
    for length in length_list:  # a too-short text or length fails before the model loads
        haystack(tokens, ids, length, 0.5, "00000")
    register()
    lm = load_causal_lm(source, dtype, model_config=model_config)
    progress = _progress()
    results: List[Dict[str, Any]] = []
    id_tensor = torch.tensor([ids[:longest]], dtype=torch.long, device=lm.device) if context_list else None
    for context in context_list:
        results += kl_task(lm, method_list, id_tensor, context, decode_tokens, progress)
    passkey = passkey_task(lm, method_list, tokens, ids, length_list, depth_list, trials, seed, progress)
    report = {"model": source.name, "results": results, "passkey": passkey}
    _print_tables(report)
    if json_path is not None:
        write_json_atomic(json_path, report)
    if plot is not None:
        write_bytes_atomic(plot, render_plot(report))
    return 0


def _progress() -> Callable[[str], None]:
    import sys

    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {line}", file=sys.stderr, flush=True)

    return say


def _print_tables(report: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    if report["results"]:
        table = Table(title=f"{report['model']}: teacher-forced decode vs {REFERENCE} (KL(p_{REFERENCE} || p))")
        for column in ("context", "method", "bits/elem", "bytes", "KL", "perplexity", "Δppl", "top-1",
                       "tok/s"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for row in report["results"]:
            table.add_row(f"{row['context']}+{row['decode_tokens']}", row["method"],
                          f"{row['bits_per_element']:.2f}", f"{row['bytes']:,}", f"{row['kl']:.4f}",
                          f"{row['perplexity']:.3f}", f"{row['ppl_delta']:+.3f}", f"{row['top1']:.3f}",
                          f"{row['tokens_per_s']:.1f}")
        console.print(table)
    if report["passkey"]:
        lengths = sorted({row["length"] for row in report["passkey"]})
        methods = list(dict.fromkeys(row["method"] for row in report["passkey"]))
        table = Table(title=f"{report['model']}: passkey accuracy (mean over depths)")
        table.add_column("method")
        for length in lengths:
            table.add_column(f"L={length}", justify="right")
        for method in methods:
            cells = [passkey_accuracy(report["passkey"], method, length) for length in lengths]
            table.add_row(method, *[f"{c:.2f}" for c in cells])
        console.print(table)


def passkey_accuracy(rows: List[Dict[str, Any]], method: str, length: int) -> float:
    """Accuracy over every trial of every depth at one length."""
    cell = [r for r in rows if r["method"] == method and r["length"] == length]
    return sum(r["accuracy"] * r["trials"] for r in cell) / sum(r["trials"] for r in cell)


# ---- the picture --------------------------------------------------------------------------------
def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise PnMixError("--plot needs matplotlib: pip install 'pnmix[hf]'") from None
    matplotlib.use("Agg")
    return matplotlib


def render_plot(report: Dict[str, Any]) -> bytes:
    """PNG: KL (log) against bits per element per method, one panel per context; passkey accuracy
    per method and length."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    contexts = sorted({row["context"] for row in report["results"]})
    panels = len(contexts) + (1 if report["passkey"] else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.2 * max(panels, 1), 4.4), squeeze=False)
    methods = list(dict.fromkeys([r["method"] for r in report["results"]] + [r["method"] for r in report["passkey"]]))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for ax, context in zip(axes[0], contexts):
        for row in (r for r in report["results"] if r["context"] == context and r["method"] != REFERENCE):
            star = row["method"] == "pnmix"
            ax.scatter(row["bits_per_element"], max(row["kl"], 1e-6), color=colors[row["method"]],
                       s=180 if star else 60, label=row["method"], marker="*" if star else "o")
            ax.annotate(row["method"], (row["bits_per_element"], max(row["kl"], 1e-6)), fontsize=8,
                        xytext=(4, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per K/V element (measured bytes)")
        ax.set_ylabel(f"mean KL(p_{REFERENCE} || p)  (lower is better)")
        ax.set_title(f"context {context} + {report['results'][0]['decode_tokens']} decoded")
        ax.grid(True, which="both", alpha=0.3)
    if report["passkey"]:
        ax = axes[0][-1]
        lengths = sorted({r["length"] for r in report["passkey"]})
        pk_methods = list(dict.fromkeys(r["method"] for r in report["passkey"]))
        width = 0.8 / len(pk_methods)
        for i, method in enumerate(pk_methods):
            xs = [j + (i - (len(pk_methods) - 1) / 2) * width for j in range(len(lengths))]
            ax.bar(xs, [passkey_accuracy(report["passkey"], method, L) for L in lengths], width,
                   color=colors[method], label=method)
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set_xlabel("passkey sequence length (tokens)")
        ax.set_ylabel("accuracy (all digits right)")
        ax.set_ylim(0, 1.05)
        ax.set_title("passkey retrieval, mean over depths")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # clear of the bars
    fig.suptitle(f"{report['model']}: KV-cache methods vs {REFERENCE}")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")  # the legend outside the axes
    plt.close(fig)
    return buffer.getvalue()
