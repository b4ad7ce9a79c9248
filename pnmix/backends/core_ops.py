"""The C++ core (libpnmix_core) as a cache-ops backend: append and attention on CPU tensors.

The state dict's tensors are the caller-owned buffers of the C ABI (plugins/include/pnmix/
pnmix_core.h): the library writes them in place. Everything is checked twice: here (devices,
dtypes, contiguity) and in the library (every size), whose message becomes a PnMixError.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch

from ..cache import CacheOps, check_new_kv, check_queries, fp16_kv
from ..errors import PnMixError
from ..format import QUERY_ENCODINGS, STATE_DTYPES, STATE_NAMES, CacheLayout
from ..memory import switch_on
from . import native
from .native import (INT as _INT, I64 as _I64, PTR as _PTR, CConfig, CLayout, COpenMPTeam, CPagedSequence, CPagedState, CState,
                     c_layout, nbytes as _nbytes, ptr as _ptr)

LIBRARY = "pnmix_core"
ABI_VERSION = 11

_SIGNATURES: native.Signatures = {
    "pnmix_core_abi_version": ([], _INT),
    "pnmix_last_error": ([], ctypes.c_char_p),
    "pnmix_core_struct_offset": ([ctypes.c_char_p, ctypes.c_char_p], _I64),
    "pnmix_state_bytes": ([_PTR, _PTR], _INT),
    "pnmix_persistent_bytes": ([_PTR, _I64, _PTR], _INT),
    "pnmix_append": ([_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64], _INT),
    "pnmix_attend": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT], _INT),
    "pnmix_attend_append": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _INT, _I64, _I64, _PTR, _I64, _INT],
                            _INT),
    "pnmix_attend_on": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT, _PTR,
                         _PTR], _INT),
    "pnmix_attend_append_on": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _INT, _I64, _I64, _PTR, _I64,
                                _INT, _PTR, _PTR], _INT),
    "pnmix_openmp_parallel_for": ([_PTR, _PTR, _PTR, _I64], _INT),  # (team, task, task_ctx, items)
    "pnmix_attend_paged": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT],
                           _INT),
    "pnmix_attend_paged_batch": ([_PTR, _PTR, _I64, _INT, _I64, _INT], _INT),
    "pnmix_attend_paged_on": ([_PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT,
                               _PTR, _PTR], _INT),
    "pnmix_attend_paged_batch_on": ([_PTR, _PTR, _I64, _INT, _I64, _INT, _PTR, _PTR], _INT),
    "pnmix_group_sections": ([_PTR, _PTR, _PTR], _INT),
    "pnmix_attend_isa": ([], ctypes.c_char_p),
    "pnmix_set_attend_isa": ([ctypes.c_char_p], _INT),
    "pnmix_attend_arith": ([], ctypes.c_char_p),
    "pnmix_set_attend_arith": ([ctypes.c_char_p], _INT),
    "pnmix_attend_arith_for": ([_PTR], ctypes.c_char_p),
    "pnmix_madd_rate": ([ctypes.c_char_p, _INT, _I64, _PTR], _INT),
    "pnmix_half_to_float": ([_PTR, _PTR, _I64], _INT),
    "pnmix_float_to_half": ([_PTR, _PTR, _I64, _INT], _INT),
    "pnmix_dump_size": ([_PTR, _I64, _PTR], _INT),
    "pnmix_dump_write": ([_PTR, _PTR, _I64, _PTR, _I64, _PTR], _INT),
    "pnmix_dump_header": ([_PTR, _I64, _PTR, _PTR], _INT),
    "pnmix_dump_read": ([_PTR, _I64, _PTR, _PTR, _PTR], _INT),
}
__all__ = ["CConfig", "CLayout", "COpenMPTeam", "CPagedSequence", "CPagedState", "CState", "CoreOps", "c_layout", "c_state", "check", "core_library",
           "dump_state", "group_sections", "load_state"]

# The tensors of a paged sequence's slot (pnmix_paged_state): everything but the group tensors.
SLOT_TENSORS = ("sink_k", "sink_v", "residual_k", "residual_v", "pair_mask")


def core_library() -> ctypes.CDLL:
    """libpnmix_core with its prototypes set; NativeLibraryError when not built."""
    return native.bind_library(LIBRARY, _SIGNATURES, "pnmix_core_abi_version", ABI_VERSION)


def check(lib: ctypes.CDLL, status: int) -> None:
    native.check_status(status, "pnmix core", lib.pnmix_last_error)


def _cpu_problem(t: torch.Tensor, what: str) -> Optional[str]:
    """None for a CPU tensor, else the one-line error naming `what` and where it is."""
    return None if t.device.type == "cpu" else f"the core backend needs CPU tensors; {what} is on {t.device}"


def _on_cpu(name: str, t: torch.Tensor) -> Optional[str]:
    return _cpu_problem(t, f"state tensor '{name}'")


def _cpu_only(t: torch.Tensor, what: str) -> torch.Tensor:
    """t, refused unless it is on the CPU."""
    problem = _cpu_problem(t, what)
    if problem:
        raise PnMixError(problem)
    return t


def c_state(state: Dict[str, torch.Tensor]) -> CState:
    """The state tensors as C buffers: CPU, contiguous, of the format's dtype (checked here)."""
    return native.c_state(state, _on_cpu)


def _fp16(t: torch.Tensor, what: str) -> torch.Tensor:
    if _cpu_only(t, what).dtype == torch.float16 and t.is_contiguous():
        return t  # what the caches hand over: no tensor op (a decode step makes these per layer)
    return t.to(torch.float16).contiguous()


_KERNEL_DTYPES = (torch.float16, torch.float32)  # the queries and new K/V the C calls take as they are
# q_is_fp32 of the attention calls (pnmix_core.h), by (the queries' dtype, whether they count as
# rounded to fp16): fp32 ones the C call rounds itself where they do
_QUERY_ENCODING = {(dtype, rounded): QUERY_ENCODINGS.index(
    "fp16" if dtype == torch.float16 else "fp32_as_fp16" if rounded else "fp32")
    for dtype in _KERNEL_DTYPES for rounded in (False, True)}


def _query_encoding(q: torch.Tensor) -> int:
    """How a C call reads the (fp16 or fp32) queries q: as they are."""
    return _QUERY_ENCODING[q.dtype, False]


def _step_kv(t: torch.Tensor, what: str) -> torch.Tensor:
    """New K/V as pnmix_attend_append takes them: contiguous fp16 or fp32 CPU tensors."""
    if _cpu_only(t, what).dtype in _KERNEL_DTYPES:
        return t.contiguous()
    return t.to(torch.float16).contiguous()  # bf16 and fp64: one rounding, as fp16_kv's


def _output(q: torch.Tensor) -> torch.Tensor:
    """The attention's output for queries q [B, Hq, nq, D]: fp32, same shape."""
    return torch.empty(q.shape, dtype=torch.float32)


def _cpu_query(q: torch.Tensor) -> torch.Tensor:
    """Queries as the kernels take them: contiguous fp16, or fp32 (bf16 and others are exact in fp32)."""
    return (q if _cpu_only(q, "q").dtype == torch.float16 else q.float()).contiguous()


def _paged_pages(layout: CacheLayout, pages: torch.Tensor, block_size: int) -> CPagedState:
    """A paged state with the layer's pages filled in (checked): uint8 [num_blocks, H, head_bytes]."""
    if _cpu_only(pages, "pages").dtype != torch.uint8 or pages.dim() != 3 or pages.shape[1] != layout.kv_heads or pages.stride(2) != 1:
        raise PnMixError(f"pages must be uint8 [num_blocks, kv_heads={layout.kv_heads}, head_bytes] with dense "
                         f"rows, got {pages.dtype} {list(pages.shape)} strides {list(pages.stride())}")
    return CPagedState(pages=_ptr(pages), num_blocks=pages.shape[0], page_bytes=pages.stride(0),
                       head_bytes=pages.stride(1), block_size=block_size)


def _check_block_ids(table: torch.Tensor, dims: int) -> None:
    """A block table: int32 or int64 ids, ``dims``-D, its (last) dimension dense, on the CPU."""
    if _cpu_only(table, "the block table").dtype not in (torch.int32, torch.int64) or table.dim() != dims or (
            table.shape[-1] > 1 and table.stride(-1) != 1):
        raise PnMixError(f"block table must be a {dims}-D int32 or int64 tensor with dense rows, got {table.dtype} "
                         f"{list(table.shape)}")


def _slot_tensors(slot: Dict[str, torch.Tensor], what: str) -> Dict[str, torch.Tensor]:
    """SLOT_TENSORS of ``slot``, each present, on the CPU, of the format's dtype and contiguous."""
    for name in SLOT_TENSORS:
        part = slot.get(name)
        if part is None:
            raise PnMixError(f"{what} is missing tensor '{name}'")
        if part.device.type != "cpu" or part.dtype != STATE_DTYPES[name] or not part.is_contiguous():
            raise PnMixError(f"slot tensor '{name}' must be a contiguous CPU {STATE_DTYPES[name]} tensor, "
                             f"got {part.dtype} on {part.device}")
    return {name: slot[name] for name in SLOT_TENSORS}


TORCH_THREADS_SWITCH = "PNMIX_TORCH_THREADS"  # 1 (the default): CoreOps on torch's OpenMP threads; 0: the core's pool


@functools.lru_cache(maxsize=None)
def torch_gomp_parallel() -> Optional[int]:
    """The address of GOMP_parallel in the OpenMP runtime torch's intra-op threads run on, or None
    (torch on another threading backend). The symbol is looked up through torch's own CPU library,
    already loaded, so that its dependency order gives the runtime torch is linked against
    (libgomp in the Linux wheels, libomp on macOS, libiomp5 in some conda builds); never a second one."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info() or not hasattr(os, "RTLD_NOLOAD"):
        return None
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            return native.address(ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY).GOMP_parallel)
        except (OSError, AttributeError):  # not the library torch loaded, or no OpenMP runtime behind it
            continue
    return None


class CoreOps(CacheOps):
    """append / attend through libpnmix_core. threads: None or <= 0 uses every core (on torch's
    threads: torch.get_num_threads()).

    torch_threads: run the work items of attend, attend_append and the paged calls (vLLM's) on
    torch's intra-op threads where torch runs them on an OpenMP runtime (pnmix_openmp_parallel_for):
    between a model's layers they are awake, spinning, and a decode step's attention starts on all
    of them at once, where the core's own pool would wake a helper to share a core with torch's
    spinning one (docs/BENCHMARKS.md sections 2.24-2.25). None: PNMIX_TORCH_THREADS (unset or 1:
    yes; 0: no), read when the ops are made (a copy of a cache reads it again). False, or a torch
    without that runtime: the core's own pool, which also serves the appends' group flushes."""

    name = "core"
    checks_kv_values = True  # attend_append rounds and checks the new K/V in its one C call

    def __init__(self, threads: Optional[int] = None, torch_threads: Optional[bool] = None):
        self.lib = core_library()
        self.threads = max(int(threads or 0), 0)
        self.torch_threads = torch_threads  # as given: a copy re-reads the switch where it runs
        on_torch = switch_on(TORCH_THREADS_SWITCH) if torch_threads is None else bool(torch_threads)
        gomp_parallel = torch_gomp_parallel() if on_torch else None
        # the team: torch's default size, or `threads` (split and team alike)
        self.team = COpenMPTeam(gomp_parallel, self.threads) if gomp_parallel else None
        self.runner = native.address(self.lib.pnmix_openmp_parallel_for) if self.team is not None else None
        self.team_address = ctypes.addressof(self.team) if self.team is not None else None  # the runner's context

    def init_args(self) -> tuple:
        return (self.threads, self.torch_threads)

    def _threads(self) -> int:
        """The threads a call's work is split for: on torch's threads, the team's size."""
        if self.team is None:
            return self.threads
        torch_threads = torch.get_num_threads()  # called always: it sets up torch's threads on a new thread
        return self.threads or torch_threads

    def append(self, layout, state, seq_len, k, v):
        check_new_kv(layout, k, v)
        k, v = _fp16(k, "keys"), _fp16(v, "values")
        lay, st = c_layout(layout), c_state(state)
        check(self.lib, self.lib.pnmix_append(ctypes.byref(lay), ctypes.byref(st), seq_len, _ptr(k), _ptr(v),
                                              k.shape[2], _nbytes(k)))

    def attend(self, q, layout, state, seq_len, k_new=None, v_new=None):
        check_queries(layout, seq_len, q, k_new, v_new)
        q = _cpu_query(q)
        if k_new is not None and k_new.shape[2]:
            k_new, v_new = _fp16(k_new, "k_new"), _fp16(v_new, "v_new")
        else:
            k_new = v_new = None
        out = _output(q)
        lay, st = native.call_structs(layout, state, _on_cpu)
        check(self.lib, self.lib.pnmix_attend_on(
            lay, st, seq_len, _ptr(q), _query_encoding(q), q.shape[1],
            q.shape[2], _nbytes(q), _ptr(k_new), _ptr(v_new), 0 if k_new is None else k_new.shape[2],
            _nbytes(k_new), _ptr(out), _nbytes(out), self._threads(), self.runner, self.team_address))
        return out

    def attend_append(self, q, layout, state, seq_len, k, v):
        # One C call (pnmix_attend_append): it rounds fp32 K/V to fp16 and refuses non-finite ones
        # before it writes anything, so a decode step of a model's layer makes no tensor op on them.
        check_queries(layout, seq_len, q, k, v)
        if k.shape[2] == 0:
            return self.attend(q, layout, state, seq_len, k, v)
        return self.attend_append_checked(q, layout, state, seq_len, k, v)

    def attend_append_checked(self, q, layout, state, seq_len, k, v, query_as_fp16=False):
        # A model's decode step runs this in each layer with its code out of the caches (after the
        # layer's matrix products), where every Python call costs microseconds: the common case
        # (CPU, contiguous, fp16 or fp32 queries, K/V of one such dtype) is checked inline, the
        # rest goes through the converting helpers. The C call checks sizes and room again.
        if not (q.is_cpu and k.is_cpu and v.is_cpu and q.dtype in _KERNEL_DTYPES and k.dtype is v.dtype
                and k.dtype in _KERNEL_DTYPES and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            q, k, v = _cpu_query(q), _step_kv(k, "k_new"), _step_kv(v, "v_new")
            if k.dtype != v.dtype:
                k, v = k.float(), v.float()
        out = torch.empty(q.shape, dtype=torch.float32)  # _output's
        lay, st = native.call_structs(layout, state, _on_cpu)
        # (q, k, v and out hold elements here: their data_ptr and nbytes, without _ptr's and _nbytes' cases;
        # fp32 queries that count as rounded are rounded in the C call: a torch cast less)
        status = self.lib.pnmix_attend_append_on(
            lay, st, seq_len, q.data_ptr(), _QUERY_ENCODING[q.dtype, query_as_fp16], q.shape[1], q.shape[2], q.nbytes,
            k.data_ptr(), v.data_ptr(), int(k.dtype is torch.float32), k.shape[2], k.nbytes, out.data_ptr(),
            out.nbytes, self._threads(), self.runner, self.team_address)
        if status:  # the values are the C call's first check: fp16_kv names the tensor and its tokens
            fp16_kv(k, v, k.device, seq_len)
            check(self.lib, status)
        return out

    def attend_paged(self, q: torch.Tensor, layout: CacheLayout, pages: torch.Tensor, block_table: torch.Tensor,
                     block_size: int, slot: Dict[str, torch.Tensor], seq_len: int,
                     k_new: Optional[torch.Tensor] = None, v_new: Optional[torch.Tensor] = None) -> torch.Tensor:
        """attend for one sequence (layout batch 1) whose groups are in an engine's pages, read in
        place (pnmix_attend_paged): pages uint8 [num_blocks, H, head_bytes] (the last dimension
        dense; the block and head strides are passed), block_table the sequence's block ids (int32
        or int64, 1-D), slot the sequence's sink_k, sink_v, residual_k, residual_v and pair_mask as
        batch-1 state tensors. Equals attend over the gathered state, bit for bit."""
        check_queries(layout, seq_len, q, k_new, v_new)
        q = _cpu_query(q)
        c = _paged_pages(layout, pages, block_size)
        _check_block_ids(block_table, 1)
        c.block_table, c.table_blocks, c.block_id_bytes = _ptr(block_table), block_table.numel(), block_table.element_size()
        for name, part in _slot_tensors(slot, "the paged slot").items():
            setattr(c, name, _ptr(part))
        c.sink_bytes, c.residual_bytes = _nbytes(slot["sink_k"]), _nbytes(slot["residual_k"])
        c.mask_bytes = _nbytes(slot["pair_mask"])
        for k_name, v_name in (("sink_k", "sink_v"), ("residual_k", "residual_v")):
            if _nbytes(slot[k_name]) != _nbytes(slot[v_name]):
                raise PnMixError(f"slot tensors '{k_name}' and '{v_name}' differ in size")
        encoding = _query_encoding(q)
        _, q_heads, nq, _ = q.shape
        if k_new is not None and v_new is not None and k_new.shape[2]:  # both or neither (check_queries)
            k_new, v_new = _fp16(k_new, "k_new"), _fp16(v_new, "v_new")
        else:
            k_new = v_new = None
        n_new = 0 if k_new is None else k_new.shape[2]
        out = _output(q)
        lay = c_layout(layout)
        check(self.lib, self.lib.pnmix_attend_paged_on(
            ctypes.byref(lay), ctypes.byref(c), seq_len, _ptr(q), encoding, q_heads, nq, _nbytes(q),
            _ptr(k_new), _ptr(v_new), n_new, _nbytes(k_new), _ptr(out), _nbytes(out), self._threads(), self.runner,
            self.team_address))
        return out

    def attend_paged_batch(self, q: torch.Tensor, layout: CacheLayout, pages: torch.Tensor,
                           block_tables: torch.Tensor, block_size: int, slots: Dict[str, torch.Tensor],
                           slot_ids: Sequence[int], seq_lens: Sequence[int], k_new: torch.Tensor,
                           v_new: torch.Tensor) -> torch.Tensor:
        """A decode step of N sequences in one call (pnmix_attend_paged_batch): sequence i holds
        seq_lens[i] tokens, its groups in ``pages`` through block_tables[i] (int32 or int64
        [N, max_blocks], rows dense), its sink, residual and pair mask in slot slot_ids[i] of
        ``slots`` (each tensor [num_slots, ...], a slot being a batch-1 state tensor, as
        pnmix.vllm.paged keeps them); its one query q[i] [Hq, D] attends over the cache and then its
        new token k_new[i], v_new[i] [H, D]. layout: batch 1, max_seq_len at least every seq_len.
        Returns fp32 [N, Hq, D]; row i equals attend_paged's for sequence i up to the order in which
        the kernel's splits are merged (the split follows the whole batch's work)."""
        n, h, d = len(seq_lens), layout.kv_heads, layout.head_dim
        if layout.batch != 1:
            raise PnMixError(f"a batched paged attention takes a batch-1 layout, got batch {layout.batch}")
        if q.dim() != 3 or q.shape[0] != n or q.shape[2] != d or q.shape[1] % h:
            raise PnMixError(f"queries must be [sequences={n}, q_heads (a multiple of {h}), head_dim={d}], "
                             f"got {list(q.shape)}")
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if t.dim() != 3 or list(t.shape) != [n, h, d]:
                raise PnMixError(f"{name} must be [sequences={n}, kv_heads={h}, head_dim={d}], got {list(t.shape)}")
        if len(slot_ids) != n:
            raise PnMixError(f"{len(slot_ids)} slot ids for {n} sequences")
        for name, t in (("q", q), ("block_tables", block_tables)):
            _cpu_only(t, name)
        template = _paged_pages(layout, pages, block_size)
        _check_block_ids(block_tables, 2)
        if block_tables.shape[0] != n:
            raise PnMixError(f"block_tables has {block_tables.shape[0]} rows for {n} sequences")
        for name, part in _slot_tensors(slots, "the paged slots").items():
            if part.dim() < 1 or part.shape[0] != slots["sink_k"].shape[0]:
                raise PnMixError(f"slot tensor '{name}' must have the slots as its first dimension")
        num_slots = slots["sink_k"].shape[0]
        bad = [s for s in slot_ids if not 0 <= s < num_slots]
        if bad:
            raise PnMixError(f"slot id {bad[0]} outside 0..{num_slots - 1}")
        q, k16, v16 = _cpu_query(q), _fp16(k_new, "k_new"), _fp16(v_new, "v_new")
        encoding = _query_encoding(q)
        out = torch.empty(n, q.shape[1], d, dtype=torch.float32)
        seqs = (CPagedSequence * n)()
        slot_base = {name: (slots[name].data_ptr(), _nbytes(slots[name]) // num_slots) for name in SLOT_TENSORS}
        template.sink_bytes, template.residual_bytes = slot_base["sink_k"][1], slot_base["residual_k"][1]
        template.mask_bytes = slot_base["pair_mask"][1]
        template.table_blocks, template.block_id_bytes = block_tables.shape[1], block_tables.element_size()
        table_row, table_base = block_tables.stride(0) * block_tables.element_size(), block_tables.data_ptr()
        q_row, kv_row, out_row = _nbytes(q[0]), _nbytes(k16[0]), _nbytes(out[0])
        q_base, k_base, v_base, out_base = q.data_ptr(), k16.data_ptr(), v16.data_ptr(), out.data_ptr()
        for i, (slot, seq_len) in enumerate(zip(slot_ids, seq_lens)):
            seq = seqs[i]
            seq.paged = template
            seq.paged.block_table = table_base + i * table_row
            for name in SLOT_TENSORS:
                base, size = slot_base[name]
                setattr(seq.paged, name, base + slot * size)
            seq.seq_len, seq.nq, seq.n_new = seq_len, 1, 1
            seq.q, seq.q_bytes = q_base + i * q_row, q_row
            seq.k_new, seq.v_new, seq.new_bytes = k_base + i * kv_row, v_base + i * kv_row, kv_row
            seq.out, seq.out_bytes = out_base + i * out_row, out_row
        lay = c_layout(layout)
        check(self.lib, self.lib.pnmix_attend_paged_batch_on(ctypes.byref(lay), seqs, n, encoding, q.shape[1],
                                                             self._threads(), self.runner, self.team_address))
        return out

    # ---- extras: the kernel in use, and the .pnkv dump through the C decoder ----------------
    def isa(self) -> str:
        return self.lib.pnmix_attend_isa().decode()

    def set_isa(self, name: str) -> None:
        check(self.lib, self.lib.pnmix_set_attend_isa(name.encode()))

    # the kernels pnmix_set_attend_isa names, besides auto (attend_dispatch.cc)
    KERNELS = ("scalar", "avx2", "avx512", "avx512vbmi", "avx512vnni")

    def each_kernel(self) -> Iterator[str]:
        """Force each kernel this CPU (and build) has in turn, yielding its name; auto again after
        the last, or when the caller stops early. Process-wide, as set_isa."""
        try:
            for name in self.KERNELS:
                try:
                    self.set_isa(name)
                except PnMixError:
                    continue  # this CPU lacks it
                yield name
        finally:
            self.set_isa("auto")

    def arith(self) -> str:
        """The arithmetic requested for the packed groups: fp32 (exact, the default) or int8."""
        return self.lib.pnmix_attend_arith().decode()

    def set_arith(self, name: str) -> None:
        """fp32, int8, or auto (back to the PNMIX_ATTEND_ARITH environment variable); process-wide."""
        check(self.lib, self.lib.pnmix_set_attend_arith(name.encode()))

    def arith_for(self, layout: CacheLayout) -> str:
        """What an attention over this layout runs: int8, fp32, or the half of each."""
        lay = c_layout(layout)
        return self.lib.pnmix_attend_arith_for(ctypes.byref(lay)).decode()

    def madd_rate(self, kind: str, threads: int, iterations: int = 4_000_000, runs: int = 3) -> float:
        """Multiply-adds per second with the data in registers, the best of `runs` (kind: fp32 FMAs
        or int8: the integer path's inner step), with the instructions of the kernel that arithmetic
        runs on (isa() under it); AVX2 and newer."""
        best = 0.0
        for _ in range(runs):
            done = ctypes.c_double()
            start = time.perf_counter()
            check(self.lib, self.lib.pnmix_madd_rate(kind.encode(), threads, iterations, ctypes.byref(done)))
            best = max(best, done.value / (time.perf_counter() - start))
        return best


def group_sections(layout: CacheLayout) -> Dict[str, Tuple[int, int]]:
    """(first byte, byte count) of each group tensor in one KV head's part of a page, as the C core
    lays a page out (pnmix_group_sections; pnmix.vllm.paged.PageLayout.section_offsets must agree)."""
    lib = core_library()
    first, size = (ctypes.c_int64 * 6)(), (ctypes.c_int64 * 6)()
    lay = c_layout(layout)
    check(lib, lib.pnmix_group_sections(ctypes.byref(lay), first, size))
    names = STATE_NAMES[STATE_NAMES.index("key_codes"):STATE_NAMES.index("value_offset") + 1]
    return {name: (first[i], size[i]) for i, name in enumerate(names)}


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
    layout = native.layout_from_c(lay)
    state = layout.empty_state()
    check(lib, lib.pnmix_dump_read(raw, len(blob), ctypes.byref(lay), ctypes.byref(c_state(state)), None))
    return layout, state, seq_len.value
