"""The one exporter's tracing half: a PyTorch module that calls ``torch.ops.pnmix.attention`` /
``torch.ops.pnmix.append`` (export/torch_ops.py) goes through ``torch.onnx.export(dynamo=True)``,
its two ops become ``pnmix::PnMixAttention`` / ``pnmix::PnMixAppend`` nodes with the attributes of
export/ops.py's table, and the file gets the ops' standard-op function bodies and the ``pnmix.*``
metadata. The diagnostic model (export/exporter.py) and the Llama family (export/llm.py) are two
modules traced by the same code.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Dict, List, Optional, Sequence

from pnmix.format import CacheLayout

META_PREFIX = "pnmix."


TOKENS_DIM = "n"  # the dynamic token axis of every file's first input


def state_name(name: str, layer: Optional[int] = None, present: bool = False) -> str:
    """A state tensor's name in a file's interface (docs/OPS.md): the diagnostic file has one layer,
    ``<name>`` in and ``present_<name>`` out; the LLM file has ``past.<layer>.<name>`` in and
    ``present.<layer>.<name>`` out. name is one of pnmix.format.STATE_NAMES."""
    if layer is None:
        return f"present_{name}" if present else name
    return f"{'present' if present else 'past'}.{layer}.{name}"


def trace(module, layout: CacheLayout, state: List, input_names: Sequence[str], output_names: Sequence[str],
          opset: int):
    """One step of the module, ``module(tokens [B, n], seq_len, new_len, state)``, through
    torch.onnx.export(dynamo=True): an onnx_ir model with pn-mix nodes, n dynamic (1..capacity).

    The example step is a prefill of two groups and a token from an empty cache (``state``, zeros).
    Without onnxscript's optimizer: it took a quarter of SmolLM2's export time (measured) for
    folding that ONNX Runtime's own graph optimizations do at session start."""
    import torch

    from . import torch_ops

    prefill = min(layout.max_seq_len, 2 * layout.config.group_size + 1)
    example = (torch.zeros(layout.batch, prefill, dtype=torch.long), torch.tensor(0), torch.tensor(prefill), state)
    tokens = torch.export.Dim(TOKENS_DIM, min=1, max=layout.max_seq_len)
    dynamic_shapes = ({1: tokens}, None, None, [None] * len(state))

    # torch.onnx warns (logging) about optional packages it does not need here, such as
    # torchvision, and prints its progress on stdout; a command prints one summary line.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, example, dynamo=True, opset_version=opset, optimize=False, verbose=False,
            input_names=list(input_names), output_names=list(output_names), dynamic_shapes=dynamic_shapes,
            custom_translation_table=torch_ops.translation_table())
    if program is None:  # only without dynamo=True does torch.onnx.export return nothing
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNXProgram")
    _name_dim(program.model, input_names[0], 1, TOKENS_DIM)
    return program.model


def _name_dim(ir_model, input_name: str, axis: int, name: str) -> None:
    """The exporter names a dynamic dimension after its symbol (s27); the file's interface names it
    ``name`` (n), in every value that carries it."""
    import onnx_ir as ir

    graph = ir_model.graph
    symbol = next(v for v in graph.inputs if v.name == input_name).shape[axis]
    if not isinstance(symbol, ir.SymbolicDim) or symbol.value is None:
        return
    values = [*graph.inputs, *graph.outputs, *(v for node in graph for v in node.outputs)]
    for value in values:
        if value.shape is not None and symbol.value in [getattr(d, "value", None) for d in value.shape.dims]:
            value.shape = ir.Shape([name if getattr(d, "value", None) == symbol.value else d for d in value.shape.dims])


def finish(ir_model, layout: CacheLayout, q_heads: int, opset: int, metadata: Dict[str, str]) -> None:
    """Add the ops' function bodies and the pnmix.* metadata to a traced model (in place)."""
    import onnx_ir as ir

    from . import ops
    from .append_body import append_function
    from .attention_body import attention_function

    for proto in (attention_function(layout, q_heads, opset), append_function(layout, opset)):
        function = ir.serde.deserialize_function(proto)
        ir_model.functions[function.identifier()] = function
    ir_model.opset_imports[ops.DOMAIN] = ops.DOMAIN_VERSION
    ir_model.producer_name = "pnmix"
    ir_model.producer_version = _version()
    ir_model.ir_version = min(ir_model.ir_version, 10)  # what current ONNX Runtime releases read
    for key, value in metadata.items():
        ir_model.metadata_props[META_PREFIX + key] = value


def _version() -> str:
    from pnmix import __version__

    return __version__
