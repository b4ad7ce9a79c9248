"""The PyTorch reference as a backend: the ops every other backend is compared with."""

from __future__ import annotations

from .. import reference
from ..cache import append_reference
from .base import CacheOps


class TorchOps(CacheOps):
    name = "torch"

    def append(self, layout, state, seq_len, k, v):
        append_reference(layout, state, seq_len, k, v)

    def attend(self, q, layout, state, seq_len, k_new, v_new):
        return reference.attend(q, layout, state, seq_len, k_new, v_new)
