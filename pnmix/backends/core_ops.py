"""The C++ core (libpnmix_core) as a cache-ops backend: append and attention on CPU tensors.

The state dict's tensors are the caller-owned buffers of the C ABI (plugins/include/pnmix/
pnmix_core.h): the library writes them in place. Everything is checked twice: here (devices,
dtypes, contiguity) and in the library (every size), whose message becomes a PnMixError.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Dict, Optional, Tuple

import torch

from .._native import load_library
from ..cache import check_new_kv, check_queries
from ..config import CONFIG_FIELDS, PAIR_LAYOUTS, PnMixConfig
from ..errors import PnMixError
from ..format import STATE_DTYPES, STATE_NAMES, CacheLayout
from .base import CacheOps

LIBRARY = "pnmix_core"
ABI_VERSION = 2

_C_TYPES = {"high_ratio": ctypes.c_double}


class CConfig(ctypes.Structure):
    """pnmix_config (params.h): CONFIG_FIELDS in order; pair_layout as its index in PAIR_LAYOUTS."""

    _fields_ = [(name, _C_TYPES.get(name, ctypes.c_int32)) for name in CONFIG_FIELDS]


class CLayout(ctypes.Structure):
    _fields_ = [("config", CConfig), ("batch", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("max_seq_len", ctypes.c_int64)]


class CState(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p * len(STATE_NAMES)), ("nbytes", ctypes.c_int64 * len(STATE_NAMES))]


_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "pnmix_core_abi_version": ([], _INT),
    "pnmix_last_error": ([], ctypes.c_char_p),
    "pnmix_state_bytes": ([_PTR, _PTR], _INT),
    "pnmix_persistent_bytes": ([_PTR, _I64, _PTR], _INT),
    "pnmix_append": ([_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64], _INT),
    "pnmix_attend": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT], _INT),
    "pnmix_attend_isa": ([], ctypes.c_char_p),
    "pnmix_set_attend_isa": ([ctypes.c_char_p], _INT),
    "pnmix_half_to_float": ([_PTR, _PTR, _I64], _INT),
    "pnmix_float_to_half": ([_PTR, _PTR, _I64, _INT], _INT),
    "pnmix_dump_size": ([_PTR, _I64, _PTR], _INT),
    "pnmix_dump_write": ([_PTR, _PTR, _I64, _PTR, _I64, _PTR], _INT),
    "pnmix_dump_header": ([_PTR, _I64, _PTR, _PTR], _INT),
    "pnmix_dump_read": ([_PTR, _I64, _PTR, _PTR, _PTR], _INT),
}


def core_library() -> ctypes.CDLL:
    """libpnmix_core with its prototypes set; NativeLibraryError when not built."""
    lib = load_library(LIBRARY)
    if not getattr(lib, "_pnmix_ready", False):
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        version = lib.pnmix_core_abi_version()
        if version != ABI_VERSION:
            raise PnMixError(f"libpnmix_core ABI version {version}, this pnmix needs {ABI_VERSION}: rebuild it")
        lib._pnmix_ready = True
    return lib


def check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        raise PnMixError(f"pnmix core: {lib.pnmix_last_error().decode(errors='replace')}")


def c_layout(layout: CacheLayout) -> CLayout:
    """The C struct of a layout: built once per layout (layouts are frozen), copied per call so
    the caller may change its own."""
    return CLayout.from_buffer_copy(_built_layout(layout))


@functools.lru_cache(maxsize=256)
def _built_layout(layout: CacheLayout) -> CLayout:
    fields = layout.config.to_dict()
    fields["pair_layout"] = PAIR_LAYOUTS.index(fields["pair_layout"])
    return CLayout(CConfig(**fields), layout.batch, layout.kv_heads, layout.head_dim, layout.max_seq_len)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.numel() == 0 else t.data_ptr()


# The CState built for each state dict (by id), with what it was built from: a decode loop hands
# the same tensors every step, so the checks run once per set of buffers, not once per call.
_checked_states: Dict[int, tuple] = {}
_MAX_CHECKED_STATES = 4096  # layers x live caches; forgotten all at once past this


def _state_key(state: Dict[str, torch.Tensor]) -> tuple:
    # the same tensor objects (alive: the dict holds them) over the same memory, size and dtype
    return tuple((id(t), t.data_ptr(), t.numel(), t.dtype) if (t := state.get(name)) is not None else None
                 for name in STATE_NAMES)


def c_state(state: Dict[str, torch.Tensor]) -> CState:
    """The state tensors as C buffers: CPU, contiguous, of the format's dtype (checked here; a
    repeat call with the same buffers reuses the checked struct)."""
    key = _state_key(state)
    known = _checked_states.get(id(state))
    if known is None or known[0] != key:
        known = (key, _check_state(state))
        if len(_checked_states) >= _MAX_CHECKED_STATES:
            _checked_states.clear()
        _checked_states[id(state)] = known
    return CState.from_buffer_copy(known[1])  # a copy: the caller may change its own


def _check_state(state: Dict[str, torch.Tensor]) -> CState:
    out = CState()
    for i, name in enumerate(STATE_NAMES):
        t = state.get(name)
        if t is None:
            raise PnMixError(f"cache state is missing tensor '{name}'")
        if t.device.type != "cpu":
            raise PnMixError(f"the core backend needs CPU tensors; state tensor '{name}' is on {t.device}")
        if t.dtype != STATE_DTYPES[name] or not t.is_contiguous():
            raise PnMixError(f"state tensor '{name}' must be a contiguous {STATE_DTYPES[name]} tensor, got {t.dtype}")
        out.data[i] = _ptr(t)
        out.nbytes[i] = t.numel() * t.element_size()
    return out


def _fp16(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise PnMixError(f"the core backend needs CPU tensors; {what} is on {t.device}")
    return t.to(torch.float16).contiguous()


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class CoreOps(CacheOps):
    """append / attend through libpnmix_core. threads: None or <= 0 uses every core."""

    name = "core"

    def __init__(self, threads: Optional[int] = None):
        self.lib = core_library()
        self.threads = int(threads or 0)

    def append(self, layout, state, seq_len, k, v):
        check_new_kv(layout, k, v)
        k, v = _fp16(k, "keys"), _fp16(v, "values")
        n = k.shape[2]
        lay, st = c_layout(layout), c_state(state)
        check(self.lib, self.lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), seq_len, _ptr(k), _ptr(v),
                                              n, _nbytes(k)))

    def attend(self, q, layout, state, seq_len, k_new=None, v_new=None):
        check_queries(layout, seq_len, q, k_new, v_new)
        if q.device.type != "cpu":
            raise PnMixError(f"the core backend needs CPU tensors; q is on {q.device}")
        is_fp32 = q.dtype != torch.float16  # fp32 as given; bf16 and others are exact in fp32
        q = (q.float() if is_fp32 else q).contiguous()
        batch, q_heads, nq, _ = q.shape
        n_new = 0 if k_new is None else k_new.shape[2]
        if n_new:
            k_new, v_new = _fp16(k_new, "k_new"), _fp16(v_new, "v_new")
        else:
            k_new = v_new = None
        out = torch.empty(batch, q_heads, nq, layout.head_dim, dtype=torch.float32)
        lay, st = c_layout(layout), c_state(state)
        check(self.lib, self.lib.pnmix_attend(
            ctypes.byref(lay), ctypes.byref(st), seq_len, _ptr(q), int(is_fp32), q_heads, nq, _nbytes(q),
            _ptr(k_new), _ptr(v_new), n_new, _nbytes(k_new), _ptr(out), _nbytes(out), self.threads))
        return out

    # ---- extras: the kernel in use, and the .pnkv dump through the C decoder ----------------
    def isa(self) -> str:
        return self.lib.pnmix_attend_isa().decode()

    def set_isa(self, name: str) -> None:
        check(self.lib, self.lib.pnmix_set_attend_isa(name.encode()))


def dump_state(layout: CacheLayout, state: Dict[str, torch.Tensor], seq_len: int) -> bytes:
    """The .pnkv dump written by the C core (equals pnmix.format.dump_state)."""
    lib = core_library()
    lay, st = c_layout(layout), c_state(state)
    size = ctypes.c_int64()
    check(lib, lib.pnmix_dump_size(ctypes.byref(lay), seq_len, ctypes.byref(size)))
    out = (ctypes.c_uint8 * max(size.value, 1))()
    check(lib, lib.pnmix_dump_write(ctypes.byref(lay), ctypes.byref(st), seq_len, out, size.value, None))
    return bytes(out)[: size.value]


def load_state(blob: bytes) -> Tuple[CacheLayout, Dict[str, torch.Tensor], int]:
    """Decode a .pnkv dump with the C core; every size is checked there. Mirrors format.load_state."""
    lib = core_library()
    raw = ctypes.create_string_buffer(blob, len(blob))
    lay, seq_len = CLayout(), ctypes.c_int64()
    check(lib, lib.pnmix_dump_header(raw, len(blob), ctypes.byref(lay), ctypes.byref(seq_len)))
    fields = {name: getattr(lay.config, name) for name in CONFIG_FIELDS}
    fields["pair_layout"] = PAIR_LAYOUTS[fields["pair_layout"]]
    layout = CacheLayout(PnMixConfig(**fields), lay.batch, lay.kv_heads, lay.head_dim, lay.max_seq_len)
    state = layout.empty_state()
    check(lib, lib.pnmix_dump_read(raw, len(blob), ctypes.byref(lay), ctypes.byref(c_state(state)), None))
    return layout, state, seq_len.value
