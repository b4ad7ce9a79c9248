"""Run prompts through a vLLM engine and write what it did as JSON (run with vLLM's Python).

``python -m pnmix.vllm.driver SPEC.json OUT.json``. SPEC: ``model`` (an HF folder), ``prompts`` (lists
of token ids), ``max_tokens`` (one per prompt), ``logits`` (top-k raw logits to record per step, 0:
none), ``engine`` (keyword arguments of ``vllm.LLM``), ``record`` (optional: a file to which the
pn-mix backend's every layer call is written with ``torch.save``, {layer name: [call, ...]}, a call
being the step's rows (first token, tokens, tokens cached before), slots, block table and the
layer's query, key, value and output for those tokens; the engine then runs in this process, where
the backend can be watched) and ``in_process`` (optional, true: the engine core runs in this
process without recording, which saves a second process's start). OUT: per prompt the greedy token
ids and, per step, {token id: raw logit} of the top k; and the wall time of ``generate``.

vLLM's engine starts a process of its own, so this runs as a script (``__main__``), never imported
by the tests' own interpreter (tests/vllm/test_engine.py runs it in vLLM's virtual environment).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List


def record_backend_calls() -> Dict[str, List[Dict[str, Any]]]:
    """Wrap the backend's forward so that each call's inputs and output are kept (in this process)."""
    from .backend import PnMixAttentionImpl

    calls: Dict[str, List[Dict[str, Any]]] = {}
    forward = PnMixAttentionImpl.forward

    def recorded(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None:  # not the profiling run
            n = attn_metadata.num_actual_tokens
            calls.setdefault(layer.layer_name, []).append(dict(
                rows=list(attn_metadata.rows), slots=list(attn_metadata.slots),
                block_table=attn_metadata.block_table.clone(), query=query[:n].clone(), key=key[:n].clone(),
                value=value[:n].clone(), output=output[:n].clone()))
        return result

    PnMixAttentionImpl.forward = recorded  # type: ignore[method-assign]
    return calls


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    record = spec.get("record")
    if record or spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, before vLLM reads it
    calls = record_backend_calls() if record else {}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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
    if record:
        import torch

        torch.save(calls, record)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
