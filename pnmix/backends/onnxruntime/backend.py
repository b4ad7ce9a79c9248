"""The exported ONNX file as a backend: the whole model step through ONNX Runtime on CPU.

The file is checked first (pnmix.export.modelfile): its ops' config must be the run's, its
capacity must hold the protocol. The state lives here as numpy arrays (codes and mask int8)
and is fed back each step, as a runtime keeps it on device. The file's weights are those of
its export seed; for another protocol seed the backend substitutes that seed's diagnostic
weights through SessionOptions.add_initializer (same names, shapes and dtypes), so every seed
runs the file's graph.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from pnmix.cache import check_room
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError, one_line
from pnmix.format import STATE_DTYPES, STATE_NAMES, CacheLayout, checked_state
from pnmix.memory import check_fits
from pnmix.model import VOCAB
from pnmix.export.torch_ops import graph_state_numpy_dtype
from pnmix.export.tracing import state_name
from pnmix.backends.base import Backend

from .session import import_onnxruntime, open_session, resolve_ops, run_options, session_options


def session_bytes(layout: CacheLayout) -> int:
    """Host bytes a session over this layout needs besides its weights: the state we keep, the
    feeds and the present_* outputs (three copies), and the graph's dequantized fp32 K and V."""
    dequantized = 2 * 4 * layout.batch * layout.kv_heads * layout.head_dim * layout.max_seq_len
    return 3 * layout.state_bytes + dequantized


def make_session(path, seed: Optional[int] = None, file_seed: Optional[int] = None, threads: Optional[int] = None,
                 ops: str = "functions"):
    """An ONNX Runtime CPU session; with seed != file_seed, that seed's weights replace the file's;
    ops: which implementation of the pn-mix ops runs (session.resolve_ops)."""
    ort = import_onnxruntime()
    from pnmix.export.exporter import seed_weights

    options = session_options(threads, ops=ops)
    keep = []
    if seed is not None and seed != file_seed:
        for name, array in seed_weights(seed).items():
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
            keep.append(value)  # ONNX Runtime borrows the buffer: it must outlive the session
            options.add_initializer(name, value)
    session = open_session(path, options)
    session._pnmix_keep = keep  # the initializers' buffers live as long as the session
    return session


class OnnxBackend(Backend):
    name = "onnx"

    def __init__(self, config: PnMixConfig, seed: int, max_seq_len: int, device: str = "cpu",
                 model=None, threads: Optional[int] = None, ops: Optional[str] = None):
        super().__init__(config, seed, max_seq_len, device)
        from pnmix.export.modelfile import config_differences, load_checked

        if model is None:
            raise PnMixError("the onnx backend needs an exported file: --onnx MODEL")
        if device != "cpu":
            raise PnMixError(f"the onnx backend runs ONNX Runtime on CPU; got --device {device}")
        _, info = load_checked(model)
        differ = config_differences(info.config, config)
        if differ:
            raise PnMixError(f"{info.path} was exported for another config ({'; '.join(differ)}); "
                             "export it with the same --config")
        check_room(0, max_seq_len, info.max_seq_len, f" of {info.path} (export --max-seq-len): the protocol's tokens")
        if info.batch != 1:
            raise PnMixError(f"{info.path} has batch {info.batch}; the protocol runs batch 1 (export --batch 1)")
        self.info = info
        self.layout: CacheLayout = info.layout
        # The file states its capacity: a small file can ask for terabytes of state.
        check_fits(session_bytes(self.layout), f"{info.path}'s cache ({self.layout.describe()}) in ONNX Runtime",
                   "export the model with a smaller --max-seq-len or --batch")
        self.ops = resolve_ops(ops)
        self.session = make_session(info.path, seed, info.seed, threads, self.ops)
        self._run_options = run_options()
        self._output_names = [o.name for o in self.session.get_outputs()]
        self._state = {name: np.zeros(shape, dtype=graph_state_numpy_dtype(name))
                       for name, shape in self.layout.state_shapes().items()}
        self.seq_len = 0

    # ---- the Backend interface --------------------------------------------------------------
    def step(self, tokens: torch.Tensor, seq_len: int, write: bool) -> torch.Tensor:
        n = self._check_tokens(tokens)
        if seq_len != self.seq_len:
            raise PnMixError(f"step at seq_len {seq_len}, but the cache holds {self.seq_len} tokens")
        if write:
            check_room(seq_len, n, self.layout.max_seq_len)
        if not write and n > seq_len:
            raise PnMixError(f"evaluation of {n} tokens, but the cache holds only {seq_len}")
        outputs = self.run(tokens, seq_len, n if write else 0, self._state)
        if write:
            self._state = {name: outputs[state_name(name, present=True)] for name in STATE_NAMES}
            self.seq_len = seq_len + n
            if seq_len == 0:
                self.saliency_computations += 1  # the graph computes the mask on the first append
        return torch.from_numpy(outputs["attention"])

    def state(self) -> Tuple[CacheLayout, Dict[str, torch.Tensor], int]:
        tensors = {name: torch.from_numpy(array.copy()).view(STATE_DTYPES[name])
                   for name, array in self._state.items()}
        return self.layout, tensors, self.seq_len

    # ---- direct use -------------------------------------------------------------------------
    def run(self, tokens, seq_len: int, new_len: int, state: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """One graph call with checked feeds; returns every output by name."""
        feeds = {
            "tokens": np.ascontiguousarray(np.asarray(tokens, dtype=np.int64)),
            "seq_len": np.array(seq_len, dtype=np.int64),
            "new_len": np.array(new_len, dtype=np.int64),
        }
        arrays = {name: np.asarray(state[name]) for name in STATE_NAMES if state.get(name) is not None}
        self.layout.check_state_shapes(arrays)
        for name in STATE_NAMES:
            feeds[state_name(name)] = np.ascontiguousarray(arrays[name]).view(graph_state_numpy_dtype(name))
        try:
            values = self.session.run(None, feeds, self._run_options)
        except Exception as exc:  # ONNX Runtime's own exception types (a failed allocation, a bad kernel)
            raise PnMixError(f"ONNX Runtime failed running {self.info.path}: {one_line(exc)}") from None
        return dict(zip(self._output_names, values))

    def load_state(self, tensors: Dict[str, torch.Tensor], seq_len: int) -> None:
        """Start from a given packed state (uint8 or int8 codes) holding seq_len tokens, checked
        as PackedKVCache.import_state checks it (format.checked_state)."""
        checked, seq_len = checked_state(self.layout, tensors, seq_len, "loaded cache state")
        self._state = {name: t.cpu().contiguous().numpy().view(graph_state_numpy_dtype(name)).copy()
                       for name, t in checked.items()}
        self.seq_len = seq_len

    def _check_tokens(self, tokens: torch.Tensor) -> int:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise PnMixError(f"tokens must be a 2-D tensor [batch, n], got {getattr(tokens, 'shape', type(tokens))}")
        if tokens.shape[0] != self.layout.batch or tokens.shape[1] < 1:
            raise PnMixError(f"tokens have shape {list(tokens.shape)}, the model takes [{self.layout.batch}, n >= 1]")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise PnMixError(f"tokens must be integers, got {tokens.dtype}")
        if tokens.min().item() < 0 or tokens.max().item() >= VOCAB:
            raise PnMixError(f"tokens must be bytes 0..{VOCAB - 1}")
        return int(tokens.shape[1])

