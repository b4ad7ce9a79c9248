"""Task ``passkey`` (and its harder variant ``passkey-long``): a haystack with a pass-key sentence at a
depth is the prefill, the question goes through the decode path token by token, then greedy
generation; a trial is right when the first number generated is the key. A cell (length, depth)
where the full-precision reference itself fails is flagged: there the task does not test the cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...errors import PnMixError
from .methods import Method, attention_for, reuse_dequantized, seeded_cache
from .prefill import Prefill, attention, decode_step, run_prefill
from .resume import Earlier


HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
# The classic haystack of the passkey papers (Mohtashami & Jaggi 2023; LongLoRA): one filler
# sentence repeated, so that the needle is the only information in the prompt.
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("classic", "text")
REFERENCE_PASS = 0.9  # a cell whose reference is right on fewer of its trials is flagged


@dataclasses.dataclass(frozen=True)
class Variant:
    """One passkey task: its name and how many digits its keys have."""

    task: str
    key_digits: int

    @property
    def answer_tokens(self) -> int:
        return self.key_digits + 3  # room for the key however the tokenizer splits it, and what ends it


# passkey-long: 20-digit keys. The 5-digit key is one token-level copy that a 2-bit cache mostly
# survives; 20 digits must all be copied right, so an attention that drifts by one digit fails
# the trial (docs/EVAL.md says why this variant and not several needles).
VARIANTS = {v.task: v for v in (Variant("passkey", 5), Variant("passkey-long", 20))}


def passkey_key(seed: int, length: int, depth: float, trial: int, digits: int = 5) -> str:
    tail = "" if digits == 5 else f":{digits}"  # the 5-digit keys of earlier runs unchanged
    return str(random.Random(f"{seed}:{length}:{depth}:{trial}{tail}").randint(10 ** (digits - 1), 10 ** digits - 1))


def first_number(text: str) -> Optional[str]:
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


@dataclasses.dataclass(frozen=True)
class Filler:
    """The haystack's tokens; the needle goes in between units (the classic filler's whole sentences,
    or any token of a text: unit 1)."""

    ids: List[int]
    unit: int
    name: str


def classic_filler(text, tokens: int) -> Filler:
    """CLASSIC_FILLER repeated to at least ``tokens`` tokens (each repeat tokenized alike)."""
    unit = text.encode(" " + CLASSIC_FILLER)
    return Filler(unit * (tokens // len(unit) + 1), len(unit), "classic")


def text_filler(ids: List[int]) -> Filler:
    return Filler(list(ids), 1, "text")


def passkey_setup(model: str, dtype: str, seed: int, filler: Filler) -> Dict[str, Any]:
    """What fixes a trial's prompt and its model beside the method: a report records it. The
    classic filler is one sentence's tokens repeated (as many times as the longest length needs)."""
    source = filler.ids[:filler.unit] if filler.name == "classic" else filler.ids
    digest = hashlib.sha256(json.dumps(source).encode()).hexdigest()
    return {"model": model, "dtype": dtype, "seed": seed, "haystack": filler.name, "filler_sha256": digest}


@dataclasses.dataclass
class Haystack:
    """A passkey sequence of ``length`` tokens in all: haystack (prefix, needle, rest), question,
    and the variant's answer tokens of room for the answer."""

    prefix: List[int]   # header + the filler before the needle: shared by every key at this depth
    suffix: List[int]   # needle + the rest of the filler
    question: List[int]


def needle_position(room: int, depth: float, unit: int) -> int:
    """Filler tokens before the needle: depth of the filler, rounded to a whole unit."""
    return min(int(round(depth * room / unit)), room // unit) * unit


def haystack(text, filler: Filler, length: int, depth: float, key: str, answer_tokens: int = 8) -> Haystack:
    header, needle, question = text.encode(HEADER), text.encode(NEEDLE.format(key=key)), text.encode(QUESTION)
    room = length - len(header) - len(needle) - len(question) - answer_tokens
    if room < 1:
        raise PnMixError(f"--lengths {length} is too short for the passkey prompt "
                         f"({length - room + 1} tokens at least)")
    if room > len(filler.ids):
        raise PnMixError(f"--lengths {length} needs {room} filler tokens; the text has {len(filler.ids)}")
    at = needle_position(room, depth, filler.unit)
    return Haystack(header + filler.ids[:at], needle + filler.ids[at:room], question)


def answer(model, method: Method, prefill: Prefill, question: List[int], text, answer_tokens: int) -> str:
    """The question token by token, then greedy tokens (stopping once a number is complete)."""
    cache = seeded_cache(method, model.config, prefill)
    reuse_dequantized(cache)  # not timed
    with attention(model, attention_for(method)):
        for t in question:
            logp = decode_step(model, cache, t)
        generated: List[int] = []
        while len(generated) < answer_tokens:
            generated.append(int(logp.argmax()))
            said = text.decode(generated)
            if re.search(r"\d+\D", said):
                break
            logp = decode_step(model, cache, generated[-1])
    return text.decode(generated)


def cell_rows(variant: Variant, filler: Filler, methods: List[Method], length: int, depth: float,
              right: Dict[str, int], trials: int) -> List[Dict[str, Any]]:
    """One cell's rows; methods[0] is the reference, and its accuracy flags the cell."""
    reference = right[methods[0].name] / trials
    return [{"task": variant.task, "haystack": filler.name, "key_digits": variant.key_digits, "method": m.name,
             "length": length, "depth": depth, "accuracy": right[m.name] / trials, "trials": trials,
             "reference_accuracy": reference, "reference_fails": reference < REFERENCE_PASS} for m in methods]


def passkey_task(model, methods: List[Method], text, filler: Filler, lengths: Sequence[int],
                 depths: Sequence[float], trials: int, seed: int, progress: Callable[[str], None],
                 variant: Variant = VARIANTS["passkey"], earlier: Earlier = Earlier(),
                 on_cell: Callable[[List[Dict[str, Any]]], None] = lambda rows: None) -> List[Dict[str, Any]]:
    """Every cell's rows; a method asks only the keys ``earlier`` has not (its counts carry over),
    and ``on_cell`` sees the rows so far after each cell."""
    rows: List[Dict[str, Any]] = []
    for length in lengths:
        for depth in depths:
            start = {m.name: earlier.take(variant.task, m.name, length, depth, trials) for m in methods}
            right = {name: done_right for name, (_, done_right) in start.items()}
            shared: Optional[Prefill] = None
            for trial in range(min(asked for asked, _ in start.values()), trials):
                key = passkey_key(seed, length, depth, trial, variant.key_digits)
                hay = haystack(text, filler, length, depth, key, variant.answer_tokens)
                if shared is None:  # the filler before the needle does not depend on the key
                    shared = run_prefill(model, torch.tensor([hay.prefix], device=model.device))
                prefill = run_prefill(model, torch.tensor([hay.suffix], device=model.device), start=shared)
                for method in methods:
                    if trial >= start[method.name][0]:
                        said = answer(model, method, prefill, hay.question, text, variant.answer_tokens)
                        right[method.name] += first_number(said) == key
            rows += cell_rows(variant, filler, methods, length, depth, right, trials)
            on_cell(rows)
            flag = "  (the reference fails here)" if rows[-1]["reference_fails"] else ""
            reused = sum(asked for asked, _ in start.values())
            progress(f"{variant.task} L={length} d={depth}: "
                     + ", ".join(f"{m.name} {right[m.name]}/{trials}" for m in methods) + flag
                     + (f"  ({reused} answers from --resume)" if reused else ""))
    return rows
