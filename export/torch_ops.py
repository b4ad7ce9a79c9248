"""The two pn-mix ops as PyTorch custom ops, and their translation into the file's pn-mix nodes.

``torch.ops.pnmix.attention`` and ``torch.ops.pnmix.append`` are what a traced model calls: the
CPU implementation is the PyTorch reference (pnmix.reference.attend, pnmix.cache.append_reference),
the fake implementation gives the output shapes, so ``torch.export`` sees each op as one opaque
node. ``translation_table()`` turns each into ONE ``pnmix::PnMixAttention`` / ``pnmix::PnMixAppend``
node with the attributes of export/ops.py's table; the exporter (export/llm.py) then adds the
standard-op function bodies of export/ops.py (the same ones the diagnostic exporter writes), so ONNX Runtime
runs the file as is and TensorRT maps the nodes to the plugins.

Both ops are functional (append returns the present state instead of writing in place): a traced
graph, like an ONNX file, has state inputs and present-state outputs. The ops take the config as
its JSON text and the cache capacity, which fix the CacheLayout with the tensors' shapes.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

import torch

from pnmix.config import PnMixConfig
from pnmix.format import STATE_DTYPES, STATE_NAMES, CacheLayout

from . import ops

LIBRARY = "pnmix"
ATTENTION = "attention"
APPEND = "append"

_STATE_ARGS = ", ".join(f"Tensor {name}" for name in STATE_NAMES)
_SCHEMAS = {
    ATTENTION: f"(Tensor q, Tensor k_new, Tensor v_new, Tensor seq_len, Tensor new_len, {_STATE_ARGS}, "
               "str config, int max_seq_len) -> Tensor",
    APPEND: f"(Tensor k_new, Tensor v_new, Tensor seq_len, Tensor new_len, {_STATE_ARGS}, "
            f"str config, int max_seq_len) -> ({', '.join('Tensor' for _ in STATE_NAMES)})",
}


@lru_cache(maxsize=None)
def _config(config_json: str) -> PnMixConfig:
    return PnMixConfig.from_mapping(json.loads(config_json))


def config_text(config: PnMixConfig) -> str:
    """The config as the ops' string argument (sorted JSON: one spelling per config)."""
    return json.dumps(config.to_dict(), sort_keys=True)


def _layout(config_json: str, max_seq_len: int, k_new: torch.Tensor) -> CacheLayout:
    batch, kv_heads, _, head_dim = k_new.shape
    return CacheLayout(_config(config_json), int(batch), int(kv_heads), int(head_dim), int(max_seq_len))


def graph_state_dtype(name: str) -> torch.dtype:
    """A state tensor's dtype in the graph, a traced model and a runtime's buffers: the format's
    uint8 codes and mask are INT8 there (the same bytes; ONNX runtimes and TensorRT take INT8), the
    rest fp16 (pnmix.format.STATE_DTYPES)."""
    return torch.int8 if STATE_DTYPES[name] == torch.uint8 else STATE_DTYPES[name]


def graph_state_numpy_dtype(name: str):
    """graph_state_dtype as numpy's dtype (ONNX Runtime feeds)."""
    return torch.empty(0, dtype=graph_state_dtype(name)).numpy().dtype


def empty_graph_state(layout: CacheLayout) -> List[torch.Tensor]:
    """One layer's state tensors as a traced step takes them: zeros in STATE_NAMES order."""
    shapes = layout.state_shapes()
    return [torch.zeros(shapes[name], dtype=graph_state_dtype(name)) for name in STATE_NAMES]


def _reference_state(state: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The graph's state (codes and mask int8) as the reference's dict (codes uint8)."""
    return {name: t.view(STATE_DTYPES[name]) for name, t in zip(STATE_NAMES, state)}


def _attention_cpu(q, k_new, v_new, seq_len, new_len, *rest):
    from pnmix import reference

    state, (config_json, max_seq_len) = rest[:len(STATE_NAMES)], rest[len(STATE_NAMES):]
    layout = _layout(config_json, max_seq_len, k_new)
    cached = int(seq_len)
    if int(new_len) == 0:  # evaluation: the queries are the last positions already cached
        return reference.attend(q, layout, _reference_state(state), cached, None, None).float()
    return reference.attend(q, layout, _reference_state(state), cached, k_new, v_new).float()


def _append_cpu(k_new, v_new, seq_len, new_len, *rest):
    from pnmix.cache import append_reference

    state, (config_json, max_seq_len) = rest[:len(STATE_NAMES)], rest[len(STATE_NAMES):]
    layout = _layout(config_json, max_seq_len, k_new)
    present = {name: t.clone() for name, t in _reference_state(state).items()}
    n = int(new_len)
    if n:
        append_reference(layout, present, int(seq_len), k_new[:, :, :n], v_new[:, :, :n])
    return tuple(present[name].view(t.dtype) for name, t in zip(STATE_NAMES, state))


def _attention_fake(q, k_new, v_new, seq_len, new_len, *rest):
    return q.new_empty(q.shape, dtype=torch.float32)


def _append_fake(k_new, v_new, seq_len, new_len, *rest):
    return tuple(torch.empty_like(t) for t in rest[:len(STATE_NAMES)])


def _register() -> torch.library.Library:
    library = torch.library.Library(LIBRARY, "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        library.define(name + schema)
    library.impl(ATTENTION, _attention_cpu, "CPU")
    library.impl(APPEND, _append_cpu, "CPU")
    torch.library.register_fake(f"{LIBRARY}::{ATTENTION}", _attention_fake, lib=library)
    torch.library.register_fake(f"{LIBRARY}::{APPEND}", _append_fake, lib=library)
    return library


_LIBRARY = _register()  # kept: the registration lives as long as this object


def attention(q, k_new, v_new, seq_len, new_len, state: Sequence[torch.Tensor], config: str, max_seq_len: int):
    """fp32 [B, Hq, n, D]: q (fp16) over the packed state, then k_new/v_new (fp16) when new_len > 0."""
    return torch.ops.pnmix.attention(q, k_new, v_new, seq_len, new_len, *state, config, max_seq_len)


def append(k_new, v_new, seq_len, new_len, state: Sequence[torch.Tensor], config: str,
           max_seq_len: int) -> Tuple[torch.Tensor, ...]:
    """The present state: the packed state with new_len tokens of k_new/v_new appended."""
    return torch.ops.pnmix.append(k_new, v_new, seq_len, new_len, *state, config, max_seq_len)


# ---------------------------------------------------------------------------------------
# ONNX translation (torch.onnx.export(dynamo=True, custom_translation_table=...))
# ---------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _onnx_op(name: str):
    """The op as onnxscript's tracer calls it: its schema comes from export/ops.py's table."""
    from onnxscript.values import Op, Opset

    return Op(Opset(ops.DOMAIN, ops.DOMAIN_VERSION), name, ops.op_schema(name))


def _attention_onnx(q, k_new, v_new, seq_len, new_len, sink_k, sink_v, residual_k, residual_v, key_codes,
                    key_step, key_offset, value_codes, value_step, value_offset, pair_mask,
                    config: str = "", max_seq_len: int = 0):
    state = (sink_k, sink_v, residual_k, residual_v, key_codes, key_step, key_offset, value_codes,
             value_step, value_offset, pair_mask)
    return _onnx_op(ops.ATTENTION_OP)(q, k_new, v_new, seq_len, new_len, *state,
                                         **ops.node_attributes(_config(config)))


def _append_onnx(k_new, v_new, seq_len, new_len, sink_k, sink_v, residual_k, residual_v, key_codes,
                 key_step, key_offset, value_codes, value_step, value_offset, pair_mask,
                 config: str = "", max_seq_len: int = 0):
    state = (sink_k, sink_v, residual_k, residual_v, key_codes, key_step, key_offset, value_codes,
             value_step, value_offset, pair_mask)
    return _onnx_op(ops.APPEND_OP)(k_new, v_new, seq_len, new_len, *state,
                                      **ops.node_attributes(_config(config)))


def translation_table() -> dict:
    return {torch.ops.pnmix.attention.default: _attention_onnx, torch.ops.pnmix.append.default: _append_onnx}
