"""Export the diagnostic model with the pn-mix custom ops to ONE ONNX file.

The file serves prefill, decode and evaluation alike; the KV cache is explicit state:

* inputs: ``tokens`` int64 [B, n] (n dynamic), ``seq_len`` int64 scalar (tokens already in the
  cache), ``new_len`` int64 scalar (n: append these tokens; 0: read-only evaluation, the tokens
  are the LAST n positions already in the cache), then the eleven state tensors
  (pnmix.format.STATE_NAMES; codes and mask INT8, the rest fp16) at fixed capacity;
* outputs: ``attention`` fp32 [B, Hq, n, D] (per head, before o_proj), ``output`` fp32
  [B, n, d_model] and ``present_<name>`` for each state tensor.

The file is traced, by the same exporter as the Llama family (export/tracing.py), from
``DiagnosticStep``: a PyTorch module that calls pnmix.model.project (the reference's own token
tables and RoPE, so the fp16 K/V equal the reference's bit for bit) and the two ops of
export/torch_ops.py. The traced model then goes through onnx-ir (finish_with_onnx_ir) for its
clean-up passes; weights stay inline (one self-contained file).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import nn

from pnmix import defaults
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.model import HEAD_DIM, KV_HEADS, Q_HEADS, SEED_RANGE, DiagnosticModel, project, rope_indices, rope_tables

from . import ops, torch_ops, tracing
from .append_body import append_function
from .attention_body import attention_function
from .modelfile import GRAPH_INPUTS, GRAPH_OUTPUTS
from .tracing import state_name

MIN_OPSET = 18  # ReduceMin/ReduceMax take axes as an input from opset 18
DEFAULT_OPSET = defaults.EXPORT_OPSET
# The file's size is the RoPE tables (cos and sin, fp32, D/2 each per position) and about 0.4 MB
# of weights and graph; protobuf caps a file with inline data at 2 GiB.
ROPE_BYTES_PER_TOKEN = HEAD_DIM * 4
MAX_EXPORT_SEQ_LEN = ((1 << 31) - (4 << 20)) // ROPE_BYTES_PER_TOKEN
EXPORT_BYTES_PER_TOKEN = 1024  # peak memory while tracing and checking, measured (~900 at 1M-4M positions)
WEIGHT_NAMES = ("q_table", "k_table", "v_table", "o_weight_t")


@dataclass(frozen=True)
class ExportResult:
    path: Path
    seconds: float
    file_bytes: int


def seed_weights(seed: int) -> Dict[str, np.ndarray]:
    """The diagnostic model's weights for a seed, as the file's initializers hold them."""
    model = DiagnosticModel(seed)
    tq, tk, tv = model.token_tables()
    return {
        "q_table": tq.numpy(), "k_table": tk.numpy(), "v_table": tv.numpy(),
        "o_weight_t": model.o_proj.weight.T.contiguous().numpy(),
    }


def check_opset(opset: int) -> None:
    """--opset of any export (the diagnostic model's or an LLM's)."""
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise PnMixError(f"--opset must be {MIN_OPSET}..{newest}, got {opset}")


def check_export_args(config: PnMixConfig, max_seq_len: int, batch: int, opset: int, seed: int = defaults.MODEL_SEED) -> CacheLayout:
    """Every export option's range, in one place, before anything is built."""
    check_opset(opset)
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise PnMixError(f"--seed must be an integer {SEED_RANGE[0]}..{SEED_RANGE[1]} (a torch seed), got {seed!r}")
    layout = CacheLayout(config, batch, KV_HEADS, HEAD_DIM, max_seq_len)
    if max_seq_len > MAX_EXPORT_SEQ_LEN:
        raise PnMixError(
            f"max_seq_len {max_seq_len} is too large to export: the file holds RoPE tables of "
            f"{ROPE_BYTES_PER_TOKEN} bytes per position and an ONNX file must stay under 2 GiB; "
            f"the most is {MAX_EXPORT_SEQ_LEN}"
        )
    from pnmix.memory import check_fits

    check_fits(EXPORT_BYTES_PER_TOKEN * max_seq_len, f"exporting max_seq_len {max_seq_len}", "lower --max-seq-len")
    if config.replace(high_ratio=ops.fp32_ratio(config)).high_pairs(HEAD_DIM) != config.high_pairs(HEAD_DIM):
        raise PnMixError(
            f"config field 'high_ratio' {config.high_ratio!r} changes n_high when stored as the "
            "ops' float32 attribute; choose a value exact in float32"
        )
    return layout


class DiagnosticStep(nn.Module):
    """One call of the diagnostic model's file, in PyTorch: what build_model traces.

    The model part is pnmix.model.project itself (token tables, RoPE, fp16 K/V) at the positions
    seq_len + new_len - n .. (write mode starts at seq_len, evaluation at seq_len - n), then the
    two pn-mix ops and the output projection."""

    # buffers registered in __init__ (the weights under WEIGHT_NAMES, then the RoPE tables)
    q_table: torch.Tensor
    k_table: torch.Tensor
    v_table: torch.Tensor
    o_weight_t: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: PnMixConfig, layout: CacheLayout, seed: int):
        super().__init__()
        self.layout, self.pair_layout = layout, config.pair_layout
        self.config_text = torch_ops.config_text(config)
        for name, array in seed_weights(seed).items():  # initializer names = WEIGHT_NAMES
            self.register_buffer(name, torch.from_numpy(array))
        cos, sin = rope_tables(layout.max_seq_len)
        rope_indices(HEAD_DIM, config.pair_layout)  # constants now, not traced code
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)

    def forward(self, tokens, seq_len, new_len, state: List[torch.Tensor]):
        n = tokens.shape[1]
        # arange over n alone, then shift: the Range's length then depends on the input shape only,
        # so TensorRT keeps seq_len/new_len as ordinary execution tensors, not shape inputs.
        positions = torch.arange(n) + (seq_len + new_len - n)
        qkv = project((self.q_table, self.k_table, self.v_table), tokens, self.rope_cos.index_select(0, positions),
                      self.rope_sin.index_select(0, positions), self.pair_layout)
        capacity = self.layout.max_seq_len
        attention = torch_ops.attention(qkv.q, qkv.k, qkv.v, seq_len, new_len, state, self.config_text, capacity)
        present = torch_ops.append(qkv.k, qkv.v, seq_len, new_len, state, self.config_text, capacity)
        merged = attention.transpose(1, 2).reshape(tokens.shape[0], -1, Q_HEADS * HEAD_DIM)
        return (attention, torch.matmul(merged, self.o_weight_t), *present)


def build_model(config: PnMixConfig, max_seq_len: int = defaults.EXPORT_MAX_SEQ_LEN, batch: int = defaults.EXPORT_BATCH,
                seed: int = defaults.MODEL_SEED,
                opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """The ONNX model (in memory) of the diagnostic model with a cache of max_seq_len tokens,
    traced from DiagnosticStep by the one exporter (export/tracing.py)."""
    import onnx_ir as ir

    layout = check_export_args(config, max_seq_len, batch, opset, seed)
    step = DiagnosticStep(config, layout, seed).eval()
    with torch.no_grad():
        traced = tracing.trace(step, layout, torch_ops.empty_graph_state(layout), GRAPH_INPUTS, GRAPH_OUTPUTS, opset)
    tracing.finish(traced, layout, Q_HEADS, opset, {
        "format_version": "1", "seed": str(seed), "max_seq_len": str(max_seq_len), "batch": str(batch),
        "config": json.dumps(config.to_dict(), sort_keys=True),
    })
    traced.graph.name = "pnmix_diagnostic"
    return finish_with_onnx_ir(ir.serde.serialize_model(traced))


def finish_with_onnx_ir(model: onnx.ModelProto) -> onnx.ModelProto:
    """The assembled model through onnx-ir's passes: merge the many identical constants the
    builder emits, drop what nothing reads, and order nodes topologically (graph and functions)."""
    import onnx_ir as ir
    from onnx_ir.passes import PassManager
    from onnx_ir.passes import common

    ir_model = ir.serde.deserialize_model(model)
    PassManager([
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.TopologicalSortPass(),
    ])(ir_model)
    return ir.serde.serialize_model(ir_model)


def build_op_model(op: str, config: PnMixConfig, max_seq_len: int, batch: int = 1, q_heads: int = Q_HEADS,
                   opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """A model holding ONE pn-mix node (and its function) with the op's own inputs and outputs:
    for testing a runtime or a plugin op by op on K/V of one's choosing."""
    layout = check_export_args(config, max_seq_len, batch, opset)
    shapes = layout.state_shapes()
    kv: List[Union[str, int]] = [batch, KV_HEADS, "n", HEAD_DIM]
    specs: Dict[str, Tuple[int, Sequence[Union[str, int]]]] = {"q": (TensorProto.FLOAT16, [batch, q_heads, "n", HEAD_DIM]), "k_new": (TensorProto.FLOAT16, kv),
             "v_new": (TensorProto.FLOAT16, kv), "seq_len": (TensorProto.INT64, []), "new_len": (TensorProto.INT64, [])}
    specs.update({name: (ops.STATE_ONNX_TYPES[name], list(shapes[name])) for name in STATE_NAMES})
    specs["attention"] = (TensorProto.FLOAT, [batch, q_heads, "n", HEAD_DIM])
    specs.update({state_name(name, present=True): specs[name] for name in STATE_NAMES})
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    if op == ops.ATTENTION_OP:
        inputs, outputs, function = ops.ATTENTION_INPUTS, ops.ATTENTION_OUTPUTS, attention_function(layout, q_heads, opset)
    elif op == ops.APPEND_OP:
        inputs, outputs, function = ops.APPEND_INPUTS, ops.APPEND_OUTPUTS, append_function(layout, opset)
    else:
        raise PnMixError(f"unknown pn-mix op {op!r}; choose {ops.ATTENTION_OP} or {ops.APPEND_OP}")
    node = helper.make_node(op, list(inputs), list(outputs), domain=ops.DOMAIN, **ops.node_attributes(config))
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(name, *specs[name]) for name in inputs],
        [helper.make_tensor_value_info(name, *specs[name]) for name in outputs])
    model = helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(ops.DOMAIN, ops.DOMAIN_VERSION)])
    model.ir_version = min(model.ir_version, 10)
    return model


def export_onnx(path: str | Path, config: PnMixConfig, max_seq_len: int = defaults.EXPORT_MAX_SEQ_LEN,
                batch: int = defaults.EXPORT_BATCH, seed: int = defaults.MODEL_SEED, opset: int = DEFAULT_OPSET,
                check: bool = True) -> ExportResult:
    """Build, check (onnx.checker full_check, shape inference) and write the file atomically."""
    from pnmix.io import write_bytes_atomic

    began = time.perf_counter()
    model = build_model(config, max_seq_len, batch, seed, opset)
    if check:
        check_model_proto(model)
    data = model.SerializeToString()
    write_bytes_atomic(path, data)
    return ExportResult(Path(path), time.perf_counter() - began, len(data))


def check_model_proto(model: onnx.ModelProto) -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PnMixError(f"exported model fails the ONNX checker: {first}") from None


def export_command(output: Path, config: Optional[Path], manifest: Optional[Path], max_seq_len: int,
                   batch: int, opset: int, seed: int) -> int:
    """`pnmix export`: write the file and print what was written."""
    from pnmix.config import run_config
    from pnmix.io import check_output_path
    from pnmix.manifest import load_manifest

    check_output_path(output)  # before the build, not after it
    run = run_config(load_manifest(manifest), config)
    result = export_onnx(output, run.config, max_seq_len, batch, seed, opset)
    print(f"wrote {result.path} ({result.file_bytes} bytes, {result.seconds:.2f} s): max_seq_len "
          f"{max_seq_len}, batch {batch}, opset {opset}, seed {seed}, ops {ops.ATTENTION_OP} + "
          f"{ops.APPEND_OP} (domain {ops.DOMAIN})")
    return 0
