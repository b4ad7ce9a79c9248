"""The PyTorch reference as a backend: the ops every other backend is compared with.

They live with the cache (pnmix.cache.ReferenceOps), which runs them when given no other ops.
"""

from __future__ import annotations

from ..cache import ReferenceOps as TorchOps

__all__ = ["TorchOps"]
