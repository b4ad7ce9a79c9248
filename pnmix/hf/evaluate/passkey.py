"""Task ``passkey``: a haystack of text with a pass-key sentence at a depth is the prefill, the
question goes through the decode path token by token, then greedy generation; a trial is right when
the first number generated is the key."""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...errors import PnMixError
from .methods import Method, attention_for, reuse_dequantized, seeded_cache
from .prefill import Prefill, attention, decode_step, run_prefill


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
