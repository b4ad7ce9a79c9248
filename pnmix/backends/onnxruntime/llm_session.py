"""An exported LLM file in ONNX Runtime with its packed state (``LlmSession``) and greedy decoding
over it (``greedy``), for `pnmix generate`, `pnmix verify --onnx --model` and `pnmix bench onnx --model`.

The prompt is ONE prefill call (all its tokens, new_len = n), then one call per new token; each
call's present state is fed back as the next call's past state. With the function bodies the
state is numpy arrays fed in and taken back out each call (ONNX Runtime allocates the outputs; the
CUDA execution provider is used when ONNX Runtime has it, else the CPU one). With the native ops
(libpnmix_ort, CPU) every layer's ``present.<l>.<name>`` is bound to the buffer of its
``past.<l>.<name>`` (I/O binding): the append kernel updates the state in place and nothing is
copied between calls. That relies on each layer's attention node running before its append node,
which ONNX Runtime's node order keeps (the exporter emits them in that order);
tests/backends/test_ort_native.py checks the bytes against the function bodies over many steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from pnmix.errors import PnMixError
from pnmix.format import STATE_NAMES
from pnmix.memory import check_fits

from pnmix.export.torch_ops import graph_state_numpy_dtype
from pnmix.export.llm_file import LlmFileInfo, read_llm_info
from pnmix.export.tracing import state_name

from .session import CPU_PROVIDERS, cuda_or_cpu, open_session, resolve_ops, session_options


class LlmSession:
    """One exported LLM file in ONNX Runtime, with its packed state between calls."""

    backend = "onnx-llm"  # the name verify reports
    runtime_name = "ONNX Runtime"

    def __init__(self, path: Path, threads: Optional[int] = None, info: Optional[LlmFileInfo] = None,
                 ops: Optional[str] = None):
        self.info = info or read_llm_info(path)
        check_fits(3 * self.info.layers * self.info.layout.state_bytes, f"the packed state of {Path(path).name}",
                   "export with a smaller --max-seq-len")  # ours, the feeds and the present outputs
        self.ops = resolve_ops(ops)  # native kernels (libpnmix_ort) or the function bodies
        providers = list(CPU_PROVIDERS) if self.ops == "native" else cuda_or_cpu()  # the library is CPU only
        self.session = open_session(path, session_options(threads, ops=self.ops), providers)
        self.provider = self.session.get_providers()[0]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.in_place = self.ops == "native"
        self.reset()

    def reset(self) -> None:
        shapes = self.info.layout.state_shapes()
        self.state: Dict[str, np.ndarray] = {
            state_name(name, i): np.zeros(shapes[name], dtype=graph_state_numpy_dtype(name))
            for i in range(self.info.layers) for name in STATE_NAMES}
        self.seq_len = 0
        if self.in_place:
            self._bind_state()

    def _bind_state(self) -> None:
        """One I/O binding for the session: each layer's past and present state on one buffer (the
        numpy arrays of self.state, which therefore always hold the state after the last call)."""
        from .session import import_onnxruntime

        ort = import_onnxruntime()
        self.binding = self.session.io_binding()
        self._bound = []
        for i in range(self.info.layers):
            for name in STATE_NAMES:
                value = ort.OrtValue.ortvalue_from_numpy(self.state[state_name(name, i)])
                self._bound.append(value)  # ONNX Runtime borrows the buffer: keep the OrtValue alive
                self.binding.bind_ortvalue_input(state_name(name, i), value)
                self.binding.bind_ortvalue_output(state_name(name, i, present=True), value)
        self.binding.bind_output("logits")

    def _run_in_place(self, feeds: Dict[str, np.ndarray]) -> np.ndarray:
        for name, array in feeds.items():
            self.binding.bind_cpu_input(name, array)
        self.session.run_with_iobinding(self.binding)
        # the binding's outputs in the order they were bound: the states, then logits
        # (a copy: ONNX Runtime may write the next call's logits into the same buffer)
        return self.binding.get_outputs()[len(self._bound)].numpy().copy()

    def step(self, ids: List[int]) -> np.ndarray:
        """Append the tokens ids (prefill: the prompt; decode: one token); fp32 logits [vocab] of the last."""
        n = len(ids)
        self.info.check_room(self.seq_len, n)
        scalars = {"input_ids": np.asarray([ids], dtype=np.int64), "seq_len": np.array(self.seq_len, dtype=np.int64),
                   "new_len": np.array(n, dtype=np.int64)}
        if self.in_place:
            logits = self._run_in_place(scalars)
            self.seq_len += n
            return logits[0, -1]
        values = dict(zip(self.output_names, self.session.run(None, {**scalars, **self.state})))
        for i in range(self.info.layers):
            for name in STATE_NAMES:
                self.state[state_name(name, i)] = values[state_name(name, i, present=True)]
        self.seq_len += n
        return values["logits"][0, -1]

    def layer_state(self, layer: int) -> Dict[str, np.ndarray]:
        return {name: self.state[state_name(name, layer)] for name in STATE_NAMES}

    def cache_bytes(self) -> Dict[str, int]:
        """Used bytes of the packed state over all layers (docs/METHOD.md section 3.5), and as allocated."""
        import torch

        from pnmix.format import STATE_DTYPES

        layout = self.info.layout
        used = 0
        for layer in range(self.info.layers):
            tensors = {name: torch.from_numpy(a).view(STATE_DTYPES[name]) for name, a in self.layer_state(layer).items()}
            used += layout.persistent_bytes(self.seq_len, tensors)["persistent_cache_bytes"]
        allocated = sum(a.nbytes for a in self.state.values())
        return {"persistent_cache_bytes": used, "allocated_bytes": allocated}


@dataclass
class Generation:
    prompt_ids: List[int]
    new_ids: List[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    first_logits: Optional[np.ndarray] = None


def greedy(session: LlmSession, prompt_ids: List[int], max_new_tokens: int, eos: Optional[int] = None,
           on_step=None) -> Generation:
    """Greedy decoding: one prefill call, then one call per token (stops at eos)."""
    if not prompt_ids:
        raise PnMixError("the prompt has no tokens")
    # the last new token is returned, never appended: the cache holds the prompt and the others
    session.info.check_room(len(prompt_ids), max_new_tokens - 1,
                            f"the prompt and --max-new-tokens {max_new_tokens}")
    result = Generation(list(prompt_ids))
    began = time.perf_counter()
    logits = session.step(list(prompt_ids))
    result.prefill_seconds = time.perf_counter() - began
    result.first_logits = logits
    if on_step:
        on_step(session, logits)
    began = time.perf_counter()
    for index in range(max_new_tokens):
        token = int(np.argmax(logits))
        result.new_ids.append(token)
        if token == eos or index == max_new_tokens - 1:
            break
        logits = session.step([token])
        if on_step:
            on_step(session, logits)
    result.decode_seconds = time.perf_counter() - began
    return result
