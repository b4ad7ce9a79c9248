"""The Triton backend: pn-mix's two cache ops with Triton kernels (triton_kernels.py beside it).

append: the saliency mask and the sink/residual bookkeeping are the reference's (cheap torch
code, cache.append_reference); each new group is fitted, quantized and packed by Triton
kernels. attend: split-K attention that reads the packed codes directly.

On a GPU the kernels are compiled; on the CPU they run in Triton's interpreter, which must be
switched on with TRITON_INTERPRET=1 before triton is first imported.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Callable

import torch

from .. import reference
from ..cache import CacheOps, State, append_reference, check_queries
from ..errors import PnMixError
from ..format import CacheLayout


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels():
    """pnmix.backends.triton_kernels, imported on first use (importing triton is slow)."""
    from . import triton_kernels

    return triton_kernels


def check_device(device: torch.device | str) -> torch.device:
    """The device the Triton backend can run on here, or a one-line error saying why not."""
    device = torch.device(device)
    if not triton_available():
        raise PnMixError("the triton backend needs the triton package: pip install 'pnmix[triton]'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PnMixError("the triton backend was asked for cuda but torch sees no CUDA device")
        return device
    if device.type != "cpu":
        raise PnMixError(f"the triton backend runs on cuda or (interpreted) on cpu, not {device.type}")
    kernels = _kernels()
    if not kernels.interpreting():
        raise PnMixError(
            "the triton backend on cpu runs in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before starting (or use --device cuda)"
        )
    problem = kernels.interpreter_problem()
    if problem:
        raise PnMixError(problem)
    return device


def group_kernels() -> SimpleNamespace:
    """The Triton group quantizers, with pnmix.reference's names and signatures."""
    k = _kernels()
    return SimpleNamespace(quantize_key_groups=k.quantize_key_groups, quantize_values=k.quantize_values)


def append_triton(layout: CacheLayout, state: State, seq_len: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """cache.append_reference with the groups quantized and packed by Triton kernels."""
    append_reference(layout, state, seq_len, k, v, kernels=group_kernels())


def key_channels(layout: CacheLayout, state: State):
    """int32 [B * H, D] (bits, stream start byte) of each key channel, from the pair mask."""
    bits = reference.state_channel_bits(layout, state).to(torch.int32)
    start = layout.key_channel_offsets(bits).to(torch.int32)
    d = layout.head_dim
    return bits.reshape(-1, d).contiguous(), start.reshape(-1, d).contiguous()


def attend_triton(q, layout: CacheLayout, state: State, seq_len: int, k_new=None, v_new=None,
                  **plan_options) -> torch.Tensor:
    """The attend op with Triton kernels: fp32 [B, Hq, nq, D]."""
    check_queries(layout, seq_len, q, k_new, v_new)
    n_new = 0 if k_new is None else k_new.shape[2]
    k = _kernels()
    plan = k.AttendPlan(layout, seq_len, q.shape[1], q.shape[2], n_new, q.device, **plan_options)
    bits, start = key_channels(layout, state)
    return k.attend(plan, q, state, bits, start, k_new, v_new)


class TritonOps(CacheOps):
    name = "triton"

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = check_device(device)

    def init_args(self) -> tuple:
        return (str(self.device),)

    def append(self, layout, state, seq_len, k, v):
        append_triton(layout, state, seq_len, k, v)

    def attend(self, q, layout, state, seq_len, k_new, v_new):
        return attend_triton(q, layout, state, seq_len, k_new, v_new)


def bench_factory(layout: CacheLayout, state: State, seq_len: int, q: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running one decode attention of q over the packed cache.

    Everything that does not change between decode steps (channel bits and offsets, block
    sizes, scratch, the output) is prepared here, so the callable times the kernels alone."""
    check_device(q.device)
    check_queries(layout, seq_len, q, None, None)
    k = _kernels()
    plan = k.AttendPlan(layout, seq_len, q.shape[1], q.shape[2], 0, q.device)
    bits, start = key_channels(layout, state)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    return lambda: k.attend(plan, q, state, bits, start, out=out)
