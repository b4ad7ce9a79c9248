"""Left-padded batches in PnMixCache: one packed cache per row, holding that row's tokens only.

Every batched ``generate`` of a decoder-only model left-pads: row b of the prompt is ``pad_b`` pad
tokens, then its own tokens, and transformers gives the real tokens positions 0, 1, ... (the pads
position 1). The pads must not enter a group's quantization statistics, the pair saliency or the
sink, so a padded batch gets a ``RowsLayer`` per attention layer: a batch-1 ``PnMixLayer`` per row,
fed only that row's tokens, which therefore holds what the row's prompt alone would hold.

To the model the layer is one batch padded on the left: its length counts the pads
(``pad_b + tokens of row b`` is the same for every row), the dequantized path returns each row's
K/V with ``pad_b`` zero rows in front (the model's mask hides them), and the packed path
(``attn_implementation="pnmix"``) attends each row over its own packed cache, checking that the
mask hides exactly the pads and the causal future.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, List, Optional, Tuple

import torch

from ..errors import PnMixError
from ._deps import require_transformers
from .layer_step import Step, _last_step, batch_rows, check_repeats

require_transformers()
from transformers.cache_utils import CacheLayerMixin  # noqa: E402


def left_pads(positions: Any, n: int) -> Optional[List[int]]:
    """The pads of each row of a prefill's position ids [B, n] as transformers makes them for a
    left-padded batch (the pads at any position, 0 or 1 as versions differ, then the row's own
    tokens at 0, 1, ...), or None when no row is padded."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[1] != n:
        return None
    plain = torch.arange(n, device=positions.device)
    if bool((positions == plain).all()):
        return None
    pads = []
    for row in positions:
        pad = n - 1 - int(row[-1])  # the row's own tokens are positions 0 .. last: the rest are pads
        if not 0 <= pad < n or not bool((row[pad:] == plain[: n - pad]).all()):
            raise PnMixError(
                "PnMixCache: these position ids are not a left-padded batch's (pads, then 0, 1, 2, ... in "
                f"every row): {row[: min(n, 12)].tolist()}{'...' if n > 12 else ''}")
        pads.append(pad)
    return pads


class RowsLayer(CacheLayerMixin):
    """One attention layer of a left-padded batch: a PnMixLayer (batch 1) per row (module doc)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, make_row, pads: List[int], layer_idx: int):
        super().__init__()
        self.rows: List[Any] = [make_row() for _ in pads]  # PnMixLayers (pnmix/hf/cache.py)
        for row in self.rows:
            row.check_at_update = True  # every row's K/V are checked before any row appends
        self.pads = list(pads)
        self.layer_idx = layer_idx
        self.is_initialized = False
        self.pending: Optional[Step] = None

    # ---- what PnMixCache and the pnmix attention read of a layer ---------------------------
    @property
    def config(self):
        return self.rows[0].config

    @property
    def ops(self):
        return self.rows[0].ops

    @property
    def packed_attention(self) -> bool:
        return self.rows[0].packed_attention

    @packed_attention.setter
    def packed_attention(self, value: bool) -> None:
        for row in self.rows:
            row.packed_attention = value

    @property
    def record_past(self) -> bool:
        return self.rows[0].record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        for row in self.rows:
            row.record_past = value

    def activate_past_recording(self) -> None:
        self.record_past = True

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return self.record_past

    @property
    def packed(self):
        return self.rows[0].packed

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        batch, _, n, _ = key_states.shape
        if batch != len(self.rows):
            raise PnMixError(f"layer {self.layer_idx} holds a left-padded batch of {len(self.rows)} rows, "
                             f"this update has {batch}")
        given = kwargs.get("kwargs")
        forward_kwargs: dict = given if isinstance(given, dict) else {}
        positions = forward_kwargs.get("position_ids")
        length = self.get_seq_length()
        outputs = []
        for b, (row, pad) in enumerate(zip(self.rows, self.pads)):
            skip = pad if length == 0 else 0  # a prefill drops the row's pads; later steps have none
            row_kwargs = dict(forward_kwargs)
            if isinstance(positions, torch.Tensor) and positions.dim() == 2:
                row_kwargs["position_ids"] = positions[b:b + 1, skip:]
            outputs.append(row.update(key_states[b:b + 1, :, skip:], value_states[b:b + 1, :, skip:],
                                      kwargs=row_kwargs))
        self.is_initialized = True
        self.device, self.dtype = key_states.device, key_states.dtype
        pending = any(row.pending is not None for row in self.rows)
        if length == 0 or pending:
            # a prefill attends over the prompt's own K/V (the model's mask hides the pads); the
            # packed path reads each row's packed cache itself
            keys, values = key_states, value_states
        else:
            keys, values = (torch.cat([self._left_padded(out[i], b, length + n) for b, out in enumerate(outputs)])
                            for i in (0, 1))
        step = Step(self, weakref.ref(keys), length, key_states, value_states, pending)
        self.pending = step if pending else None
        _last_step.step = step
        return keys, values

    def _left_padded(self, tensor: torch.Tensor, row: int, length: int) -> torch.Tensor:
        pad = length - tensor.shape[2]
        if pad == 0:
            return tensor
        zeros = tensor.new_zeros(tensor.shape[0], tensor.shape[1], pad, tensor.shape[3])
        return torch.cat([zeros, tensor], dim=2)

    def attend_pending(self, query: torch.Tensor) -> torch.Tensor:
        """The packed path: each row's queries over its own packed cache and new tokens, then the
        rows' appends (fp32 [B, Hq, nq, D])."""
        self.pending = None
        return torch.cat([row.attend_pending(query[b:b + 1]) for b, row in enumerate(self.rows)])

    def expected_mask(self, kv: int, nq: int, device) -> torch.Tensor:
        """The mask the pnmix attention accepts: the causal future and each row's pads hidden, [B, 1, nq, kv]."""
        positions = torch.arange(kv - nq, kv, device=device).unsqueeze(-1)
        keys = torch.arange(kv, device=device)
        causal = keys.unsqueeze(0) <= positions
        pads = torch.tensor(self.pads, device=device).view(-1, 1, 1, 1)
        return causal.unsqueeze(0).unsqueeze(0) & (keys.view(1, 1, 1, -1) >= pads)

    def get_seq_length(self) -> int:
        seq = self.rows[0].get_seq_length()
        return seq + self.pads[0] if seq else 0

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.rows[0].get_max_length()

    def reset(self) -> None:
        for row in self.rows:
            row.reset()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """crop(-n) removes n tokens from every row (checked for every row first); crop(m > 0)
        keeps m tokens of the padded length."""
        if isinstance(tokens_to_remove, int) and not isinstance(tokens_to_remove, bool) and tokens_to_remove > 0:
            tokens_to_remove = min(0, tokens_to_remove - self.get_seq_length())
        for row in self.rows:  # all or nothing: each row checks it can before any changes
            if isinstance(tokens_to_remove, int) and tokens_to_remove < 0 and row.packed is not None:
                target = row.packed.seq_len + tokens_to_remove
                if target >= 0 and not row._reachable(target):
                    row.crop(tokens_to_remove)  # raises its one-line reason
        for row in self.rows:
            row.crop(tokens_to_remove)

    def offload(self):
        raise PnMixError("PnMixCache does not support offloading")

    def prefetch(self):
        raise PnMixError("PnMixCache does not support offloading")

    # ---- batch changes (beam search, num_return_sequences) -----------------------------------
    def selected(self, indices: Any, what: str) -> Tuple[List[Any], List[int]]:
        rows = batch_rows(indices, len(self.rows), what).tolist()
        return [copy.deepcopy(self.rows[r]) for r in rows], [self.pads[r] for r in rows]

    def repeated(self, repeats: Any) -> Tuple[List[Any], List[int]]:
        repeats = check_repeats(repeats, len(self.rows))
        rows = [r for r in range(len(self.rows)) for _ in range(repeats)]
        return [copy.deepcopy(self.rows[r]) for r in rows], [self.pads[r] for r in rows]

    def _install(self, state) -> None:
        self.rows, self.pads = state

    # ---- bytes and the dequantized view ----------------------------------------------------
    def bytes_by_part(self) -> dict:
        total = {"key_bytes": 0, "value_bytes": 0, "persistent_cache_bytes": 0}
        for row in self.rows:
            for name, value in row.bytes_by_part().items():
                total[name] += value
        return total

    def persistent_bytes(self) -> int:
        return self.bytes_by_part()["persistent_cache_bytes"]

    def allocated_bytes(self) -> int:
        return sum(row.allocated_bytes() for row in self.rows)

    @property
    def peak_copy_bytes(self) -> int:
        return sum(row.peak_copy_bytes for row in self.rows)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # each row initializes itself on its first update

    # layer.keys / .values: the rows' dequantized views, each left-padded with zeros (a copy)
    @property
    def keys(self) -> Optional[torch.Tensor]:
        return self._view("keys")

    @keys.setter
    def keys(self, value: Any) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> Optional[torch.Tensor]:
        return self._view("values")

    @values.setter
    def values(self, value: Any) -> None:
        self._refuse_assignment("values", value)

    def _refuse_assignment(self, name: str, value: Any) -> None:
        if value is not None or getattr(self, "rows", None):  # CacheLayerMixin.__init__ sets None
            raise PnMixError(f"PnMixCache layer {name} is a dequantized copy of the packed cache and cannot be assigned")

    def _view(self, name: str) -> Optional[torch.Tensor]:
        length = self.get_seq_length()
        if not length:
            return None
        return torch.cat([self._left_padded(getattr(row, name), b, length) for b, row in enumerate(self.rows)])
