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
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from pnmix import defaults
from pnmix.config import PnMixConfig, read_json_file
from pnmix.errors import PnMixError, describe

from .llm_file import LlmMetadata, data_digest, tokenizer_fingerprint
from .tracing import META_PREFIX, finish

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


def build_decoder(source, dtype: str, max_seq_len: int, config_path: Optional[Path],
                  opset: int = defaults.LLM_EXPORT_OPSET):
    """(decoder, hf model, model config) for MODEL, every check before the weights load. From
    ATTENTION_OP_OPSET the prefill's attention is written as ONNX's Attention op."""
    from pnmix.hf.models import load_causal_lm, load_model_config

    from .exporter import check_opset
    from .llama import Dims, PnMixDecoder

    if dtype not in DTYPES:
        raise PnMixError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_opset(opset)
    model_config = load_model_config(source)
    Dims.from_config(model_config).check_capacity(max_seq_len)
    config = llm_config(model_config, config_path)
    hf_model = load_causal_lm(source, dtype, model_config=model_config)
    decoder = PnMixDecoder(hf_model, config, max_seq_len, fused_prefill=opset >= defaults.ATTENTION_OP_OPSET)
    return decoder.eval(), hf_model, model_config


def trace(decoder, opset: int = defaults.LLM_EXPORT_OPSET) -> Any:
    """The decoder through the one exporter (export/tracing.py): an onnx_ir model with pn-mix nodes."""
    from .tracing import trace as trace_module

    inputs, outputs = decoder.state_names()
    return trace_module(decoder, decoder.layout, decoder.empty_state(), ["input_ids", "seq_len", "new_len", *inputs],
                        ["logits", *outputs], opset)


def save_atomic(ir_model, path: Path, check: bool = True) -> Path:
    """model.onnx and model.onnx.data, staged in a temporary folder beside them, the digest of the
    data recorded in the model's metadata (pnmix.data_sha256), the ONNX checker run on the staged
    pair, then renamed (data first): an error leaves no file and no half-written pair behind, and
    the old pair as it was. A file that existed keeps its permission bits (as pnmix.io's outputs)."""
    import onnx_ir as ir

    data_path = path.with_name(path.name + ".data")
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        ir.save(ir_model, staging / path.name, external_data=data_path.name)
        record_data_digest(staging / path.name, staging / data_path.name)
        if check:
            check_written(staging / path.name, path)
        for staged, target in ((staging / data_path.name, data_path), (staging / path.name, path)):
            keep_mode(staged, target)
        os.replace(staging / data_path.name, data_path)
        os.replace(staging / path.name, path)
    except OSError as exc:
        raise PnMixError(f"cannot write {path}: {exc.strerror or describe(exc)}") from None
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
    return data_path


def record_data_digest(model_path: Path, data_path: Path) -> None:
    """Write the weights file's digest into the model's pnmix.data_sha256 (the graph only: the
    weights stay where ir.save put them)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    key = META_PREFIX + "data_sha256"
    entry = next(p for p in proto.metadata_props if p.key == key)
    entry.value = data_digest(data_path)
    onnx.save(proto, str(model_path))


def keep_mode(staged: Path, target: Path) -> None:
    """A replaced output keeps its permission bits; a new one has what the umask gives."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return
    os.chmod(staged, mode)


def export_llm(model: str, output: Path, max_seq_len: int = defaults.EXPORT_MAX_SEQ_LEN,
               config_path: Optional[Path] = None, dtype: str = defaults.LLM_EXPORT_DTYPE,
               check: bool = True, opset: int = defaults.LLM_EXPORT_OPSET) -> LlmExportResult:
    from pnmix.hf.models import load_tokenizer, resolve_model
    from pnmix.io import check_output_path

    check_output_path(output)
    check_output_path(output.with_name(output.name + ".data"))  # a folder or a FIFO there: refused now, not after the export
    began = time.perf_counter()
    source = resolve_model(model)
    decoder, _, model_config = build_decoder(source, dtype, max_seq_len, config_path, opset)
    tokenizer = load_tokenizer(source)
    dims = decoder.dims
    ir_model = trace(decoder, opset)
    layout = decoder.layout
    metadata = LlmMetadata(config=layout.config, max_seq_len=layout.max_seq_len, batch=layout.batch,
                           model=source.name, model_type=dims.model_type, layers=dims.layers, q_heads=dims.q_heads,
                           kv_heads=dims.kv_heads, head_dim=dims.head_dim, vocab_size=dims.vocab, dtype=dtype,
                           tokenizer_sha256=tokenizer_fingerprint(tokenizer),
                           data_sha256="0" * 64)  # the digest of the weights, once save_atomic has written them
    finish(ir_model, layout, dims.q_heads, opset, metadata.to_props())
    data_path = save_atomic(ir_model, output, check)
    return LlmExportResult(output, data_path, time.perf_counter() - began, output.stat().st_size,
                           data_path.stat().st_size, dims.layers, max_seq_len)


def check_written(path: Path, output: Path) -> None:
    """The ONNX checker over the staged file (path-based: weights stay on disk); output: the name
    the file will have, for the error."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PnMixError(f"exported model {output} fails the ONNX checker: {first}") from None


def export_llm_command(model: str, output: Path, max_seq_len: int, config: Optional[Path], dtype: str,
                       opset: int = defaults.LLM_EXPORT_OPSET) -> int:
    result = export_llm(model, output, max_seq_len, config, dtype, opset=opset)
    print(f"wrote {result.path} ({result.file_bytes} bytes) and {result.data_path.name} ({result.data_bytes} "
          f"bytes) in {result.seconds:.1f} s: {model}, {result.layers} layers, max_seq_len {max_seq_len}, "
          f"dtype {dtype}, opset {opset}, pn-mix ops {result.layers} x 2")
    return 0
