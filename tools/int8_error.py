"""The integer attention's error on a real model's K/V: every packed attention call of a decode.

    python tools/int8_error.py [--model smollm2-135m] [--context 4096] [--steps 16] [--text FILE] [--isa avx2]

Prefills ``--context`` tokens of the text (Hamlet by default) in full precision, hands the K/V to a
PnMixCache (the manifest's config) as ``pnmix eval`` does, and decodes ``--steps`` teacher-forced
tokens under the packed attention. Every call of libpnmix_core's attention (a decode step's
attend-and-append call per layer, measured on the state before its append) is run on the same inputs
by the fp32 path, the int8 path and the PyTorch reference (pnmix.reference.attend); the decode
itself continues with the fp32 path's output, so every call sees the same inputs. Prints the max
|diff| of both paths against the reference over all calls (30 layers x steps), their medians, the
largest |output|, and which arithmetic and kernel the int8 calls ran; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--text", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--isa", default="auto", help="the integer path's kernel: auto, avx2 or avx512vnni")
    args = parser.parse_args()

    from pnmix import reference
    from pnmix.backends.core_ops import CoreOps
    from pnmix.hf.evaluate.inputs import load_text_tokens, read_text
    from pnmix.hf.evaluate.methods import METHODS, seeded_cache
    from pnmix.hf.evaluate.prefill import attention, decode_step, run_prefill
    from pnmix.hf.models import load_causal_lm, resolve_model

    source = resolve_model(args.model)
    model = load_causal_lm(source)
    text = load_text_tokens(source, model.config)
    ids = text.encode(read_text(args.text))[: args.context + args.steps]
    if len(ids) < args.context + args.steps:
        raise SystemExit(f"error: the text has {len(ids)} tokens, fewer than --context + --steps")
    prefill = run_prefill(model, torch.tensor([ids[: args.context]]))
    method = METHODS["pnmix"]

    diffs = {"fp32": [], "int8": []}
    largest, ran = [0.0], set()
    attend, step = CoreOps.attend, CoreOps.attend_append_checked

    def measure(ops, q, layout, state, seq_len, k_new=None, v_new=None):
        """CoreOps.attend's stand-in: both paths and the reference on one call's inputs (a step's:
        the state before its append); returns the fp32 path's output."""
        want = reference.attend(q, layout, state, seq_len, k_new, v_new)
        ops.set_isa(args.isa)
        ops.set_arith("int8")
        ran.add(f"{ops.arith_for(layout)} on {ops.isa()}")
        got = attend(ops, q, layout, state, seq_len, k_new, v_new)
        ops.set_arith("fp32")
        exact = attend(ops, q, layout, state, seq_len, k_new, v_new)
        diffs["int8"].append(float((got - want).abs().max()))
        diffs["fp32"].append(float((exact - want).abs().max()))
        largest[0] = max(largest[0], float(want.abs().max()))
        return exact

    def compared_step(self, q, layout, state, seq_len, k, v, query_as_fp16=False):
        # a decode step of the layer's packed path: one C call that attends and appends, its
        # queries and K/V rounded to fp16 in it; measured on them rounded here, then run (fp32)
        q16 = q.to(torch.float16) if query_as_fp16 else q
        measure(self, q16, layout, state, seq_len, k.to(torch.float16), v.to(torch.float16))
        return step(self, q, layout, state, seq_len, k, v, query_as_fp16)

    CoreOps.attend = measure  # type: ignore[method-assign]
    CoreOps.attend_append_checked = compared_step  # type: ignore[method-assign]
    try:
        cache = seeded_cache(method, model.config, prefill)
        with attention(model, "pnmix"):
            for token in ids[args.context: args.context + args.steps]:
                decode_step(model, cache, token)
    finally:
        CoreOps.attend, CoreOps.attend_append_checked = attend, step  # type: ignore[method-assign]
    if not diffs["int8"]:
        raise SystemExit("error: the decode made no call of the core's attention (did the model take the packed path?)")

    report = {"model": args.model, "context": args.context, "steps": args.steps, "calls": len(diffs["int8"]),
              "int8_ran": sorted(ran), "max_abs_output": largest[0],
              **{f"{path}_max_abs_diff": max(d) for path, d in diffs.items()},
              **{f"{path}_median_max_abs_diff": statistics.median(d) for path, d in diffs.items()}}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
