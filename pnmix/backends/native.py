"""The ctypes glue shared by the C ABIs of libpnmix_core and libpnmix_cuda.

Both libraries take the same ``pnmix_layout`` and ``pnmix_state`` structs (plugins/include/pnmix/
params.h, pnmix_core.h), report failures as a status code plus a last-error string, and carry an
ABI version. This module holds those structs, the binding of a library's prototypes, and the
state tensors as C buffers; core_ops.py and cuda_ops.py add only their own entry points.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Dict, Mapping, Optional, Sequence, Tuple, Type

import torch

from .._native import load_library
from ..config import CONFIG_FIELD_TYPES, CONFIG_FIELDS, PAIR_LAYOUTS, PnMixConfig
from ..errors import PnMixError
from ..format import STATE_DTYPES, STATE_NAMES, CacheLayout

I64, PTR, INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# The C type of each config field's Python type (params.h: RATIO double, INT and LAYOUT int32).
_C_TYPES: Dict[type, Type[ctypes._SimpleCData]] = {float: ctypes.c_double, int: ctypes.c_int32, str: ctypes.c_int32}


class CConfig(ctypes.Structure):
    """pnmix_config (params.h): CONFIG_FIELDS in order; pair_layout as its index in PAIR_LAYOUTS.
    tests/backends/test_core.py checks this mirror against the compiler's layout (pnmix_core_struct_offset)."""

    _fields_ = [(name, _C_TYPES[CONFIG_FIELD_TYPES[name]]) for name in CONFIG_FIELDS]


class CLayout(ctypes.Structure):
    _fields_ = [("config", CConfig), ("batch", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("max_seq_len", ctypes.c_int64)]


class CState(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p * len(STATE_NAMES)), ("nbytes", ctypes.c_int64 * len(STATE_NAMES))]


class CPagedState(ctypes.Structure):
    """pnmix_paged_state (pnmix_core.h): a sequence whose groups are in an engine's pages."""

    _fields_ = [("pages", PTR), ("num_blocks", I64), ("page_bytes", I64), ("head_bytes", I64),
                ("block_size", I64), ("block_table", PTR), ("table_blocks", I64), ("block_id_bytes", I64),
                ("sink_k", PTR), ("sink_v", PTR), ("residual_k", PTR), ("residual_v", PTR), ("pair_mask", PTR),
                ("sink_bytes", I64), ("residual_bytes", I64), ("mask_bytes", I64)]


class COpenMPTeam(ctypes.Structure):
    """pnmix_openmp_team (pnmix_core.h): an OpenMP runtime's GOMP_parallel and the team's size
    (<= 0: the runtime's default)."""

    _fields_ = [("gomp_parallel", PTR), ("threads", ctypes.c_int32)]


class CPagedSequence(ctypes.Structure):
    """pnmix_paged_sequence (pnmix_core.h): one sequence of a batched paged attention."""

    _fields_ = [("paged", CPagedState), ("seq_len", I64), ("q", PTR), ("nq", I64), ("q_bytes", I64),
                ("k_new", PTR), ("v_new", PTR), ("n_new", I64), ("new_bytes", I64), ("out", PTR), ("out_bytes", I64)]


Signatures = Mapping[str, Tuple[Sequence, object]]


def bind_library(name: str, signatures: Signatures, version_fn: str, abi_version: int) -> ctypes.CDLL:
    """The native library `name` with its prototypes set and its ABI version checked (once)."""
    lib = load_library(name)
    if not getattr(lib, "_pnmix_ready", False):
        version = _function(lib, name, version_fn)
        version.argtypes, version.restype = [], ctypes.c_int
        if version() != abi_version:
            raise PnMixError(f"lib{name} ABI version {version()}, this pnmix needs {abi_version}: rebuild it")
        for fn_name, (args, result) in signatures.items():
            fn = _function(lib, name, fn_name)
            fn.argtypes, fn.restype = list(args), result
        lib._pnmix_ready = True  # type: ignore[attr-defined]  # a mark on the CDLL: a reloaded one binds again
    return lib


def _function(lib: ctypes.CDLL, name: str, fn_name: str):
    try:
        return getattr(lib, fn_name)
    except AttributeError:
        raise PnMixError(f"lib{name} has no {fn_name}: it is older than this pnmix, rebuild it") from None


def check_status(status: int, what: str, last_error) -> None:
    """A non-zero status becomes a PnMixError with the library's own message."""
    if status != 0:
        raise PnMixError(f"{what}: {last_error().decode(errors='replace')}")


def c_layout(layout: CacheLayout) -> CLayout:
    """The C struct of a layout: built once per layout object (layouts are frozen), copied per call
    so the caller may change its own."""
    return CLayout.from_buffer_copy(layout_struct(layout))


# The struct of each layout object a call has passed (by id, the layout kept: its id stays its own):
# a decode step's calls find it without hashing the layout's fields (30 layers a step).
_layout_structs: Dict[int, Tuple[CacheLayout, CLayout]] = {}
_MAX_LAYOUT_STRUCTS = 4096


def layout_struct(layout: CacheLayout) -> CLayout:
    """The shared C struct of a layout, for a call that only reads it (c_layout: a copy to change)."""
    known = _layout_structs.get(id(layout))
    if known is None or known[0] is not layout:
        if len(_layout_structs) >= _MAX_LAYOUT_STRUCTS:
            _layout_structs.clear()
        known = _layout_structs[id(layout)] = (layout, _built_layout(layout))
    return known[1]


def _built_layout(layout: CacheLayout) -> CLayout:
    fields = layout.config.to_dict()
    fields["pair_layout"] = PAIR_LAYOUTS.index(fields["pair_layout"])
    return CLayout(CConfig(**fields), layout.batch, layout.kv_heads, layout.head_dim, layout.max_seq_len)


def layout_from_c(lay: CLayout) -> CacheLayout:
    """The CacheLayout of a C layout (its config validated by PnMixConfig)."""
    fields = {name: getattr(lay.config, name) for name in CONFIG_FIELDS}
    fields["pair_layout"] = PAIR_LAYOUTS[fields["pair_layout"]]
    return CacheLayout(PnMixConfig(**fields), lay.batch, lay.kv_heads, lay.head_dim, lay.max_seq_len)


def address(function) -> Optional[int]:
    """A ctypes function's address, as the ABIs' pointer arguments take it (None for a null one)."""
    return ctypes.cast(function, ctypes.c_void_p).value


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# The CState built for each state dict (by id), with weak references to the tensors it was built
# from: a decode loop hands the same tensors every step, so the checks run once per set of buffers,
# not once per call (30 layers a step). A tensor object keeps its memory, size and dtype for life
# unless it is re-pointed in place (set_, resize_), which no pn-mix cache does to its state and no
# caller may (CacheOps says so): a cache that changes its state replaces the tensors. Its own
# tensors still alive is then what makes a struct right for a state, and it is checked without a
# call into torch (a decode step's layers find torch's code and objects out of the caches: each
# such call costs microseconds).
_checked_states: Dict[int, tuple] = {}
_MAX_CHECKED_STATES = 4096  # layers x live caches; forgotten all at once past this


def c_state(state: Dict[str, torch.Tensor], device_problem) -> CState:
    """The state tensors as C buffers, each contiguous and of the format's dtype (checked here; a
    repeat call with the same tensors reuses the checked struct).

    device_problem(name, tensor): None when the tensor is on the device the library needs, else
    the one-line message saying where it is."""
    return CState.from_buffer_copy(state_struct(state, device_problem))  # a copy: the caller may change its own


def state_struct(state: Dict[str, torch.Tensor], device_problem) -> CState:
    """c_state's checked struct itself, shared, for a call that only reads it."""
    known = _checked_states.get(id(state))
    if known is None or known[0] is not device_problem or not _built_from(known[1], state):
        struct = _checked_c_state(state, device_problem)  # raises before anything is kept
        known = (device_problem, tuple(weakref.ref(state[name]) for name in STATE_NAMES), struct)
        if len(_checked_states) >= _MAX_CHECKED_STATES:
            _checked_states.clear()
        _checked_states[id(state)] = known
    return known[2]


def call_structs(layout: CacheLayout, state: Dict[str, torch.Tensor], device_problem) -> tuple:
    """byref of layout_struct(layout) and state_struct(state, device_problem), for a call that
    only reads them, with both lookups in this one frame: a model's decode step makes 30 such
    calls, each with its code out of the caches, where every Python call costs microseconds. The
    two cache hits are layout_struct's and state_struct's, tested here; anything else goes
    through them."""
    known_layout = _layout_structs.get(id(layout))
    known_state = _checked_states.get(id(state))
    if (known_layout is None or known_layout[0] is not layout or known_state is None
            or known_state[0] is not device_problem or not _built_from(known_state[1], state)):
        return ctypes.byref(layout_struct(layout)), ctypes.byref(state_struct(state, device_problem))
    return ctypes.byref(known_layout[1]), ctypes.byref(known_state[2])


def _built_from(tensors: tuple, state: Dict[str, torch.Tensor]) -> bool:
    """Whether state holds exactly the (live) tensor objects a struct was built from."""
    return all((t := ref()) is not None and t is state.get(name) for ref, name in zip(tensors, STATE_NAMES))


def _checked_c_state(state: Dict[str, torch.Tensor], device_problem) -> CState:
    out = CState()
    for i, name in enumerate(STATE_NAMES):
        t = state.get(name)
        if t is None:
            raise PnMixError(f"cache state is missing tensor '{name}'")
        problem = device_problem(name, t)
        if problem:
            raise PnMixError(problem)
        if t.dtype != STATE_DTYPES[name] or not t.is_contiguous():
            raise PnMixError(f"state tensor '{name}' must be a contiguous {STATE_DTYPES[name]} tensor, got {t.dtype}")
        out.data[i] = ptr(t)
        out.nbytes[i] = nbytes(t)
    return out
