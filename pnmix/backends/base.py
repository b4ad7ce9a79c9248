"""The one interface every backend implements, and the adapter for cache-op backends.

The verification harness (pnmix.protocol) drives a ``Backend`` and never knows which one:

* ``step(tokens, seq_len, write)``: the model step over tokens [B, n].
  write=True (prefill or decode): the tokens sit at positions seq_len..seq_len+n-1; attention of
  their queries over the cache plus these tokens' own fp16 K/V (causal), then their K/V are
  appended (the first append computes the pair mask). write=False (evaluation): the tokens are
  the LAST n positions already in the cache; attention only. Returns fp32 [B, Hq, n, D].
* ``state()``: the packed state tensors (STATE_NAMES, codes as uint8) and seq_len.

Backends that run the whole model (ONNX Runtime, TensorRT) implement ``Backend`` directly;
backends that provide the two cache ops (torch reference, C++ core, Triton) supply a
``CacheOps`` and get the model from ``OpsBackend``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, Tuple

import torch

from ..cache import CacheOps, PackedKVCache
from ..config import PnMixConfig
from ..format import CacheLayout
from ..model import KV_HEADS, HEAD_DIM, DiagnosticModel

State = Dict[str, torch.Tensor]


class Backend(ABC):
    name: str = "?"

    def __init__(self, config: PnMixConfig, seed: int, max_seq_len: int, device: str = "cpu"):
        self.config = config
        self.seed = seed
        self.max_seq_len = max_seq_len
        self.device = device
        self.saliency_computations = 0

    @abstractmethod
    def step(self, tokens: torch.Tensor, seq_len: int, write: bool) -> torch.Tensor: ...

    @abstractmethod
    def state(self) -> Tuple[CacheLayout, State, int]: ...


class OpsBackend(Backend):
    """The diagnostic model in torch, with the cache ops of one backend."""

    def __init__(self, ops: CacheOps, config: PnMixConfig, seed: int, max_seq_len: int, device: str = "cpu"):
        super().__init__(config, seed, max_seq_len, device)
        self.ops = ops
        self.name = ops.name
        self.model = DiagnosticModel(seed, config.pair_layout)
        self.tables = tuple(t.to(device) for t in self.model.token_tables())
        self.cache = PackedKVCache(config, KV_HEADS, HEAD_DIM, max_seq_len, device=device, ops=ops)

    def step(self, tokens: torch.Tensor, seq_len: int, write: bool) -> torch.Tensor:
        tokens = tokens.to(self.device)
        start = seq_len if write else seq_len - tokens.shape[1]
        qkv = self.model.qkv(tokens, start, self.tables)
        cache = self.cache
        if write:
            out = self.ops.attend(qkv.q, cache.layout, cache.state, cache.seq_len, qkv.k, qkv.v)
            cache.append(qkv.k, qkv.v)
            self.saliency_computations = cache.saliency_computations
            return out
        return self.ops.attend(qkv.q, cache.layout, cache.state, cache.seq_len, None, None)

    def state(self):
        return self.cache.layout, self.cache.state, self.cache.seq_len
