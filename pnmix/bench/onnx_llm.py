"""`pnmix bench onnx --model MODEL`: an LLM file with the pn-mix cache next to a peer, in ONNX Runtime (CPU).

For each context C (default 512, 2048, 4096): a prefill of C tokens (one call, tokens/s), then
``repeats`` greedy decode steps (tokens/s), and the KV bytes each side holds at C + repeats tokens.

* pnmix: the file of `pnmix export --model MODEL` (exported here to a temporary folder unless
  --onnx names one), its packed state fed back each step, with each implementation of the
  pn-mix ops that --ops asks for: ``native`` (libpnmix_ort's kernels) and ``functions`` (the
  file's standard-op bodies); auto: both where libpnmix_ort loads, else the bodies, and then
  ``native_int8`` too: the native ops with the core's integer arithmetic
  (``PNMIX_ATTEND_ARITH=int8``), where the core has it.
* the peer: the same model exported by onnxruntime-genai's model builder
  (``python -m onnxruntime_genai.models.builder``, fp32, CPU) with its standard fp32 KV cache,
  run with onnxruntime-genai's generator. The builder reads a Hugging Face folder: a GGUF model is
  first written as one (its weights dequantized to fp32). --peer none skips it; --peer DIR uses a
  builder output folder made before.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from pnmix import defaults
from pnmix.errors import PnMixError

from pnmix.backends.onnxruntime.llm_session import LlmSession
from pnmix.bench.report import print_table, rate_text, run_report
from pnmix.bench.timing import Stopwatch, time_once
from pnmix.machine import describe_machine

DEFAULT_CONTEXTS = defaults.BENCH_LLM_CONTEXTS


def names_an_llm(spec: str) -> bool:
    """Whether `bench onnx --model` names an LLM (a folder, a .gguf file, a packaged name) rather
    than a diagnostic .onnx file."""
    path = Path(spec)
    if path.is_dir() or spec.lower().endswith(".gguf"):
        return True
    if path.exists() or spec.lower().endswith(".onnx"):
        return False
    from pnmix.hf.models import PACKAGED_MODELS  # imports transformers: only for a bare name

    return spec in PACKAGED_MODELS


def _ids(tokenizer, count: int) -> List[int]:
    from pnmix.dataset import text_or_hamlet

    text = text_or_hamlet(None)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < count:
        ids = ids + ids
    return list(ids[:count])


def _rates(prompt_tokens: int, prefill_s: float, decode: Stopwatch) -> Dict[str, float]:
    """Prefill tokens/s of the one prefill call, decode tokens/s over the timed decode steps."""
    timing = decode.timing()
    return {"prefill_tokens_per_s": prompt_tokens / prefill_s, "decode_tokens_per_s": timing.count / timing.total_s}


# Rows that are an implementation of the ops run with another arithmetic of the core.
ARITH_ROWS = {"native_int8": ("native", "int8")}


def core_has_int8() -> bool:
    from pnmix._native import NativeLibraryError
    from pnmix.backends.core_ops import CoreOps

    try:
        ops = CoreOps()
        ops.set_arith("int8")
        ops.set_arith("auto")
        return True
    except (NativeLibraryError, PnMixError):
        return False


def bench_ops(ops: Optional[str]) -> List[str]:
    """The implementations of the ops to time: auto is every one this machine has."""
    from pnmix.backends.onnxruntime.session import resolve_ops

    chosen = resolve_ops(ops)
    if (ops or "auto") != "auto" or chosen != "native":
        return [chosen]
    return ["native", "native_int8", "functions"] if core_has_int8() else ["native", "functions"]


@contextlib.contextmanager
def core_arith(arith: Optional[str]):
    """PNMIX_ATTEND_ARITH for the block (libpnmix_core reads it at every attention call, so it
    reaches the ONNX Runtime ops), then as it was."""
    before = os.environ.get("PNMIX_ATTEND_ARITH")
    if arith:
        os.environ["PNMIX_ATTEND_ARITH"] = arith
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PNMIX_ATTEND_ARITH", None)
        else:
            os.environ["PNMIX_ATTEND_ARITH"] = before


def time_pnmix(path: Path, ids: List[int], repeats: int, threads: Optional[int], name: str) -> Dict[str, Any]:
    ops, arith = ARITH_ROWS.get(name, (name, None))
    with core_arith(arith):
        session = LlmSession(path, threads, ops=ops)
        logits, prefill = time_once(session.step, ids)
        decode = Stopwatch()
        for _ in range(repeats):
            logits = decode.time(session.step, [int(np.argmax(logits))])
    result = {**_rates(len(ids), prefill, decode),
              "kv_bytes": session.cache_bytes()["persistent_cache_bytes"],
              "kv_bytes_allocated": session.cache_bytes()["allocated_bytes"]}
    # Drop the row's session before the next row runs: one left to the garbage collector keeps its
    # arena (gigabytes after an 8K prefill) and threads, and rows after it ran at a third of their
    # speed (docs/OPS.md 5.3).
    del session
    gc.collect()
    return result


def time_peer(folder: Path, ids: List[int], repeats: int) -> Dict[str, Any]:
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise PnMixError("the peer needs onnxruntime-genai: pip install onnxruntime-genai (or --peer none)") from None
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + repeats + 1, do_sample=False)
    generator = og.Generator(model, params)
    prefill = time_once(generator.append_tokens, ids)[1]
    decode = Stopwatch()
    for _ in range(repeats):
        decode.time(generator.generate_next_token)
    result = _rates(len(ids), prefill, decode)
    del generator, params, model  # as time_pnmix's session
    gc.collect()
    return result


def check_file_model(info, model: str, source, model_config, tokenizer) -> None:
    """--onnx FILE must be an export of --model MODEL: the model its metadata names (the name the
    export gave it, pnmix.hf.models.ModelSource.name, or a name that resolves to the same folder or
    file here), and MODEL's shapes and tokenizer (llm_file.check_model)."""
    from pnmix.export.llm_file import check_model
    from pnmix.hf.models import resolve_model
    from pnmix.verify.llm import model_facts

    if info.model != source.name:
        try:
            named = resolve_model(info.model)
            same = (named.folder.resolve(), named.gguf_file) == (source.folder.resolve(), source.gguf_file)
        except (PnMixError, OSError):  # the file's model is not here under that name
            same = False
        if not same:
            raise PnMixError(f"{info.path.name} was exported from {info.model}, not from --model {model}: "
                             f"give the model it was exported from, or export {model}")
    check_model(info, model, model_facts(model_config), tokenizer)


def fp_kv_bytes(model_config, tokens: int, bytes_per: int) -> int:
    from pnmix.hf.models import ModelDims

    return ModelDims.from_config(model_config).kv_bytes(tokens, bytes_per)


def build_peer(model: str, folder: Path) -> Path:
    """onnxruntime-genai's builder on an HF folder of MODEL (written first for a GGUF model)."""
    from pnmix.hf.models import resolve_model, save_hf_folder

    hf_folder = save_hf_folder(resolve_model(model), folder / "hf")
    out = folder / "peer"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder),
                           "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(folder / "cache")],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        last = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()][-1:] or ["no output"]
        raise PnMixError(f"onnxruntime-genai's model builder failed offline: {last[0]} (use --peer none)")
    return out


def bench_llm(model: str, contexts=DEFAULT_CONTEXTS, repeats: int = defaults.BENCH_REPEATS, onnx_path: Optional[Path] = None,
              peer: str = "auto", threads: Optional[int] = None, ops: Optional[str] = None) -> Dict[str, Any]:
    from pnmix.hf.models import load_model_config, load_tokenizer, resolve_model

    from pnmix.export.llm import export_llm
    from pnmix.export.llm_file import read_llm_info

    source = resolve_model(model)
    model_config = load_model_config(source)
    tokenizer = load_tokenizer(source)
    capacity = max(contexts) + repeats + 1
    implementations = bench_ops(ops)
    report: Dict[str, Any] = {"model": model, "contexts": list(contexts), "repeats": repeats, "ops": implementations,
                              "rows": []}
    with tempfile.TemporaryDirectory(prefix="pnmix-bench-llm-") as tmp:
        folder = Path(tmp)
        if onnx_path is None:
            result = export_llm(model, folder / "m.onnx", capacity)
            onnx_path = result.path
            report.update(export_seconds=result.seconds, file_bytes=result.file_bytes, data_bytes=result.data_bytes)
        else:  # the file must be MODEL's: its peer, its KV bytes and its ids are MODEL's
            check_file_model(read_llm_info(onnx_path), model, source, model_config, tokenizer)
        peer_folder = None
        if peer == "auto":
            peer_folder, report["peer_build_seconds"] = time_once(build_peer, model, folder)
        elif peer != "none":
            peer_folder = Path(peer)
        for context in contexts:
            ids = _ids(tokenizer, context)
            row = {"context": context,
                   "pnmix": {name: time_pnmix(onnx_path, ids, repeats, threads, name) for name in implementations}}
            if peer_folder is not None:
                row["peer"] = time_peer(peer_folder, ids, repeats)
            row["fp32_kv_bytes"] = fp_kv_bytes(model_config, context + repeats, 4)
            row["fp16_kv_bytes"] = fp_kv_bytes(model_config, context + repeats, 2)
            report["rows"].append(row)
    report["machine"] = describe_machine(threads=threads, onnxruntime=True)
    return report


def _ratio(mine: Optional[float], peer: Optional[float]) -> str:
    return "-" if not mine or not peer else f"{mine / peer:.2f}x"


def print_bench_llm(report: Dict[str, Any]) -> None:
    columns = ["context"]
    for name in report["ops"]:
        columns += [f"{name} prefill/s", f"{name} decode/s", f"{name} decode vs peer"]
    columns += ["peer prefill/s", "peer decode/s", "pnmix KV bytes", "fp32 KV bytes"]
    rows = []
    for row in report["rows"]:
        peer_row = row.get("peer", {})
        cells = [str(row["context"])]
        for name in report["ops"]:
            mine = row["pnmix"][name]
            cells += [f"{mine['prefill_tokens_per_s']:.1f}", f"{mine['decode_tokens_per_s']:.2f}",
                      _ratio(mine["decode_tokens_per_s"], peer_row.get("decode_tokens_per_s"))]
        kv_bytes = next(iter(row["pnmix"].values()))["kv_bytes"]
        cells += [rate_text(peer_row.get("prefill_tokens_per_s"), 1), rate_text(peer_row.get("decode_tokens_per_s"), 2),
                  str(kv_bytes), str(row["fp32_kv_bytes"])]
        rows.append(tuple(cells))
    notes = []
    if "export_seconds" in report:
        notes.append(f"export: {report['export_seconds']:.1f} s, {report['file_bytes']} + {report['data_bytes']} bytes")
    print_table(f"pnmix bench onnx --model {report['model']}: {report['repeats']} decode steps per context",
                tuple(columns), rows, notes=notes)


def bench_llm_command(model: str, contexts: str, repeats: int, onnx_path: Optional[Path], peer: str,
                      json_path: Optional[Path], ops: Optional[str] = None) -> int:
    """The CLI's `pnmix bench onnx --model` (pnmix/cli.py): print the table, write JSON, return 0."""
    from pnmix.errors import parse_positive_ints

    def run() -> Dict[str, Any]:
        chosen = tuple(parse_positive_ints(contexts, "--contexts"))
        if repeats < 1:
            raise PnMixError(f"--repeats must be >= 1, got {repeats}")
        return bench_llm(model, chosen, repeats, onnx_path, peer, ops=ops)

    run_report(json_path, run, print_bench_llm)
    return 0
