"""`pnmix export --model MODEL`: a whole Llama-family decoder with the pn-mix cache in ONE ONNX file.

The model is the PyTorch decoder of export/llama.py, loaded with the weights of MODEL (pnmix.hf.models
resolves a Hugging Face folder, a .gguf file or a packaged name) and traced with PyTorch's ONNX
exporter (``torch.onnx.export(..., dynamo=True)``). The two custom ops are translated into the
``pnmix::PnMixAttention`` / ``pnmix::PnMixAppend`` nodes of export/ops.py's table and the file
gets the ops' function bodies (export/torch_ops.py), so ONNX Runtime runs it as is.

The file: ``model.onnx`` with the graph and ``model.onnx.data`` beside it with the weights (ONNX
external data: a model over 2 GiB fits). Interface (docs/OPS.md, "The LLM file"): inputs
``input_ids`` int64 [1, n], ``seq_len``, ``new_len`` (int64 scalars), ``past.<layer>.<state name>``;
outputs ``logits`` fp32 [1, 1, vocab] (the last position) and ``present.<layer>.<state name>``.
The metadata (``pnmix.*``) records the config, the capacity and the model and tokenizer the file
was made from, so generate/verify can refuse a tokenizer that does not match.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from pnmix import defaults
from pnmix.config import PnMixConfig, read_json_file
from pnmix.errors import PnMixError, describe

from .llm_file import LlmMetadata, tokenizer_fingerprint
from .tracing import finish

EXPORT_OPSET = defaults.EXPORT_OPSET
DTYPES = ("fp32", "fp16")


@dataclass(frozen=True)
class LlmExportResult:
    path: Path
    data_path: Path
    seconds: float
    file_bytes: int
    data_bytes: int
    layers: int
    max_seq_len: int


def llm_config(model_config: Any, config_path: Optional[Path]) -> PnMixConfig:
    """The cache config of an export: PnMixCache's default for the model (pnmix.hf.models), with the
    fields of a --config JSON file laid over it; the same config the torch side of verify uses."""
    from pnmix.hf.models import resolve_config

    fields: Dict[str, Any] = {}
    if config_path is not None:
        fields = read_json_file(config_path, "config")
        if not isinstance(fields, dict):
            raise PnMixError(f"config file {config_path} must hold a JSON object of config fields")
    try:
        return resolve_config(None, fields, model_config)
    except TypeError as exc:  # an unknown field name
        raise PnMixError(f"config file {config_path}: {describe(exc)}") from None


def build_decoder(source, dtype: str, max_seq_len: int, config_path: Optional[Path]):
    """(decoder, hf model, model config) for MODEL, every check before the weights load."""
    from pnmix.hf.models import load_causal_lm, load_model_config

    from .llama import Dims, PnMixDecoder

    if dtype not in DTYPES:
        raise PnMixError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model_config = load_model_config(source)
    Dims.from_config(model_config).check_capacity(max_seq_len)
    config = llm_config(model_config, config_path)
    hf_model = load_causal_lm(source, dtype, model_config=model_config)
    return PnMixDecoder(hf_model, config, max_seq_len).eval(), hf_model, model_config


def trace(decoder) -> Any:
    """The decoder through the one exporter (export/tracing.py): an onnx_ir model with pn-mix nodes."""
    from .tracing import trace as trace_module

    inputs, outputs = decoder.state_names()
    return trace_module(decoder, decoder.layout, decoder.empty_state(), ["input_ids", "seq_len", "new_len", *inputs],
                        ["logits", *outputs], EXPORT_OPSET)


def save_atomic(ir_model, path: Path) -> Path:
    """model.onnx and model.onnx.data, staged in a temporary folder beside them and renamed (data
    first): an error leaves no file and no half-written pair behind."""
    import onnx_ir as ir

    data_path = path.with_name(path.name + ".data")
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        ir.save(ir_model, staging / path.name, external_data=data_path.name)
        os.replace(staging / data_path.name, data_path)
        os.replace(staging / path.name, path)
    except OSError as exc:
        raise PnMixError(f"cannot write {path}: {exc.strerror or describe(exc)}") from None
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
    return data_path


def export_llm(model: str, output: Path, max_seq_len: int = defaults.EXPORT_MAX_SEQ_LEN,
               config_path: Optional[Path] = None, dtype: str = defaults.LLM_EXPORT_DTYPE,
               check: bool = True) -> LlmExportResult:
    from pnmix.hf.models import load_tokenizer, resolve_model
    from pnmix.io import check_output_path

    check_output_path(output)
    began = time.perf_counter()
    source = resolve_model(model)
    decoder, _, model_config = build_decoder(source, dtype, max_seq_len, config_path)
    tokenizer = load_tokenizer(source)
    dims = decoder.dims
    ir_model = trace(decoder)
    layout = decoder.layout
    metadata = LlmMetadata(config=layout.config, max_seq_len=layout.max_seq_len, batch=layout.batch,
                           model=source.name, model_type=dims.model_type, layers=dims.layers, q_heads=dims.q_heads,
                           kv_heads=dims.kv_heads, head_dim=dims.head_dim, vocab_size=dims.vocab, dtype=dtype,
                           tokenizer_sha256=tokenizer_fingerprint(tokenizer))
    finish(ir_model, layout, dims.q_heads, EXPORT_OPSET, metadata.to_props())
    data_path = save_atomic(ir_model, output)
    if check:
        check_written(output)
    return LlmExportResult(output, data_path, time.perf_counter() - began, output.stat().st_size,
                           data_path.stat().st_size, dims.layers, max_seq_len)


def check_written(path: Path) -> None:
    """The ONNX checker over the written file (path-based: weights stay on disk)."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, OSError) as exc:
        for leftover in (path, path.with_name(path.name + ".data")):
            leftover.unlink(missing_ok=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PnMixError(f"exported model fails the ONNX checker: {first}") from None


def export_llm_command(model: str, output: Path, max_seq_len: int, config: Optional[Path], dtype: str) -> int:
    result = export_llm(model, output, max_seq_len, config, dtype)
    print(f"wrote {result.path} ({result.file_bytes} bytes) and {result.data_path.name} ({result.data_bytes} "
          f"bytes) in {result.seconds:.1f} s: {model}, {result.layers} layers, max_seq_len {max_seq_len}, "
          f"dtype {dtype}, pn-mix ops {result.layers} x 2")
    return 0
