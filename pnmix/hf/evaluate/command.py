"""`pnmix eval MODEL`: the options, checked before the (long) run, and the command that runs the
tasks and writes the report."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...errors import PnMixError, parse_positive_ints
from ...io import JsonReport, check_output_path, write_bytes_atomic
from .inputs import load_text_tokens, read_text
from .kl import kl_task
from .methods import methods_table, parse_methods, pnmix_config
from .passkey import (HAYSTACKS, VARIANTS, Filler, classic_filler, haystack, passkey_setup, passkey_task,
                      text_filler)
from .resume import Earlier, load_earlier, method_settings
from .report import print_tables, render_plot, require_matplotlib


TASKS = ("kl", *VARIANTS)


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


def parse_haystack(text: str) -> str:
    if text not in HAYSTACKS:
        raise PnMixError(f"--haystack must be one of {', '.join(HAYSTACKS)}, got {text!r}")
    return text


def parse_tasks(text: str) -> List[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise PnMixError(f"--task must be a comma list of {', '.join(TASKS)}, got {text!r}")
    return list(dict.fromkeys(tasks))


def check_positions(model_config: Any, source_name: str, contexts: Sequence[int], decode_tokens: int,
                    lengths: Sequence[int]) -> None:
    from ..models import check_full_attention, max_positions

    for context in contexts:
        check_full_attention(model_config, context + decode_tokens, f"--contexts {context} + --decode-tokens {decode_tokens}")
    for length in lengths:
        check_full_attention(model_config, length, f"--lengths {length}")
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
                 trials: int, seed: int, dtype: str, json_path: Optional[Path], plot: Optional[Path],
                 haystack_name: str = "classic", resume: Optional[Path] = None) -> int:
    if methods is not None and methods.strip() == "list":
        print(methods_table())
        return 0
    if model is None:
        raise PnMixError("MODEL is missing: a Hugging Face folder, a .gguf file or smollm2-135m")
    tasks = parse_tasks(task)
    context_list = parse_ints(contexts, "--contexts") if "kl" in tasks else []
    variants = [VARIANTS[t] for t in tasks if t in VARIANTS]
    length_list = parse_ints(lengths, "--lengths") if variants else []
    parse_haystack(haystack_name)
    depth_list = parse_depths(depths)
    if decode_tokens < 1:
        raise PnMixError(f"--decode-tokens must be at least 1, got {decode_tokens}")
    if trials < 1:
        raise PnMixError(f"--trials must be at least 1, got {trials}")
    JsonReport(json_path)  # both outputs checked before the (long) run, not after it
    if plot is not None:
        check_output_path(plot)
        require_matplotlib()
    method_list = parse_methods(methods, config)
    source_text = read_text(text)
    from ..attention import register
    from ..models import load_causal_lm, load_model_config, resolve_model

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
    filler = passkey_filler(haystack_name, tokens, ids, length_list)
    for length in length_list:  # a too-short text or length fails before the model loads
        for variant in variants:
            haystack(tokens, filler, length, 0.5, "0" * variant.key_digits, variant.answer_tokens)
    setup = passkey_setup(source.name, dtype, seed, filler)
    earlier = load_earlier(resume, setup, method_list) if resume is not None else Earlier()
    register()
    lm = load_causal_lm(source, dtype, model_config=model_config)
    progress = _progress()
    results: List[Dict[str, Any]] = []
    if context_list:
        id_tensor = torch.tensor([ids[:longest]], dtype=torch.long, device=lm.device)
        for context in context_list:
            results += kl_task(lm, method_list, id_tensor, context, decode_tokens, progress)
    check_finite({"results": results, "passkey": []}, source.name)  # before any report is written
    report: Dict[str, Any] = {"model": source.name, "results": results, "passkey": [],
                              "passkey_setup": setup, "methods": method_settings(method_list)}

    def save(rows: List[Dict[str, Any]]) -> None:  # after every cell: an interrupted run can --resume
        if json_path is not None:
            done = report["passkey"] + rows
            write_report(json_path, {**report, "passkey": done + earlier.pending(done)})

    for variant in variants:
        report["passkey"] += passkey_task(lm, method_list, tokens, filler, length_list, depth_list, trials, seed,
                                          progress, variant, earlier, save)
    check_finite(report, source.name)
    print_tables(report)
    if json_path is not None:
        write_report(json_path, report)
    if plot is not None:
        write_bytes_atomic(plot, render_plot(report))
    return 0


def write_report(path: Path, report: Dict[str, Any]) -> None:
    # JSON has no NaN/Infinity: refuse one rather than write it bare
    write_bytes_atomic(path, (json.dumps(report, indent=2, allow_nan=False) + "\n").encode())


def passkey_filler(name: str, tokens, ids: List[int], lengths: Sequence[int]) -> Filler:
    """The haystack: the classic repeated sentence, as long as the longest length needs, or the text."""
    return classic_filler(tokens, max(lengths, default=0)) if name == "classic" else text_filler(ids)


def check_finite(report: Dict[str, Any], model: str) -> None:
    """Every number of the report finite: a NaN or infinite KL, perplexity or accuracy is not a
    score (the model's outputs were not finite numbers)."""
    for section in ("results", "passkey"):
        for row in report[section]:
            for field, value in row.items():
                if isinstance(value, float) and not math.isfinite(value):
                    raise PnMixError(f"eval of {model}: method {row['method']} gave a non-finite {field} "
                                     f"({value}); the model's outputs are not finite numbers")


def _progress() -> Callable[[str], None]:
    import sys

    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {line}", file=sys.stderr, flush=True)

    return say
