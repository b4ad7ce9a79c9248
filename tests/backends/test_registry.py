"""The one registry of cache ops (pnmix.backends): default_ops's policy, and that only "not
available here" (a PnMixError) lets it fall back; any other exception is a bug and surfaces."""

import pytest
import torch

from pnmix import backends
from pnmix.cache import PackedKVCache, ReferenceOps
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.testing import make_random_kv


def test_default_on_cpu_is_the_core_when_it_builds(monkeypatch):
    made = []

    def make_ops(name, device="cpu"):
        made.append(name)
        return ReferenceOps() if name == "torch" else object()

    monkeypatch.setattr(backends, "make_ops", make_ops)
    assert not isinstance(backends.default_ops("cpu"), ReferenceOps) and made == ["core"]


def test_an_unavailable_backend_falls_back_to_the_reference(monkeypatch):
    real = backends.make_ops

    def make_ops(name, device="cpu"):
        if name != "torch":
            raise PnMixError(f"{name} is not built here")
        return real(name, device)

    monkeypatch.setattr(backends, "make_ops", make_ops)
    assert isinstance(backends.default_ops("cpu"), ReferenceOps)
    assert isinstance(backends.default_ops("cuda"), ReferenceOps)


def test_a_bug_in_a_backend_is_not_swallowed(monkeypatch):
    def make_ops(name, device="cpu"):
        raise RuntimeError("a bug, not a missing backend")

    monkeypatch.setattr(backends, "make_ops", make_ops)
    with pytest.raises(RuntimeError, match="a bug"):
        backends.default_ops("cpu")


def test_the_cache_runs_the_ops_it_is_given():
    calls = []

    class Counting(ReferenceOps):
        def append(self, *args):
            calls.append("append")
            super().append(*args)

        def attend(self, *args):
            calls.append("attend")
            return super().attend(*args)

    cache = PackedKVCache(PnMixConfig(group_size=8, residual_size=8, sink_tokens=2), 1, 8, 32, ops=Counting())
    cache.append(*make_random_kv(1, 1, 12, 8))
    cache.attend(torch.randn(1, 2, 1, 8).half())
    assert calls == ["append", "attend"]
    assert isinstance(PackedKVCache(PnMixConfig(), 1, 8, 32).ops, ReferenceOps)  # no ops given: the reference
