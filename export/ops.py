"""The contract of the two pn-mix custom ops: names, domain, inputs and outputs, attributes.

``PnMixAttention`` (attention of q over the packed cache plus new fp16 K/V) runs BEFORE
``PnMixAppend`` (quantize/append the new K/V into the packed state, with flush and the pair
mask on the first append). Both live in domain ``pnmix``; TensorRT maps them to plugins of the
same names, ONNX Runtime inlines the local functions shipped in the file (their bodies:
export/attention_body.py and export/append_body.py, written with export/graph.py's builder).

The attributes are the config fields of ``pnmix.config.CONFIG_FIELDS`` under their own names
plus ``plugin_version`` and ``plugin_namespace``: ``op_attributes()`` is the one table.
``export/pnmix_ops.json`` is its generated copy for readers outside Python (``python3 -m
pnmix.export.ops --write``; a test keeps it current, and tests/backends/test_trt_fields.py checks it
against the plugins' own field list). The plugins compile the names, version and input positions
from plugins/include/pnmix/generated.h (pnmix/codegen.py writes it from this module).

A body is generated for the config written in the node's attributes (shapes such as the group
size are part of the body); the exporter writes both from the same config (``function_proto``
declares the attributes on every body).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from pnmix.config import CONFIG_FIELDS, PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import STATE_DTYPES, STATE_NAMES

DOMAIN = "pnmix"
DOMAIN_VERSION = 1
ATTENTION_OP = "PnMixAttention"
APPEND_OP = "PnMixAppend"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""
TABLE_JSON = Path(__file__).with_name("pnmix_ops.json")

# The ONNX (and TensorRT) type of each state tensor: format.STATE_DTYPES, with the uint8 codes and
# mask carried as INT8 bytes.
_ONNX_OF_DTYPE = {torch.float16: TensorProto.FLOAT16, torch.uint8: TensorProto.INT8}
STATE_ONNX_TYPES: Dict[str, int] = {name: _ONNX_OF_DTYPE[STATE_DTYPES[name]] for name in STATE_NAMES}
# The state tensors with a group-slot axis: what a group flush writes.
GROUP_STATE = ("key_codes", "key_step", "key_offset", "value_codes", "value_step", "value_offset")
LENGTH_INPUTS = ("seq_len", "new_len")
ATTENTION_INPUTS = ("q", "k_new", "v_new") + LENGTH_INPUTS + STATE_NAMES
ATTENTION_OUTPUTS = ("attention",)
APPEND_INPUTS = ("k_new", "v_new") + LENGTH_INPUTS + STATE_NAMES
APPEND_OUTPUTS = tuple(f"present_{name}" for name in STATE_NAMES)

_ATTR_KIND = {float: ("float", onnx.AttributeProto.FLOAT), int: ("int", onnx.AttributeProto.INT),
              str: ("string", onnx.AttributeProto.STRING)}


# ---------------------------------------------------------------------------------------
# The attribute table (one place; the plugins read the generated JSON)
# ---------------------------------------------------------------------------------------


def op_attributes() -> List[Dict[str, str]]:
    """[{name, type, config_field}] for every attribute of both ops, in a fixed order."""
    defaults = PnMixConfig()
    rows = []
    for field in CONFIG_FIELDS:
        kind = _ATTR_KIND[type(getattr(defaults, field))][0]
        rows.append({"name": field, "type": kind, "config_field": field})
    rows.append({"name": "plugin_version", "type": "string", "config_field": ""})
    rows.append({"name": "plugin_namespace", "type": "string", "config_field": ""})
    return rows


def op_table() -> Dict[str, Any]:
    """The whole contract the TensorRT plugins share with the exporter (pnmix_ops.json)."""
    return {
        "domain": DOMAIN,
        "domain_version": DOMAIN_VERSION,
        "plugin_version": PLUGIN_VERSION,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "attributes": op_attributes(),
        "ops": {
            ATTENTION_OP: {"inputs": list(ATTENTION_INPUTS), "outputs": list(ATTENTION_OUTPUTS)},
            APPEND_OP: {"inputs": list(APPEND_INPUTS), "outputs": list(APPEND_OUTPUTS)},
        },
        "state_types": {name: onnx.helper.tensor_dtype_to_string(t).replace("TensorProto.", "")
                        for name, t in STATE_ONNX_TYPES.items()},
    }


def fp32_ratio(config: PnMixConfig) -> float:
    """high_ratio as the FLOAT attribute carries it; the exporter refuses a config whose n_high
    would change through that rounding (a plugin computes n_high from the attribute)."""
    return float(np.float32(config.high_ratio))


def node_attributes(config: PnMixConfig) -> Dict[str, Any]:
    values: Dict[str, Any] = {}
    for row in op_attributes():
        name = row["name"]
        if name == "plugin_version":
            values[name] = PLUGIN_VERSION
        elif name == "plugin_namespace":
            values[name] = PLUGIN_NAMESPACE
        elif name == "high_ratio":
            values[name] = fp32_ratio(config)
        else:
            values[name] = getattr(config, name)
    return values


def walk_nodes(graph: onnx.GraphProto):
    """Every node of a graph and of the subgraphs its nodes hold (If branches, Loop and Scan
    bodies), depth first: an LLM file keeps each layer's PnMixAttention in an If branch."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from walk_nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from walk_nodes(subgraph)


def pnmix_nodes(graph: onnx.GraphProto, op_type: str) -> List[onnx.NodeProto]:
    """The graph's pn-mix nodes of one op type, subgraphs included."""
    return [n for n in walk_nodes(graph) if n.domain == DOMAIN and n.op_type == op_type]


def config_from_attributes(node: onnx.NodeProto) -> PnMixConfig:
    """The PnMixConfig a pn-mix node's attributes describe (errors name the attribute)."""
    given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    fields = {}
    for row in op_attributes():
        name = row["name"]
        if name not in given:
            raise PnMixError(f"ONNX node {node.op_type} has no attribute '{name}'")
        value = given[name]
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if row["config_field"]:
            fields[name] = value
        elif name == "plugin_version" and value != PLUGIN_VERSION:
            raise PnMixError(f"ONNX node {node.op_type} has plugin_version {value!r}, this pnmix reads {PLUGIN_VERSION!r}")
    return PnMixConfig.from_mapping(fields)


def _onnx_type(name: str) -> str:
    if name in STATE_ONNX_TYPES:
        return f"tensor({helper.tensor_dtype_to_np_dtype(STATE_ONNX_TYPES[name]).name})"
    if name.startswith("present_"):
        return _onnx_type(name[len("present_"):])
    if name in LENGTH_INPUTS:
        return "tensor(int64)"
    return "tensor(float)" if name == "attention" else "tensor(float16)"


def op_schema(op: str) -> "onnx.defs.OpSchema":
    """An OpSchema of one op from the table (not registered with onnx: the file's local function
    defines the op; this is what a graph builder such as onnxscript's tracer needs to emit a node)."""
    from onnx.defs import OpSchema

    spec = op_table()["ops"][op]
    kinds = {"float": OpSchema.AttrType.FLOAT, "int": OpSchema.AttrType.INT, "string": OpSchema.AttrType.STRING}
    return OpSchema(
        op, DOMAIN, DOMAIN_VERSION,
        inputs=[OpSchema.FormalParameter(name, _onnx_type(name)) for name in spec["inputs"]],
        outputs=[OpSchema.FormalParameter(name, _onnx_type(name)) for name in spec["outputs"]],
        attributes=[OpSchema.Attribute(row["name"], kinds[row["type"]], required=True) for row in op_attributes()],
    )


def function_proto(name: str, inputs: Sequence[str], outputs: Sequence[str], nodes: Sequence[onnx.NodeProto],
                   opset: int) -> onnx.FunctionProto:
    """One op's local function in the pnmix domain. Attributes are declared so the nodes may carry
    them; the body is generated for their values (the exporter writes both from one config)."""
    return helper.make_function(
        DOMAIN, name, list(inputs), list(outputs), list(nodes),
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[row["name"] for row in op_attributes()],
    )


def write_table(path: Path = TABLE_JSON) -> Path:
    from pnmix.io import write_json_atomic

    return write_json_atomic(path, op_table())


if __name__ == "__main__":  # python3 -m pnmix.export.ops --write
    if "--write" in sys.argv[1:]:
        print(write_table())
    else:
        print(json.dumps(op_table(), indent=2))
