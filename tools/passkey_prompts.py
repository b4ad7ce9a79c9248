"""Does the full-precision model answer the passkey at all, under other forms of the question?

    python tools/passkey_prompts.py [--model smollm2-135m] [--length 8192] [--depths 0.9,0.7] [--trials 2]

``pnmix eval --task passkey`` asks with the papers' prompt. Where the full-precision reference
fails a cell, the question is whether the prompt or the model is at fault: this tool builds the
same haystack and needle (the classic filler, the same keys as ``pnmix eval``, the needle at the
same depths), prefills it once per key in full precision, and asks the question in several forms
(the papers' one first, then rewordings, then the instruct model's chat template around the whole
prompt). It prints what the model said to each, and how many keys each form got right.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

CHAT_OPEN = "<|im_start|>user\n"  # SmolLM2-Instruct's (ChatML) template around the whole prompt
QUESTIONS = [
    ("papers", "", "\nWhat is the pass key? The pass key is"),
    ("blank line", "", "\n\nWhat is the pass key? The pass key is"),
    ("own line", "", "\nWhat is the pass key?\nThe pass key is"),
    ("Answer:", "", "\nQuestion: What is the pass key?\nAnswer: The pass key is"),
    ("number", "", "\nWhat is the pass key? Remember it. The pass key is number"),
    ("chat", CHAT_OPEN, "\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is"),
    ("chat, free", CHAT_OPEN, "\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\n"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--depths", default="0.9,0.7")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from pnmix.hf.attention import register
    from pnmix.hf.evaluate import passkey
    from pnmix.hf.evaluate.command import parse_methods, passkey_filler
    from pnmix.hf.evaluate.inputs import load_text_tokens
    from pnmix.hf.evaluate.prefill import run_prefill
    from pnmix.hf.models import load_causal_lm, load_model_config, resolve_model

    source = resolve_model(args.model)
    model_config = load_model_config(source)
    text = load_text_tokens(source, model_config)
    register()
    model = load_causal_lm(source, "fp32", model_config=model_config)
    reference = parse_methods("fp16", None)[0]
    filler = passkey_filler("classic", text, [], [args.length])
    digits = passkey.VARIANTS["passkey"].key_digits
    # Every form gets the same haystack: room for the longest prompt addition, answer included.
    extra = max(len(text.encode(opening + question)) for _, opening, question in QUESTIONS)
    room = passkey.VARIANTS["passkey"].answer_tokens + extra - len(text.encode(passkey.QUESTION))
    right: Counter = Counter()
    asked = 0
    for depth in (float(d) for d in args.depths.split(",")):
        for trial in range(args.trials):
            key = passkey.passkey_key(args.seed, args.length, depth, trial, digits)
            hay = passkey.haystack(text, filler, args.length, depth, key, room)
            prefills = {}
            asked += 1
            for name, opening, question in QUESTIONS:
                if opening not in prefills:
                    ids = text.encode(opening) + hay.prefix + hay.suffix if opening else hay.prefix + hay.suffix
                    prefills[opening] = run_prefill(model, torch.tensor([ids], device=model.device))
                said = passkey.answer(model, reference, prefills[opening], text.encode(question), text,
                                      passkey.VARIANTS["passkey"].answer_tokens)
                right[name] += passkey.first_number(said) == key
                print(f"L={args.length} d={depth} key {key} [{name}]: {said!r}", flush=True)
    print(f"\nkeys right of {asked} (full precision, L={args.length}, depths {args.depths}):")
    for name, _, _ in QUESTIONS:
        print(f"  {name:12s} {right[name]}/{asked}")


if __name__ == "__main__":
    main()
