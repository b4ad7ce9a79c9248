"""The CUDA kernels (libpnmix_cuda, plugins/cuda) on torch CUDA tensors, through ctypes.

The state dict's tensors are the device buffers of the C ABI (plugins/include/pnmix/
pnmix_cuda.h): the kernels write them in place, on torch's current stream, so they order with
the surrounding torch work and can be captured in a CUDA graph. Checks happen twice: here
(device, dtype, contiguity; one-line PnMixError) and in the library (every size and pointer).

* ``CudaOps``: the two cache ops (append with in-place flush, fused split-K attention);
* ``bench_factory(layout, state, seq_len, q)``: a zero-argument callable running one decode
  attention step, for ``pnmix bench decode``;
* ``library_status()``: (available, path or reason), for ``pnmix doctor`` and test skips.

The attention kernel runs the groups on the tensor cores where the shapes allow (see
plugins/cuda/README.md); ``PNMIX_CUDA_SIMT=1`` in the environment forces the SIMT path.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Dict, Optional, Tuple

import torch

from .._native import NativeLibraryError
from ..cache import CacheOps, check_new_kv, check_queries
from ..errors import PnMixError
from ..format import CacheLayout
from . import native
from .native import INT as _INT, I64 as _I64, PTR as _PTR, CState, c_layout, nbytes as _nbytes, ptr as _ptr

LIBRARY = "pnmix_cuda"
ABI_VERSION = 1
# Query dtypes of pnmix_cuda_attend (PNMIX_DTYPE_*); keys and values are always fp16.
QUERY_DTYPES = {torch.float16: 0, torch.bfloat16: 1}

State = Dict[str, torch.Tensor]

_SIGNATURES: native.Signatures = {
    "pnmix_cuda_abi_version": ([], _INT),
    "pnmix_cuda_last_error": ([], ctypes.c_char_p),
    "pnmix_cuda_append_workspace_bytes": ([_PTR, _I64, _I64, _PTR], _INT),
    "pnmix_cuda_append": ([_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR], _INT),
    "pnmix_cuda_attend_workspace_bytes": ([_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR], _INT),
    "pnmix_cuda_attend": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64,
                           _PTR, _I64, _PTR], _INT),
    "pnmix_cuda_attend_bytes_read": ([_PTR, _I64, _I64, _I64, _I64, _INT, _PTR], _INT),
}
__all__ = ["CState", "CudaOps", "bench_factory", "bytes_read", "c_layout", "cuda_library", "library_status"]


def cuda_library() -> ctypes.CDLL:
    """libpnmix_cuda with its prototypes set; NativeLibraryError when it is not built."""
    return native.bind_library(LIBRARY, _SIGNATURES, "pnmix_cuda_abi_version", ABI_VERSION)


def library_status() -> Tuple[bool, str]:
    """(True, path) when libpnmix_cuda loads, else (False, the reason)."""
    try:
        lib = cuda_library()
    except (NativeLibraryError, PnMixError, AttributeError) as exc:
        return False, str(exc)
    return True, str(getattr(lib, "_name", LIBRARY))


def check(lib: ctypes.CDLL, status: int) -> None:
    native.check_status(status, "pnmix cuda", lib.pnmix_cuda_last_error)


# ---------------------------------------------------------------------------------------
# Tensors as C buffers
# ---------------------------------------------------------------------------------------


def _device_of(state: State) -> torch.device:
    device = state["sink_k"].device if "sink_k" in state else None
    if device is None or device.type != "cuda":
        raise PnMixError(f"the cuda backend needs the cache state on a CUDA device, got {device}")
    return device


def c_state(state: State, device: torch.device) -> CState:
    """The state tensors as device buffers: on `device`, contiguous, of the format's dtype."""
    def elsewhere(name: str, t: torch.Tensor):
        return None if t.device == device else f"state tensor '{name}' is on {t.device}, the cache is on {device}"

    return native.c_state(state, elsewhere)


def _on(t: torch.Tensor, device: torch.device, dtype: torch.dtype, what: str) -> torch.Tensor:
    if t.device != device:
        raise PnMixError(f"{what} is on {t.device}, the cache is on {device}")
    return t.to(dtype).contiguous()


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# ---------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------


class _AttendCall:
    """One attention call with every C argument built once: __call__ only launches."""

    graphed = False  # replayed from a CUDA graph (attend_graphed's callables say whether they are)

    def __init__(self, lib, layout: CacheLayout, state: State, seq_len: int, q: torch.Tensor,
                 k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor]):
        self.device = _device_of(state)
        if q.dtype not in QUERY_DTYPES:
            q = q.to(torch.float16)
        self.q = _on(q, self.device, q.dtype, "q")
        n_new = 0
        if k_new is not None and v_new is not None and k_new.shape[2]:  # both or neither (check_queries)
            k_new = _on(k_new, self.device, torch.float16, "k_new")
            v_new = _on(v_new, self.device, torch.float16, "v_new")
            n_new = k_new.shape[2]
        else:
            k_new = v_new = None
        self.k_new, self.v_new, self.state = k_new, v_new, state  # keep the buffers alive
        batch, q_heads, nq, head_dim = self.q.shape
        self.lib = lib
        self.layout, self.cstate = c_layout(layout), c_state(state, self.device)
        size, splits = ctypes.c_int64(0), ctypes.c_int64(0)
        with torch.cuda.device(self.device):
            check(lib, lib.pnmix_cuda_attend_workspace_bytes(ctypes.byref(self.layout), seq_len, q_heads, nq, n_new,
                                                             ctypes.byref(size), ctypes.byref(splits)))
        self.splits = splits.value
        self.workspace = torch.empty(max(size.value, 1), dtype=torch.uint8, device=self.device)
        self.out = torch.empty(batch, q_heads, nq, head_dim, dtype=torch.float32, device=self.device)
        self.args = (ctypes.byref(self.layout), ctypes.byref(self.cstate), seq_len, _ptr(self.q),
                     QUERY_DTYPES[self.q.dtype], q_heads, nq, _nbytes(self.q), _ptr(k_new), _ptr(v_new), n_new,
                     _nbytes(k_new), _ptr(self.out), _nbytes(self.out), _ptr(self.workspace), size.value)

    def __call__(self) -> torch.Tensor:
        with torch.cuda.device(self.device):
            check(self.lib, self.lib.pnmix_cuda_attend(*self.args, _stream(self.device)))
        return self.out


class CudaOps(CacheOps):
    """append / attend through libpnmix_cuda on CUDA tensors (torch's current stream)."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda"):
        if not torch.cuda.is_available():
            raise PnMixError("the cuda backend needs a CUDA device, and torch sees none")
        self.device = torch.device(device)
        self.lib = cuda_library()

    def init_args(self) -> tuple:
        return (str(self.device),)

    def append(self, layout: CacheLayout, state: State, seq_len: int, k: torch.Tensor, v: torch.Tensor) -> None:
        check_new_kv(layout, k, v)
        device = _device_of(state)
        k, v = _on(k, device, torch.float16, "keys"), _on(v, device, torch.float16, "values")
        n = k.shape[2]
        lay, st = c_layout(layout), c_state(state, device)
        size = ctypes.c_int64(0)
        with torch.cuda.device(device):
            check(self.lib, self.lib.pnmix_cuda_append_workspace_bytes(ctypes.byref(lay), seq_len, n,
                                                                       ctypes.byref(size)))
            workspace = torch.empty(max(size.value, 1), dtype=torch.uint8, device=device)
            check(self.lib, self.lib.pnmix_cuda_append(
                ctypes.byref(lay), ctypes.byref(st), seq_len, _ptr(k), _ptr(v), n, _nbytes(k),
                _ptr(workspace), size.value, _stream(device)))

    def attend(self, q, layout: CacheLayout, state: State, seq_len: int, k_new=None, v_new=None) -> torch.Tensor:
        check_queries(layout, seq_len, q, k_new, v_new)
        return _AttendCall(self.lib, layout, state, seq_len, q, k_new, v_new)()


def bytes_read(layout: CacheLayout, seq_len: int, q_heads: int, nq: int = 1, n_new: int = 0) -> int:
    """Bytes one attention call reads: the cache's used parts, the queries, the new K/V."""
    lib = cuda_library()
    lay, out = c_layout(layout), ctypes.c_int64(0)
    check(lib, lib.pnmix_cuda_attend_bytes_read(ctypes.byref(lay), seq_len, q_heads, nq, n_new, 0, ctypes.byref(out)))
    return out.value


def bench_factory(layout: CacheLayout, state: State, seq_len: int, q: torch.Tensor,
                  graph: bool = True) -> Callable[[], torch.Tensor]:
    """A zero-argument callable: one decode-attention step of q [B, Hq, nq, D] (fp16 or bf16)
    over the cache, returning the fp32 output. With graph=True the launch is captured in a CUDA
    graph when that works (the callable's ``graphed`` attribute says whether it did), so short
    contexts measure the GPU rather than the Python call."""
    check_queries(layout, seq_len, q, None, None)
    call = _AttendCall(cuda_library(), layout, state, seq_len, q, None, None)
    call()  # validates everything once, and warms up
    torch.cuda.synchronize(call.device)
    if graph:
        replay = _graphed(call)
        if replay is not None:
            return replay
    return call


def _graphed(call: _AttendCall) -> Optional[Callable[[], torch.Tensor]]:
    """call captured in a CUDA graph and checked against a direct run, or None."""
    expected = call().clone()
    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(call.device)
        side.wait_stream(torch.cuda.current_stream(call.device))
        with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
            call()
        g.replay()
        torch.cuda.synchronize(call.device)
    except (RuntimeError, PnMixError):
        return None
    if not torch.equal(call.out, expected):
        return None

    def replay() -> torch.Tensor:
        g.replay()
        return call.out

    replay.graphed = True  # type: ignore[attr-defined]
    replay.graph = g  # type: ignore[attr-defined]  # keeps the graph alive as long as the callable
    return replay
