"""Shared fixtures: small configs and random fp16 K/V."""

import os

import pytest
import torch

from pnmix.config import PnMixConfig

# Without a GPU, Triton runs in its CPU interpreter, which must be chosen before triton is first
# imported (some test modules import it through transformers): choose it for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A configuration far from the manifest's: other pair layout, bit widths, sizes.
OTHER_CONFIG = dict(pair_layout="half", key_high_bits=4, key_low_bits=2, value_bits=4,
                    group_size=64, residual_size=96, sink_tokens=8, high_ratio=0.25)


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
