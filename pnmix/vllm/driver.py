"""Run prompts through a vLLM engine and write what it did as JSON (run with vLLM's Python).

``python -m pnmix.vllm.driver SPEC.json OUT.json``. SPEC: ``model`` (an HF folder), ``prompts`` (lists
of token ids), ``max_tokens`` (one per prompt), ``logits`` (top-k raw logits to record per step, 0:
none) and ``engine`` (keyword arguments of ``vllm.LLM``). OUT: per prompt the greedy token ids and,
per step, {token id: raw logit} of the top k; and the wall time of ``generate``.

vLLM's engine starts a process of its own, so this runs as a script (``__main__``), never imported
by the tests' own interpreter (tests/vllm/test_engine.py runs it in vLLM's virtual environment).
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    top = int(spec.get("logits", 0))
    engine = dict(spec.get("engine", {}))
    if top:
        engine.setdefault("logprobs_mode", "raw_logits")
    llm = LLM(model=spec["model"], **engine)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=top or None, ignore_eos=True)
              for n in spec["max_tokens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    rows = []
    for out in outputs:
        done = out.outputs[0]
        steps = [{str(tok): float(lp.logprob) for tok, lp in step.items()} for step in (done.logprobs or [])]
        rows.append({"tokens": list(done.token_ids), "logits": steps})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"rows": rows, "generate_seconds": seconds}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
