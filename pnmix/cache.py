"""PackedKVCache: append, flush and saliency-once over fixed-capacity packed state tensors.

The state is a dict of plain tensors (format.STATE_NAMES), the same tensors the ONNX graph,
the C++ core and the TensorRT plugins take. The number of tokens taken, ``seq_len``, is the
only other state: sink, group and residual counts follow from it (CacheLayout.lengths).

Semantics (docs/METHOD.md section 2): the first append of an empty cache is the prefill and computes the
pair mask from its keys; tokens fill the sink, then the residual; whenever the residual holds
``residual_size`` tokens its oldest ``group_size`` tokens become a quantized group. Appending n
tokens and then flushing equals flushing each time the residual fills, so the residual never
needs more than ``residual_size`` rows.

The cache runs its two mechanisms through a ``CacheOps`` it is given (the C++ core, Triton,
CUDA: pnmix.backends); without one it runs the reference's. Which ops suit a device is
pnmix.backends.default_ops's business, so this module never imports a backend.
"""

from __future__ import annotations

import math

from abc import ABC, abstractmethod
from typing import Dict, Optional

import torch

from . import reference
from .config import PnMixConfig
from .errors import PnMixError
from .format import STATE_NAMES, CacheLayout, checked_state
from .packing import pack_pair_mask

State = Dict[str, torch.Tensor]


# K/V the cache takes: real floating point, converted to fp16. Complex values would lose their
# imaginary part; integers and booleans are not activations.
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_room(seq_len: int, n: int, capacity: int, where: str = "", limit: str = "max_seq_len") -> None:
    """n more tokens after seq_len must fit a cache that holds ``capacity`` tokens: the one check
    every cache and every runtime of a file makes before it appends. ``where`` ends the error (whose
    cache, what to do); ``limit`` names the capacity as its owner's option does."""
    if seq_len + n > capacity:
        raise PnMixError(f"cache capacity exceeded: {seq_len} + {n} tokens > {limit} {capacity}{where}")


def check_kv_tensors(k, v) -> None:
    """New keys and values: two 4-D real floating-point tensors of one shape."""
    for name, t in (("keys", k), ("values", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise PnMixError(f"new {name} must be a 4-D tensor [batch, kv_heads, n, head_dim], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in KV_DTYPES:
            raise PnMixError(f"new {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if k.shape != v.shape:
        raise PnMixError(f"new keys {list(k.shape)} and values {list(v.shape)} differ in shape")


def fp16_kv(k: torch.Tensor, v: torch.Tensor, device: torch.device, first_token: int):
    """K/V as the cache stores them (fp16 on device), refused when not finite there: Inf would
    saturate to a finite step and quantize silently, NaN codes are backend-defined
    (docs/HARDENING.md section 3)."""
    # (detached: K/V that carry autograd, a model run without no_grad, warn when read as floats)
    k16, v16 = (t.to(device=device, dtype=torch.float16) for t in (_detached(k), _detached(v)))
    # One reduction per tensor, in fp32: finite fp16 values cannot overflow it, and a NaN or an
    # Inf anywhere makes the sum NaN or infinite (a decode step pays this per layer, so it is kept
    # to two small ops; the slow check below only names the culprit).
    if math.isfinite(float(k16.sum(dtype=torch.float32)) + float(v16.sum(dtype=torch.float32))):
        return k16, v16
    for name, t16 in (("keys", k16), ("values", v16)):
        if not bool(torch.isfinite(t16).all()):
            raise PnMixError(
                f"new {name} hold non-finite values (NaN or Inf, or beyond fp16's +-65504) at "
                f"tokens {first_token}..{first_token + t16.shape[2] - 1}; the cache takes finite fp16 K/V only"
            )
    return k16, v16


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t  # a tensor op fewer per decode step and layer


def check_new_kv(layout: CacheLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    check_kv_tensors(k, v)
    want = (layout.batch, layout.kv_heads, layout.head_dim)
    for name, t in (("keys", k), ("values", v)):
        if (t.shape[0], t.shape[1], t.shape[3]) != want:
            raise PnMixError(
                f"new {name} must have shape [batch={want[0]}, kv_heads={want[1]}, n, "
                f"head_dim={want[2]}], got {list(t.shape)}"
            )
    if k.shape != v.shape:
        raise PnMixError(f"new keys {list(k.shape)} and values {list(v.shape)} differ in shape")


def residual_stream(layout: CacheLayout, state: State, seq_len: int, k: torch.Tensor, v: torch.Tensor):
    """An append of k/v [B, H, n, D] at seq_len, as (lengths before, lengths after, stream_k,
    stream_v): the stream is what the residual holds followed by the new tokens past the sink, so
    the (after.groups - before.groups) groups the append flushes are its first tokens."""
    before = layout.lengths(seq_len)
    after = layout.lengths(seq_len + k.shape[2])
    into_sink = after.sink - before.sink
    stream_k = torch.cat([state["residual_k"][:, :, : before.residual], k[:, :, into_sink:]], dim=2)
    stream_v = torch.cat([state["residual_v"][:, :, : before.residual], v[:, :, into_sink:]], dim=2)
    return before, after, stream_k, stream_v


def append_reference(layout: CacheLayout, state: State, seq_len: int, k: torch.Tensor, v: torch.Tensor,
                     kernels=reference) -> None:
    """Append fp16 K/V [B, H, n, D] to the state in place (the reference implementation).

    kernels: where quantize_key_groups / quantize_values come from (the Triton backend passes
    its own; the bookkeeping stays here, in one place)."""
    cfg = layout.config
    n = k.shape[2]
    if seq_len == 0 and n:
        state["pair_mask"].copy_(pack_pair_mask(reference.saliency_mask(k, layout)))
    before, after, stream_k, stream_v = residual_stream(layout, state, seq_len, k, v)
    into_sink = after.sink - before.sink
    if into_sink:
        state["sink_k"][:, :, before.sink:after.sink] = k[:, :, :into_sink]
        state["sink_v"][:, :, before.sink:after.sink] = v[:, :, :into_sink]
    new_groups = after.groups - before.groups
    if new_groups:
        _write_groups(layout, state, before.groups, stream_k, stream_v, new_groups, kernels)
    tail = slice(new_groups * cfg.group_size, None)
    state["residual_k"][:, :, : after.residual] = stream_k[:, :, tail]
    state["residual_v"][:, :, : after.residual] = stream_v[:, :, tail]


def _write_groups(layout, state, first, stream_k, stream_v, count, kernels=reference) -> None:
    b, h, d, gs = layout.batch, layout.kv_heads, layout.head_dim, layout.config.group_size
    bits = reference.state_channel_bits(layout, state)  # [B, H, D]
    groups_k = stream_k[:, :, : count * gs].reshape(b, h, count, gs, d)
    rows_bits = bits.unsqueeze(2).expand(b, h, count, d).reshape(-1, d)
    packed, step, offset = kernels.quantize_key_groups(groups_k.reshape(-1, gs, d), rows_bits, layout)
    where = (slice(None), slice(None), slice(first, first + count))
    state["key_codes"][where] = packed.reshape(b, h, count, -1)
    state["key_step"][where] = step.reshape(b, h, count, d)
    state["key_offset"][where] = offset.reshape(b, h, count, d)
    groups_v = stream_v[:, :, : count * gs].reshape(b, h, count, gs, d)
    packed_v, step_v, offset_v = kernels.quantize_values(groups_v, layout)
    state["value_codes"][where] = packed_v
    state["value_step"][where] = step_v
    state["value_offset"][where] = offset_v


def check_queries(layout: CacheLayout, seq_len: int, q: torch.Tensor, k_new, v_new) -> None:
    """q [B, Hq, nq, D] with Hq a multiple of kv_heads; the nq queries are the last nq keys."""
    n_new = 0
    if k_new is not None or v_new is not None:
        if k_new is None or v_new is None:
            raise PnMixError("give both new keys and new values, or neither")
        check_new_kv(layout, k_new, v_new)
        n_new = k_new.shape[2]
    if q.dim() != 4 or q.shape[0] != layout.batch or q.shape[3] != layout.head_dim or q.shape[1] % layout.kv_heads:
        raise PnMixError(
            f"queries must have shape [batch={layout.batch}, q_heads (a multiple of kv_heads="
            f"{layout.kv_heads}), nq, head_dim={layout.head_dim}], got {list(q.shape)}"
        )
    if q.shape[2] > seq_len + n_new:
        raise PnMixError(
            f"{q.shape[2]} queries but only {seq_len + n_new} keys: queries are the last positions"
        )


class CacheOps(ABC):
    """The two pn-mix mechanisms over a state dict, as one backend implements them. A state's
    tensors are written in place but never re-pointed (set_, resize_): a change of the state's
    memory replaces the tensors in the dict, which a backend may rely on to reuse what it checked."""

    name: str = "?"
    # Whether attend_append itself rounds new K/V to fp16 and refuses non-finite ones (PnMixError,
    # nothing changed): its caller may then hand them over as the model gave them, unchecked.
    checks_kv_values: bool = False

    def init_args(self) -> tuple:
        """The arguments that make these ops again (the constructor's)."""
        return ()

    def __reduce__(self):
        # A copy or a save of a cache (copy.deepcopy, pickle, torch.save) carries its ops as what
        # makes them, not as their state: the native ones hold ctypes library handles, which
        # cannot be pickled, and a copy binds the same library again.
        return (type(self), self.init_args())

    @abstractmethod
    def append(self, layout: CacheLayout, state: State, seq_len: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append fp16 K/V [B, H, n, D] in place (mask on the first append, flush when full)."""

    @abstractmethod
    def attend(self, q, layout: CacheLayout, state: State, seq_len: int, k_new, v_new) -> torch.Tensor:
        """fp32 [B, Hq, nq, D]: q over the cache then k_new/v_new (queries are the last nq)."""

    def attend_append(self, q, layout: CacheLayout, state: State, seq_len: int, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """A decode step: attend(q, ..., k, v), then append(..., k, v); the attention's output.
        k/v: fp16 K/V that fp16_kv passed, or any float K/V where checks_kv_values. A backend whose
        two calls share checks and buffers does both at once (the core: in one C call)."""
        out = self.attend(q, layout, state, seq_len, k, v)
        self.append(layout, state, seq_len, k, v)
        return out

    def attend_append_checked(self, q, layout: CacheLayout, state: State, seq_len: int, k: torch.Tensor,
                              v: torch.Tensor, query_as_fp16: bool = False) -> torch.Tensor:
        """attend_append for n >= 1 new tokens whose shapes, and the queries', the caller knows pass
        check_queries (and fit the cache): a backend may skip those checks (the core does).
        query_as_fp16: the queries count as rounded to fp16 (a backend may round them itself)."""
        if query_as_fp16 and q.dtype != torch.float16:
            q = q.to(torch.float16)
        return self.attend_append(q, layout, state, seq_len, k, v)


class ReferenceOps(CacheOps):
    """The PyTorch reference's ops (the ``torch`` backend): what every other backend is compared with."""

    name = "torch"

    def append(self, layout, state, seq_len, k, v):
        append_reference(layout, state, seq_len, k, v)

    def attend(self, q, layout, state, seq_len, k_new, v_new):
        return reference.attend(q, layout, state, seq_len, k_new, v_new)


class PackedKVCache:
    """A fixed-capacity pn-mix cache for a batch of equal-length sequences."""

    def __init__(
        self,
        config: PnMixConfig,
        kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        batch: int = 1,
        device: torch.device | str = "cpu",
        ops: Optional[CacheOps] = None,
    ):
        self.layout = CacheLayout(config, batch, kv_heads, head_dim, max_seq_len)
        self.device = torch.device(device)
        self.state: State = self.layout.empty_state(self.device, huge_pages=True)
        self.seq_len = 0
        self.saliency_computations = 0
        self.ops: CacheOps = ops if ops is not None else ReferenceOps()

    @property
    def config(self) -> PnMixConfig:
        return self.layout.config

    # ---- the two mechanisms ---------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append K/V [B, H, n, D] (stored as fp16); flushes full residuals; the first call sets the mask."""
        check_new_kv(self.layout, k, v)
        check_room(self.seq_len, k.shape[2], self.layout.max_seq_len)
        if k.shape[2]:
            self.append_fp16(*fp16_kv(k, v, self.device, self.seq_len))  # checked before the state changes

    # The transformers layer checks a step's K/V once, at its update (before the attention runs):
    # these two take K/V it checked, and skip a second pass.
    def append_fp16(self, k16: torch.Tensor, v16: torch.Tensor) -> None:
        """append for checked fp16 K/V (what fp16_kv returned for tensors check_new_kv passed)."""
        n = k16.shape[2]
        if n:
            check_room(self.seq_len, n, self.layout.max_seq_len)
            self.ops.append(self.layout, self.state, self.seq_len, k16, v16)
            self._appended(n)

    def attend_append_prechecked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 steady: bool = False) -> torch.Tensor:
        """A decode step: attend(q, k, v), then the append of k/v, in one backend call. k/v: shapes
        check_new_kv passed, values fp16_kv's, unless the ops check them (ops.checks_kv_values).
        steady: q's and k/v's shapes and dtypes are those of a step this cache took, with room for
        n >= 1 new tokens (a transformers layer's steady decode step), and the queries count as
        rounded to fp16: the checks are not made again, the backend may round the queries itself."""
        n = k.shape[2]
        if steady:
            out = self.ops.attend_append_checked(q, self.layout, self.state, self.seq_len, k, v, query_as_fp16=True)
        elif n == 0:
            return self.ops.attend(q, self.layout, self.state, self.seq_len, k, v)
        else:
            check_room(self.seq_len, n, self.layout.max_seq_len)
            out = self.ops.attend_append(q, self.layout, self.state, self.seq_len, k, v)
        self._appended(n)
        return out

    def _appended(self, n: int) -> None:
        if self.seq_len == 0:
            self.saliency_computations += 1  # the first append chose the pair mask
        self.seq_len += n

    def attend(self, q: torch.Tensor, k_new=None, v_new=None, return_probs: bool = False):
        """Attention of q [B, Hq, nq, D] over the cache and (optionally) not-yet-appended K/V."""
        check_queries(self.layout, self.seq_len, q, k_new, v_new)
        if return_probs:  # probabilities are the reference's business (metrics)
            return reference.attend(q, self.layout, self.state, self.seq_len, k_new, v_new, True)
        return self.ops.attend(q, self.layout, self.state, self.seq_len, k_new, v_new)

    # ---- inspection -------------------------------------------------------------------------
    def lengths(self):
        return self.layout.lengths(self.seq_len)

    def persistent_bytes(self) -> Dict[str, int]:
        return self.layout.persistent_bytes(self.seq_len, self.state)

    def dequantized(self):
        return reference.dequantize_cache(self.layout, self.state, self.seq_len)

    def pair_mask(self) -> torch.Tensor:
        from .packing import unpack_pair_mask

        return unpack_pair_mask(self.state["pair_mask"], self.layout.kv_heads, self.layout.pairs)

    def resized(self, capacity: int, rows: Optional[torch.Tensor] = None) -> "PackedKVCache":
        """A copy of this cache with room for `capacity` tokens, holding the sequences `rows`
        (indices into the batch; None: all), with the same ops, tokens and saliency count."""
        batch = self.layout.batch if rows is None else int(rows.numel())
        new = PackedKVCache(self.config, self.layout.kv_heads, self.layout.head_dim, capacity, batch=batch,
                            device=self.device, ops=self.ops)
        for name in STATE_NAMES:
            source = self.state[name] if rows is None else self.state[name].index_select(0, rows)
            # Only the group dimension differs between capacities: copy the common corner.
            new.state[name][tuple(slice(0, s) for s in source.shape)] = source
        new.seq_len = self.seq_len
        new.saliency_computations = self.saliency_computations
        return new

    # ---- state as plain tensors -------------------------------------------------------------
    def export_state(self) -> Dict[str, torch.Tensor]:
        """The state tensors as the ONNX graph and plugins take them (codes and mask as int8)."""
        out = {}
        for name in STATE_NAMES:
            t = self.state[name]
            out[name] = t.view(torch.int8) if t.dtype == torch.uint8 else t
        return out

    def import_state(self, tensors: Dict[str, torch.Tensor], seq_len: int) -> None:
        """Load state tensors (as export_state gives them) holding seq_len tokens. Everything is
        checked before anything changes (format.checked_state: what load_state checks for a dump)."""
        state, seq_len = checked_state(self.layout, tensors, seq_len, "imported cache state")
        for name in STATE_NAMES:
            self.state[name].copy_(state[name].to(self.device))
        self.seq_len = seq_len
