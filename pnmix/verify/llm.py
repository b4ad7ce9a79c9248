"""`pnmix verify --onnx FILE --model MODEL`: an exported LLM file against PyTorch with PnMixCache.

The same token ids go through ONNX Runtime (the file) and through the transformers model with
PnMixCache (pnmix.hf, the `pnmix` attention, the reference ops): the prompt's first P tokens as one
prefill, then D greedy decode steps, each step feeding both sides ONNX Runtime's token. After the
prefill and after every decode step the checks are:

* ``packed_bytes_identical``: every layer's used packed state (FORMAT.md) byte for byte, ONNX
  Runtime against PnMixCache;
* ``graph_bytes_exact``: the file's present state against pnmix.cache.append_reference applied
  to the fp16 K/V the file computed, both from one session (``KvProbe``: the same graph with
  each layer's K/V as extra outputs, fed the same past state): the graph's append is the
  reference's, whatever the K/V. Two sessions need not compute the same K/V (an fp16 graph's
  kernels and fusions change when values become outputs), so a session's append is compared only
  with the reference over its own K/V; ``sessions_identical`` (reported) says whether the probe's
  present state is the session's;
* ``kv``: how far the fp16 K/V of the two sides are apart (max |diff| and the share of bitwise
  equal elements): a GEMM of ONNX Runtime (MLAS) and one of PyTorch (MKL/oneDNN) sum in another
  order, so fp32 projections differ in the last bits and fp16 K/V near a rounding boundary differ
  by one fp16 step; where K/V differ, packed bytes differ;
* logits max |diff|: after the prefill within ``LOGITS_TOLERANCE`` (fp32 files: 1e-3; both sides
  attend over the prompt's own K/V in the model's precision), after a decode step within
  ``DECODE_LOGITS_TOLERANCE``: a decode step's attention takes fp16 queries and K/V (the op
  semantics, on both sides), and an fp32 value one ulp apart rounds to another fp16 value now and
  then; with SmolLM2's large activations that moves logits by a few 1e-3 (two PyTorch runs of the
  same model that differ only in the prefill's attention kernel are as far apart);
* identical greedy tokens.

``passed``: graph_bytes_exact at every step, identical tokens, logits within the tolerances.
``packed_bytes_identical`` is reported, not required: it holds only where both runtimes compute the
same fp16 K/V bit for bit (see ``kv``), which independent GEMMs do not guarantee.

The report has the shape of the other verify runs (pnmix/verify/__init__.py): backend, passed, tolerance,
config, prefill_tokens, decode_tokens, runs (one record) and manifest (not applicable: passed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from pnmix import defaults
from pnmix.errors import PnMixError
from pnmix.format import STATE_DTYPES, STATE_NAMES
from pnmix.io import JsonReport
from pnmix.verify import core_arith

from pnmix.backends.onnxruntime.llm_session import LlmSession
from pnmix.export.llm_file import MODEL_FACTS, check_model, read_llm_info
from pnmix.export.tracing import state_name

LOGITS_TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}
DECODE_LOGITS_TOLERANCE = {"fp32": 2e-2, "fp16": 1e-1}
# fp16 files: the tolerances are at least this many times the fp16 torch model's distance from the
# fp32 one at the same step (on the tiny test model fp16's own error reaches 0.15 in a decode step,
# ONNX Runtime's fp16 graph against torch's fp16 model 0.135: fixed fp16 tolerances fail a correct file)
OWN_ERROR_FACTOR = 2.0


def _text_ids(tokenizer, text: Optional[Path], prompt_tokens: int) -> List[int]:
    from pnmix.dataset import text_or_hamlet

    content = text_or_hamlet(text)
    path = text if text is not None else "the bundled Hamlet"
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    if len(ids) < prompt_tokens:
        raise PnMixError(f"text {path} has {len(ids)} tokens; --prompt-tokens asks for {prompt_tokens}")
    return list(ids[:prompt_tokens])


def used_bytes(layout, tensors: Dict[str, torch.Tensor], seq_len: int) -> bytes:
    """The used part of one layer's packed state, as FORMAT.md's dump lays it out."""
    from pnmix.dump import dump_state

    return dump_state(layout, tensors, seq_len)


def _as_reference(arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(arrays[name])).view(STATE_DTYPES[name]).clone()
            for name in STATE_NAMES}


class KvProbe:
    """The fp16 K/V every layer's PnMixAppend node takes, as extra outputs of a second session over
    the same graph (the file on disk is not changed), run with the session's ops, beside that
    session's own present state: its append is checked against the reference over its own K/V."""

    def __init__(self, path: Path, layers: int, implementation: str = "functions"):
        import onnx

        from pnmix.backends.onnxruntime.session import open_session, session_options
        from pnmix.export import ops

        proto = onnx.load(str(path), load_external_data=False)
        appends = [n for n in proto.graph.node if n.domain == ops.DOMAIN and n.op_type == ops.APPEND_OP]
        if len(appends) != layers:
            raise PnMixError(f"{path} has {len(appends)} {ops.APPEND_OP} nodes for {layers} layers")
        self.names: List[Tuple[str, str]] = [(n.input[0], n.input[1]) for n in appends]
        for k, v in self.names:
            for name in (k, v):
                proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
        options = session_options(ops=implementation)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(Path(path).resolve().parent))
        self.session = open_session(proto.SerializeToString(), options)
        self.output_names = [o.name for o in self.session.get_outputs()]


def model_facts(model_config: Any) -> Dict[str, Any]:
    """What llm_file.check_model compares of a transformers config (MODEL_FACTS)."""
    from pnmix.hf.models import ModelDims

    dims = ModelDims.from_config(model_config)
    facts = {"model_type": getattr(model_config, "model_type", None), "vocab_size": int(model_config.vocab_size),
             "layers": dims.layers, "q_heads": dims.q_heads, "kv_heads": dims.kv_heads, "head_dim": dims.head_dim}
    return {fact: facts[fact] for fact in MODEL_FACTS}


def _torch_side(model_source, info, dtype: str):
    from pnmix.hf import PnMixCache  # noqa: F401 - registers the pnmix attention
    from pnmix.hf.attention import ATTENTION_NAME, register
    from pnmix.hf.models import load_causal_lm, load_model_config

    model_config = load_model_config(model_source)
    model = load_causal_lm(model_source, dtype, model_config=model_config)
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def verify_llm(onnx_path: Path, model: str, text: Optional[Path] = None,
               prompt_tokens: int = defaults.VERIFY_LLM_PROMPT_TOKENS,
               decode_tokens: int = defaults.VERIFY_LLM_DECODE_TOKENS, threads: Optional[int] = None,
               session=None, ops: Optional[str] = None) -> Dict[str, Any]:
    """The file in ONNX Runtime against PyTorch, or ``session``: another runtime of the same file
    with LlmSession's interface (``info``, ``step``, ``state``, ``seq_len``, ``layer_state``,
    ``backend``, ``runtime_name``), such as a TensorRT engine built from it
    (pnmix.backends.tensorrt.llm_session). Its K/V are no outputs there, so graph_bytes_exact is
    not checked (None) and the rest of the report is the same."""
    from pnmix.hf import PnMixCache
    from pnmix.hf.models import load_model_config, load_tokenizer, resolve_model

    info = session.info if session is not None else read_llm_info(onnx_path)
    if prompt_tokens < 1 or decode_tokens < 0:
        raise PnMixError(f"--prompt-tokens must be >= 1 and --decode-tokens >= 0, got {prompt_tokens}, {decode_tokens}")
    info.check_room(prompt_tokens, decode_tokens, "--prompt-tokens + --decode-tokens")
    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    check_model(info, model, model_facts(load_model_config(source)), tokenizer)
    ids = _text_ids(tokenizer, text, prompt_tokens)
    hf_model = _torch_side(source, info, info.dtype)  # the file's dtype is its graph's (read_llm_info)

    probe = None
    if session is None:
        session = LlmSession(onnx_path, threads, info, ops)
        probe = KvProbe(onnx_path, info.layers, session.ops)
    cache = PnMixCache(info.config, max_cache_len=info.max_seq_len, backend="torch", model_config=hf_model.config)
    # An fp16 file's tolerances are fp16's own error: the distance of the fp16 torch model from the
    # fp32 one over the same tokens (ONNX Runtime's CPU kernels compute fp16 graphs much as fp32).
    fp32 = None
    if info.dtype != "fp32":
        fp32 = (_torch_side(source, info, "fp32"),
                PnMixCache(info.config, max_cache_len=info.max_seq_len, backend="torch", model_config=hf_model.config))
    layout = info.layout
    steps: List[Dict[str, Any]] = []
    tokens_ort: List[int] = []
    tokens_torch: List[int] = []
    feed = list(ids)
    began = time.perf_counter()
    for step in range(decode_tokens + 1):
        seq_before = session.seq_len
        past = {name: a.copy() for name, a in session.state.items()}  # a native session updates in place
        ort_logits = session.step(feed)
        kv = _probe_kv(probe, feed, seq_before, past) if probe is not None else None
        with torch.no_grad():
            out = hf_model(torch.tensor([feed]), cache=cache, use_cache=True)
        torch_logits = out.logits[0, -1].float().numpy()
        record = _compare_step(layout, session, cache, kv, past, seq_before, len(feed))
        record["step"] = "prefill" if step == 0 else f"decode {step}"
        record["max_abs_diff_logits"] = float(np.abs(ort_logits - torch_logits).max())
        if fp32 is not None:
            with torch.no_grad():
                own = fp32[0](torch.tensor([feed]), cache=fp32[1], use_cache=True).logits[0, -1].float().numpy()
            record["dtype_own_logits_diff"] = float(np.abs(own - torch_logits).max())
        steps.append(record)
        tokens_ort.append(int(np.argmax(ort_logits)))
        tokens_torch.append(int(np.argmax(torch_logits)))
        feed = [tokens_ort[-1]]
    seconds = time.perf_counter() - began
    return _report(info, onnx_path, model, steps, tokens_ort, tokens_torch, prompt_tokens, decode_tokens, seconds,
                   session)


def _probe_kv(probe: KvProbe, feed: List[int], seq_before: int, past: Dict[str, np.ndarray]):
    """The probe's step from the session's past: per layer (k, v, its present state)."""
    feeds = {"input_ids": np.asarray([feed], dtype=np.int64), "seq_len": np.array(seq_before, dtype=np.int64),
             "new_len": np.array(len(feed), dtype=np.int64), **past}
    values = dict(zip(probe.output_names, probe.session.run(None, feeds)))
    return [(values[k], values[v], {name: values[state_name(name, layer, present=True)] for name in STATE_NAMES})
            for layer, (k, v) in enumerate(probe.names)]


def _compare_step(layout, session: LlmSession, cache, kv, past, seq_before: int, n: int) -> Dict[str, Any]:
    from pnmix.cache import append_reference

    seq_after = seq_before + n
    layers_identical, graph_exact, sessions_identical = [], [], []
    kv_max, kv_equal, kv_count = 0.0, 0, 0
    for layer in range(session.info.layers):
        ort_state = _as_reference(session.layer_state(layer))
        torch_state = cache.layers[layer].packed.state
        layers_identical.append(used_bytes(layout, ort_state, seq_after) == used_bytes(layout, torch_state, seq_after))
        expected = ort_state
        if kv is not None:  # the probe's append against the reference append of the probe's own K/V
            k, v, probe_present = kv[layer]
            expected = _as_reference({name: past[state_name(name, layer)] for name in STATE_NAMES})
            append_reference(layout, expected, seq_before, *(torch.from_numpy(np.ascontiguousarray(a)) for a in (k, v)))
            probe_state = used_bytes(layout, _as_reference(probe_present), seq_after)
            graph_exact.append(used_bytes(layout, expected, seq_after) == probe_state)
            sessions_identical.append(probe_state == used_bytes(layout, ort_state, seq_after))
        # K/V of both sides: the new tokens sit in the sink or the residual of the torch state
        # only while they are not yet quantized; compare where both are stored in fp16.
        mine, theirs = _fp16_rows(layout, expected, seq_after), _fp16_rows(layout, torch_state, seq_after)
        for a, b in zip(mine, theirs):
            kv_max = max(kv_max, float((a.float() - b.float()).abs().max()) if a.numel() else 0.0)
            kv_equal += int((a.view(torch.int16) == b.view(torch.int16)).sum())
            kv_count += a.numel()
    return {
        "seq_len": seq_after,
        "packed_bytes_identical": all(layers_identical),
        "layers_identical": sum(layers_identical),
        "graph_bytes_exact": all(graph_exact) if kv is not None else None,
        "sessions_identical": all(sessions_identical) if kv is not None else None,
        "kv_max_abs_diff": kv_max,
        "kv_bitwise_equal_share": kv_equal / kv_count if kv_count else 1.0,
    }


def _fp16_rows(layout, state, seq_len: int):
    n = layout.lengths(seq_len)
    return [state["sink_k"][:, :, :n.sink], state["sink_v"][:, :, :n.sink],
            state["residual_k"][:, :, :n.residual], state["residual_v"][:, :, :n.residual]]


def _report(info, onnx_path, model, steps, tokens_ort, tokens_torch, prompt_tokens, decode_tokens, seconds, session):
    tolerance = LOGITS_TOLERANCE.get(info.dtype, 1e-3)
    decode_tolerance = DECODE_LOGITS_TOLERANCE.get(info.dtype, 2e-2)
    if "dtype_own_logits_diff" in steps[0]:  # not below twice the dtype's own error (verify_llm)
        tolerance = max(tolerance, OWN_ERROR_FACTOR * steps[0]["dtype_own_logits_diff"])
        decode_tolerance = max([decode_tolerance] + [OWN_ERROR_FACTOR * s["dtype_own_logits_diff"] for s in steps[1:]])
    prefill_logits = steps[0]["max_abs_diff_logits"]
    decode_logits = max((s["max_abs_diff_logits"] for s in steps[1:]), default=0.0)
    max_logits = max(prefill_logits, decode_logits)
    identical = all(s["packed_bytes_identical"] for s in steps)
    checked = [s["graph_bytes_exact"] for s in steps if s["graph_bytes_exact"] is not None]
    graph_exact = all(checked) if checked else None
    probed = [s["sessions_identical"] for s in steps if s["sessions_identical"] is not None]
    tokens_same = tokens_ort == tokens_torch
    passed = graph_exact is not False and tokens_same and prefill_logits <= tolerance and decode_logits <= decode_tolerance
    record = {
        "seed": None, "model": model, "file": str(onnx_path), "layers": info.layers,
        "max_abs_diff_online": max_logits, "max_abs_diff_final": steps[-1]["max_abs_diff_logits"],
        "max_abs_diff_prefill_logits": prefill_logits, "max_abs_diff_decode_logits": decode_logits,
        "decode_tolerance": decode_tolerance,
        "packed_bytes_identical": identical, "graph_bytes_exact": graph_exact,
        "sessions_identical": all(probed) if probed else None,
        "tokens_identical": tokens_same, "tokens_onnx": tokens_ort, "tokens_torch": tokens_torch,
        "kv_max_abs_diff": max(s["kv_max_abs_diff"] for s in steps),
        "kv_bitwise_equal_share": min(s["kv_bitwise_equal_share"] for s in steps),
        "steps": steps, "passed": passed, "metrics": {},
        "runtime": {"name": session.runtime_name, "elapsed_seconds": seconds,
                    "ops": getattr(session, "ops", None),
                    "attend_arith": core_arith("onnx", {"ops": getattr(session, "ops", None)})},
    }
    return {
        "backend": session.backend, "passed": passed, "tolerance": tolerance, "config": info.config.to_dict(),
        "prefill_tokens": prompt_tokens, "decode_tokens": decode_tokens, "runs": [record],
        "manifest": {"passed": True, "rows": []},
    }


def verify_llm_command(onnx_path: Optional[Path], model: str, text: Optional[Path], prompt_tokens: int,
                       decode_tokens: int, json_path: Optional[Path], engine: Optional[Path] = None,
                       plugins: Optional[Path] = None, ops: Optional[str] = None) -> int:
    """`pnmix verify --onnx FILE --model MODEL`, or `--engine PLAN`: the TensorRT engine built from
    such a file, checked the same way (pnmix.backends.tensorrt.llm_session)."""
    report_file = JsonReport(json_path)
    session = None
    if engine is not None:
        from pnmix.backends.tensorrt.llm_session import EngineLlmSession

        session = EngineLlmSession(engine, plugins)
        onnx_path = session.info.path
    if onnx_path is None:
        raise PnMixError("give the LLM file (--onnx FILE) or its engine (--engine PLAN)")
    report = verify_llm(Path(onnx_path), model, text, prompt_tokens, decode_tokens, session=session, ops=ops)
    return print_and_write(report, report_file)


def print_and_write(report: Dict[str, Any], report_file: JsonReport) -> int:
    """The steps, the verdict and the JSON report of verify_llm; the exit code."""
    run = report["runs"][0]
    runtime = run["runtime"]["name"]
    if run["runtime"].get("ops"):
        runtime += f" ({run['runtime']['ops']} ops)"
    if run["runtime"].get("attend_arith"):
        runtime += f", {run['runtime']['attend_arith']} attention"

    def exact(value) -> str:
        return "n/a" if value is None else "yes" if value else "NO"

    for s in run["steps"]:
        print(f"{s['step']:>10}: seq_len {s['seq_len']:>5}  logits max|diff| {s['max_abs_diff_logits']:.3g}  "
              f"layers with identical packed bytes {s['layers_identical']}/{run['layers']}  "
              f"graph append exact {exact(s['graph_bytes_exact'])}  K/V bitwise equal "
              f"{100 * s['kv_bitwise_equal_share']:.2f}% (max|diff| {s['kv_max_abs_diff']:.3g})")
    print(f"greedy tokens {'identical' if run['tokens_identical'] else 'DIFFER'}: {runtime} {run['tokens_onnx']} "
          f"torch {run['tokens_torch']}")
    graph = {None: "not checked (no K/V outputs)", True: "exact", False: "NOT exact"}[run["graph_bytes_exact"]]
    print(f"packed bytes {'identical' if run['packed_bytes_identical'] else 'differ'} ({runtime} vs PnMixCache, "
          f"K/V bitwise equal {100 * run['kv_bitwise_equal_share']:.2f}%); graph append {graph}; "
          f"logits max|diff| prefill {run['max_abs_diff_prefill_logits']:.3g} (tolerance {report['tolerance']:g}), "
          f"decode {run['max_abs_diff_decode_logits']:.3g} (tolerance {run['decode_tolerance']:g})")
    print("PASS" if report["passed"] else "FAIL")
    report_file.write(report)
    return 0 if report["passed"] else 1
