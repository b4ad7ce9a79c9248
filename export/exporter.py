"""Export the diagnostic model with the pn-mix custom ops to ONE ONNX file.

The file serves prefill, decode and evaluation alike; the KV cache is explicit state:

* inputs: ``tokens`` int64 [B, n] (n dynamic), ``seq_len`` int64 scalar (tokens already in the
  cache), ``new_len`` int64 scalar (n: append these tokens; 0: read-only evaluation, the tokens
  are the LAST n positions already in the cache), then the eleven state tensors
  (pnmix.format.STATE_NAMES; codes and mask INT8, the rest fp16) at fixed capacity;
* outputs: ``attention`` fp32 [B, Hq, n, D] (per head, before o_proj), ``output`` fp32
  [B, n, d_model] and ``present_<name>`` for each state tensor.

The model part gathers fp32 q/k/v rows from token tables and applies RoPE with the same
element-wise ops as pnmix.model.apply_rope, so the fp16 K/V equal the reference's bit for bit.
Nodes are written with onnx.helper (every node is ours, nothing is traced; not the TorchScript
exporter), then the model goes through onnx-ir (finish_with_onnx_ir) for its clean-up passes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pnmix import defaults
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.model import (D_MODEL, HEAD_DIM, KV_HEADS, Q_HEADS, SEED_RANGE, DiagnosticModel, pair_channels,
                         rope_tables)

from . import ops

MIN_OPSET = 18  # ReduceMin/ReduceMax take axes as an input from opset 18
DEFAULT_OPSET = defaults.EXPORT_OPSET
# The file's size is the RoPE tables (cos and sin, fp32, D/2 each per position) and about 0.4 MB
# of weights and graph; protobuf caps a file with inline data at 2 GiB.
ROPE_BYTES_PER_TOKEN = HEAD_DIM * 4
MAX_EXPORT_SEQ_LEN = ((1 << 31) - (4 << 20)) // ROPE_BYTES_PER_TOKEN
EXPORT_BYTES_PER_TOKEN = 768  # peak memory while building and checking, measured (~640 at 1M-4M)
WEIGHT_NAMES = ("q_table", "k_table", "v_table", "o_weight_t")
META_PREFIX = "pnmix."


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


def check_export_args(config: PnMixConfig, max_seq_len: int, batch: int, opset: int, seed: int = defaults.MODEL_SEED) -> CacheLayout:
    """Every export option's range, in one place, before anything is built."""
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise PnMixError(f"--opset must be {MIN_OPSET}..{newest}, got {opset}")
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


def build_model(config: PnMixConfig, max_seq_len: int = defaults.EXPORT_MAX_SEQ_LEN, batch: int = defaults.EXPORT_BATCH,
                seed: int = defaults.MODEL_SEED,
                opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """The ONNX model (in memory) of the diagnostic model with a cache of max_seq_len tokens."""
    layout = check_export_args(config, max_seq_len, batch, opset, seed)
    b = ops.Body("model")
    weights = seed_weights(seed)
    cos, sin = rope_tables(max_seq_len)
    initializers = [numpy_helper.from_array(array, name) for name, array in weights.items()]
    initializers += [numpy_helper.from_array(cos.numpy(), "rope_cos"), numpy_helper.from_array(sin.numpy(), "rope_sin")]

    # Positions: write mode starts at seq_len, evaluation at seq_len - n; both are
    # seq_len + new_len - n.
    n = b.op("Gather", b.op("Shape", "tokens"), b.const(1), axis=0)
    start = b.op("Sub", b.op("Add", "seq_len", "new_len"), n)
    # Range over n alone, then shift: the Range's length then depends on the input shape only,
    # so TensorRT keeps seq_len/new_len as ordinary execution tensors, not shape inputs.
    positions = b.op("Add", b.op("Range", b.const(0), n, b.const(1)), start)
    cos_n = b.op("Gather", "rope_cos", positions, axis=0)  # [n, P]
    sin_n = b.op("Gather", "rope_sin", positions, axis=0)

    def heads(table: str, count: int) -> str:
        rows = b.op("Gather", table, "tokens", axis=0)  # [B, n, count*D]
        split = b.op("Reshape", rows, b.const([batch, -1, count, HEAD_DIM]))
        return b.op("Transpose", split, perm=[0, 2, 1, 3])  # [B, count, n, D]

    first, second = pair_channels(HEAD_DIM, config.pair_layout)
    order = np.argsort(np.concatenate([first.numpy(), second.numpy()]))

    def rope(x: str) -> str:
        # pnmix.model.apply_rope, op for op: a*cos - b*sin, a*sin + b*cos.
        a = b.op("Gather", x, b.const(first.numpy()), axis=3)
        c = b.op("Gather", x, b.const(second.numpy()), axis=3)
        out_a = b.op("Sub", b.op("Mul", a, cos_n), b.op("Mul", c, sin_n))
        out_b = b.op("Add", b.op("Mul", a, sin_n), b.op("Mul", c, cos_n))
        return b.op("Gather", b.op("Concat", out_a, out_b, axis=3), b.const(order), axis=3)

    fp16 = TensorProto.FLOAT16
    q = b.cast(rope(heads("q_table", Q_HEADS)), fp16)
    k = b.cast(rope(heads("k_table", KV_HEADS)), fp16)
    v = b.cast(heads("v_table", KV_HEADS), fp16)
    attrs = ops.node_attributes(config)
    b.nodes.append(helper.make_node(ops.ATTENTION_OP, [q, k, v, "seq_len", "new_len", *STATE_NAMES],
                                    ["attention"], name="pnmix_attention", domain=ops.DOMAIN, **attrs))
    b.nodes.append(helper.make_node(ops.APPEND_OP, [k, v, "seq_len", "new_len", *STATE_NAMES],
                                    list(ops.APPEND_OUTPUTS), name="pnmix_append", domain=ops.DOMAIN, **attrs))
    merged = b.op("Reshape", b.op("Transpose", "attention", perm=[0, 2, 1, 3]), b.const([batch, -1, Q_HEADS * HEAD_DIM]))
    b.output(b.op("MatMul", merged, "o_weight_t"), "output")

    shapes = layout.state_shapes()
    inputs = [
        helper.make_tensor_value_info("tokens", TensorProto.INT64, [batch, "n"]),
        helper.make_tensor_value_info("seq_len", TensorProto.INT64, []),
        helper.make_tensor_value_info("new_len", TensorProto.INT64, []),
    ] + [helper.make_tensor_value_info(name, ops.STATE_ONNX_TYPES[name], shapes[name]) for name in STATE_NAMES]
    outputs = [
        helper.make_tensor_value_info("attention", TensorProto.FLOAT, [batch, Q_HEADS, "n", HEAD_DIM]),
        helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, "n", D_MODEL]),
    ] + [helper.make_tensor_value_info(f"present_{name}", ops.STATE_ONNX_TYPES[name], shapes[name])
         for name in STATE_NAMES]
    graph = helper.make_graph(b.nodes, "pnmix_diagnostic", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(ops.DOMAIN, ops.DOMAIN_VERSION)],
        functions=[ops.attention_function(layout, Q_HEADS, opset), ops.append_function(layout, opset)],
        producer_name="pnmix",
        producer_version=_version(),
    )
    model.ir_version = min(model.ir_version, 10)  # what current ONNX Runtime releases read
    helper.set_model_props(model, {
        META_PREFIX + "format_version": "1",
        META_PREFIX + "seed": str(seed),
        META_PREFIX + "max_seq_len": str(max_seq_len),
        META_PREFIX + "batch": str(batch),
        META_PREFIX + "config": json.dumps(config.to_dict(), sort_keys=True),
    })
    return finish_with_onnx_ir(model)


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
    kv = [batch, KV_HEADS, "n", HEAD_DIM]
    specs = {"q": (TensorProto.FLOAT16, [batch, q_heads, "n", HEAD_DIM]), "k_new": (TensorProto.FLOAT16, kv),
             "v_new": (TensorProto.FLOAT16, kv), "seq_len": (TensorProto.INT64, []), "new_len": (TensorProto.INT64, [])}
    specs.update({name: (ops.STATE_ONNX_TYPES[name], list(shapes[name])) for name in STATE_NAMES})
    specs["attention"] = (TensorProto.FLOAT, [batch, q_heads, "n", HEAD_DIM])
    specs.update({f"present_{name}": specs[name] for name in STATE_NAMES})
    if op == ops.ATTENTION_OP:
        inputs, outputs, function = ops.ATTENTION_INPUTS, ops.ATTENTION_OUTPUTS, ops.attention_function(layout, q_heads, opset)
    elif op == ops.APPEND_OP:
        inputs, outputs, function = ops.APPEND_INPUTS, ops.APPEND_OUTPUTS, ops.append_function(layout, opset)
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


def _version() -> str:
    from pnmix import __version__

    return __version__


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
