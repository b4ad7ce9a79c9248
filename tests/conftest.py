"""Shared fixtures: small configs and random fp16 K/V."""

import os

import pytest
import torch

from pnmix.config import PnMixConfig

# Without a GPU, Triton runs in its CPU interpreter, which must be chosen before triton is first
# imported (some test modules import it through transformers): choose it for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pnmix.testing import OTHER_CONFIG  # a configuration far from the manifest's


@pytest.fixture
def other_config() -> PnMixConfig:
    return PnMixConfig(**OTHER_CONFIG)


def make_random_kv(batch, heads, n, dim, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(batch, heads, n, dim, generator=g) * scale).half()
    v = (torch.randn(batch, heads, n, dim, generator=g) * scale).half()
    return k, v


@pytest.fixture
def random_kv():
    """random_kv(batch, heads, n, dim, seed=0, scale=1.0) -> fp16 (k, v)."""
    return make_random_kv
