"""Reading an exported pn-mix ONNX file safely: every way it can be wrong is one PnMixError.

Checks, in order: the path is a readable non-empty file; the bytes parse as an ONNX model;
external-data locations stay inside the model's folder (no absolute paths, no ``..``); the ONNX
checker accepts it; the graph has the pn-mix interface (inputs, outputs, one node of each op with
its local function); the ops' attributes form a valid config whose state shapes are exactly the
file's state inputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError, one_line
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.io import MODEL_LIMIT, check_input_file, read_input
from pnmix.memory import check_fits
from pnmix.model import HEAD_DIM, KV_HEADS

from . import ops
from .tracing import META_PREFIX, state_name

# The diagnostic file's interface (export/exporter.py traces it, load_checked checks it).
GRAPH_INPUTS: Tuple[str, ...] = ("tokens", "seq_len", "new_len", *(state_name(name) for name in STATE_NAMES))
GRAPH_OUTPUTS: Tuple[str, ...] = ("attention", "output", *(state_name(name, present=True) for name in STATE_NAMES))


@dataclass(frozen=True)
class ModelInfo:
    """What a checked file says about itself."""

    path: Path
    config: PnMixConfig
    layout: CacheLayout  # the file's capacity and batch
    seed: int
    opset: int

    @property
    def max_seq_len(self) -> int:
        return self.layout.max_seq_len

    @property
    def batch(self) -> int:
        return self.layout.batch


def load_checked(path: str | Path) -> Tuple[onnx.ModelProto, ModelInfo]:
    path = Path(path)
    data = read_input(path, "ONNX model", MODEL_LIMIT)
    if not data:
        raise PnMixError(f"ONNX model file is empty: {path}")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise PnMixError(f"{path} is not an ONNX model (protobuf parse failed: {one_line(exc)})") from None
    if model.ir_version <= 0 or not model.opset_import or not model.HasField("graph"):
        raise PnMixError(f"{path} is not an ONNX model (no IR version, opset or graph: truncated or another format)")
    check_external_data(model, path.parent)
    try:
        external_data_helper.load_external_data_for_model(model, str(path.parent))
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, OSError, ValueError) as exc:
        raise PnMixError(f"{path} fails the ONNX checker (truncated or corrupt?): {one_line(exc)}") from None
    return model, describe(model, path)


def check_external_data(model: onnx.ModelProto, folder: Path) -> None:
    """External-data files must be regular files, named by relative paths inside the model's
    folder; every tensor is checked, sparse ones and those in attributes, subgraphs and functions
    included (ONNX's own helper skips sparse tensors, and older ONNX Runtime versions do not check)."""
    root = folder.resolve()
    files = {}
    for tensor in all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL and not len(tensor.external_data):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        where = Path(location)
        if not location or where.is_absolute() or location.startswith(("/", "\\")) or ".." in where.parts \
                or ".." in Path(location.replace("\\", "/")).parts:
            raise PnMixError(
                f"tensor '{tensor.name}' has external data at {location!r}: only relative paths "
                "inside the model's folder are allowed"
            )
        resolved = (root / where).resolve()
        if os.path.commonpath([str(root), str(resolved)]) != str(root):
            raise PnMixError(f"tensor '{tensor.name}' external data {location!r} resolves outside the model's folder")
        if not resolved.exists():
            raise PnMixError(f"tensor '{tensor.name}' external data file not found: {resolved}")
        check_input_file(resolved, f"tensor '{tensor.name}' external data")
        files[resolved] = resolved.stat().st_size
    check_fits(sum(files.values()), f"the external data of the ONNX model in {folder}", "free memory")


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto a model holds: initializers, sparse initializers (values and indices),
    node attributes (dense and sparse), in the main graph, its subgraphs and the local functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attribute in node.attribute:
        if attribute.HasField("t"):
            yield attribute.t
        yield from attribute.tensors
        sparse = list(attribute.sparse_tensors) + ([attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else [])
        for tensor in sparse:
            yield from (tensor.values, tensor.indices)
        for graph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
            yield from _graph_tensors(graph)


def describe(model: onnx.ModelProto, path: Path) -> ModelInfo:
    graph = model.graph
    names = [v.name for v in graph.input]
    if names != list(GRAPH_INPUTS):
        raise PnMixError(f"{path} is not a pnmix export: graph inputs are {names[:6]}..., expected "
                         f"tokens, seq_len, new_len and the {len(STATE_NAMES)} state tensors")
    outputs = [v.name for v in graph.output]
    if outputs != list(GRAPH_OUTPUTS):
        raise PnMixError(f"{path} is not a pnmix export: graph outputs are {outputs[:4]}...")
    nodes = {op: [n for n in graph.node if n.domain == ops.DOMAIN and n.op_type == op]
             for op in (ops.ATTENTION_OP, ops.APPEND_OP)}
    for op, found in nodes.items():
        if len(found) != 1:
            raise PnMixError(f"{path}: expected one {ops.DOMAIN}::{op} node, found {len(found)}")
    functions = {(f.domain, f.name) for f in model.functions}
    for op in nodes:
        if (ops.DOMAIN, op) not in functions:
            raise PnMixError(f"{path}: the {op} node has no local function; ONNX Runtime cannot run it without a plugin")
    config = ops.config_from_attributes(nodes[ops.ATTENTION_OP][0])
    if ops.config_from_attributes(nodes[ops.APPEND_OP][0]) != config:
        raise PnMixError(f"{path}: the {ops.ATTENTION_OP} and {ops.APPEND_OP} nodes carry different configs")
    meta = {p.key: p.value for p in model.metadata_props}
    try:
        max_seq_len = int(meta[META_PREFIX + "max_seq_len"])
        seed = int(meta.get(META_PREFIX + "seed", "42"))
    except (KeyError, ValueError):
        raise PnMixError(f"{path}: missing or bad metadata '{META_PREFIX}max_seq_len'") from None
    shapes = _input_shapes(graph)
    batch = shapes["tokens"][0]
    if not isinstance(batch, int) or batch < 1:
        raise PnMixError(f"{path}: input 'tokens' needs a fixed batch dimension, got {shapes['tokens']}")
    layout = CacheLayout(config, batch, KV_HEADS, HEAD_DIM, max_seq_len)
    for name, want in layout.state_shapes().items():
        if tuple(shapes[name]) != tuple(want):
            raise PnMixError(f"{path}: state input '{name}' has shape {list(shapes[name])}, but the file's "
                             f"config and max_seq_len {max_seq_len} give {list(want)}")
        if _input_type(graph, name) != ops.STATE_ONNX_TYPES[name]:
            raise PnMixError(f"{path}: state input '{name}' has the wrong element type")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return ModelInfo(path, config, layout, seed, opset)


def _input_shapes(graph: onnx.GraphProto) -> Dict[str, List]:
    out = {}
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        out[value.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
    return out


def _input_type(graph: onnx.GraphProto, name: str) -> int:
    return next(v.type.tensor_type.elem_type for v in graph.input if v.name == name)


def config_differences(file_config: PnMixConfig, run_config: PnMixConfig) -> List[str]:
    """Fields where the file's config (fp32 high_ratio) differs from the run's."""
    mine = file_config.to_dict()
    theirs = run_config.to_dict()
    theirs["high_ratio"] = ops.fp32_ratio(run_config)
    return [f"{k}: file {mine[k]!r}, run {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]

