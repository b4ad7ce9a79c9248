"""PnMixCache: transformers' Cache interface over one packed pn-mix cache per layer.

transformers calls ``cache.update(k, v, layer_idx)`` in every attention layer and then attends over
the K/V that update returns. The pn-mix semantics (docs/METHOD.md section 2, docs/HF.md) map onto that as:

* prefill (the layer's first update): return the prompt's own K/V (full-precision attention), then
  append them to the packed cache: the pair mask comes from this layer's prefill keys.
* decode, dequantized path (any attention implementation): return the dequantized cache followed
  by the new tokens' own K/V, and append them only after building that copy, so a new token is
  seen in full precision in its own step even when its append flushes a group.
* decode, packed path (``attn_implementation="pnmix"``, see attention.py): return only the new
  tokens' K/V; the attention function reads the packed state through the backend kernels and then
  commits the append. The layer learns that it runs under the packed path from that function.

Capacity: a layer's packed state has a fixed number of group slots. With ``max_cache_len`` it is
allocated once for that many tokens; without, it starts at the prefill plus 256 tokens and doubles
when full (the used part is copied; persistent bytes never count the spare slots).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, List, Optional, Tuple, cast

import torch

from ..cache import CacheOps, PackedKVCache, check_kv_tensors, check_new_kv, check_room, fp16_kv, residual_stream
from ..config import MAX_SEQ_LEN, PnMixConfig
from ..errors import PnMixError, PnMixValueError
from ._deps import require_transformers
from .layer_step import SteadyDecode, Step, _last_step, batch_rows, check_repeats, take_step  # noqa: F401 (take_step: attention.py)
from .models import calling_model_config, pair_layout_for, resolve_config

require_transformers()
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402

GROWTH_HEADROOM = 256
SMALL_UPDATE_BYTES = 16 << 20  # updates whose fp16 copies are larger are checked against free memory first
COMPILE_REASON = ("PnMixCache runs its kernels eagerly (is_compileable is False): use torch.compile without "
                  "fullgraph, which breaks the graph around the cache")
# While recording the past (assisted decoding), a layer keeps the fp16 K/V of at most this many of
# its most recently flushed groups, so that crop can give their tokens back to the residual.
MAX_KEPT_GROUPS = 4


def choose_ops(device: torch.device, backend: Optional[str] = None):
    """The cache ops: the named backend, else the registry's default for the device."""
    from ..backends import default_ops, make_ops

    return make_ops(backend, str(device)) if backend is not None else default_ops(device)


class PnMixLayer(CacheLayerMixin):
    """One attention layer's cache: a PackedKVCache plus the not-yet-appended step, if any."""

    is_compileable = False
    is_sliding = False

    def __init__(self, config: PnMixConfig, layer_idx: int, max_cache_len: Optional[int] = None,
                 backend: Optional[str] = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.max_cache_len = max_cache_len
        self.backend = backend
        self.packed: Optional[PackedKVCache] = None
        self.ops: Optional[CacheOps] = None
        self.pending: Optional[Step] = None
        self.packed_attention = False  # set by the pnmix attention function
        self.peak_copy_bytes = 0  # largest dequantized K/V copy handed to the model's attention
        self.record_past = False  # keep the fp16 K/V of the groups each append flushes (crop gives them back)
        self.flushed: List[Tuple[torch.Tensor, torch.Tensor]] = []  # their K/V [B, H, group, D], oldest first
        self.prefill_tokens = 0  # the first append's tokens: the pair mask was chosen from them
        self.prefill_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # their fp16 K/V, while recording
        # Check a decode step's K/V values at its update even where the backend's attend_append checks
        # them (ops.checks_kv_values): a row of a padded batch, whose rows are all checked before any appends.
        self.check_at_update = False
        self.steady: Optional[SteadyDecode] = None

    # ---- transformers' layer interface ----------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, n, head_dim = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size = batch
        self.ops = choose_ops(self.device, self.backend)
        capacity = self.max_cache_len or self._rounded(n + GROWTH_HEADROOM)
        self.packed = PackedKVCache(self.config, kv_heads, head_dim, capacity, batch=batch,
                                    device=self.device, ops=self.ops)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        steady, packed = self.steady, self.packed
        # A steady decode step (SteadyDecode), checked here in a few comparisons: a model's layer
        # runs this with its code out of the caches, where every Python call costs microseconds.
        # No step pending, the past not recorded (an append's flushed groups are then kept).
        if (steady is not None and packed is not None and steady.packed is packed and self.pending is None
                and not self.record_past and isinstance(key_states, torch.Tensor)
                and isinstance(value_states, torch.Tensor)
                and (key_states.shape, key_states.dtype, value_states.shape, value_states.dtype) == steady.kv
                and packed.seq_len + key_states.shape[2] <= steady.limit):
            seq_before = packed.seq_len
            self._check_positions(kwargs.get("kwargs"), seq_before)
            step = Step(self, weakref.ref(key_states), seq_before, key_states, value_states, True, steady=True)
            self.pending = _last_step.step = step
            return key_states, value_states
        if self.pending is not None:
            # Only the pnmix attention reads the packed cache; any other one saw the new tokens alone.
            raise PnMixError(
                f"the last step of layer {self.layer_idx} was not attended by the pnmix attention (the model "
                "switched attention implementation, or that step failed): use a new PnMixCache"
            )
        # Validate first, change state after: a refused update leaves the layer as it was (its
        # capacity too).
        if self.packed is not None:
            check_new_kv(self.packed.layout, key_states, value_states)
        else:
            check_kv_tensors(key_states, value_states)
        seq_before = self.packed.seq_len if self.packed is not None else 0
        self._check_size(key_states, seq_before)  # before the fp16 copies: an expand()ed tensor costs nothing yet
        if self._backend_checks_step(seq_before):
            k_new, v_new = key_states, value_states  # rounded and checked by the step's one backend call
        else:
            k_new, v_new = fp16_kv(key_states, value_states, key_states.device, seq_before)
        self._check_positions(kwargs.get("kwargs"), seq_before)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self._reserve(n)
        packed = self.packed_cache()
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
        if seq_before == 0:
            # Prefill: full-precision attention over the prompt; the append sets the pair mask.
            keys, values = key_states, value_states
            self._append(k_new, v_new)
            pending = False
        elif self.packed_attention:
            keys, values = key_states, value_states
            pending = True
            self._note_steady(key_states, value_states, k_new, seq_before)
        else:
            k_cache, v_cache = packed.dequantized()
            keys = torch.cat([k_cache.to(key_states.dtype), key_states], dim=2)
            values = torch.cat([v_cache.to(value_states.dtype), value_states], dim=2)
            self._append(k_new, v_new)  # after the copy: this step sees its own tokens in fp16
            copy = sum(t.numel() * t.element_size() for t in (keys, values))
            self.peak_copy_bytes = max(self.peak_copy_bytes, copy)
            pending = False
        step = Step(self, weakref.ref(keys), seq_before, k_new, v_new, pending)
        self.pending = step if pending else None
        _last_step.step = step
        return keys, values

    def _note_steady(self, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, seq_before: int) -> None:
        """After a packed-path update's checks: the step later ones like it may skip them by, where
        the backend checks the values in its call (_backend_checks_step: not the torch or Triton
        backend, whose values fp16_kv checks at the update, nor a padded batch's row, whose rows are
        all checked before any appends), takes the model's K/V as they are (k_new is k: contiguous)
        and the step holds tokens (an empty one is an attend alone) but few (larger ones probe free
        memory first, an answer that may change)."""
        if (not self._backend_checks_step(seq_before) or k_new is not k or self.record_past
                or k.shape[2] == 0 or 2 * k.numel() * 2 > SMALL_UPDATE_BYTES):
            self.steady = None
            return
        packed = self.packed_cache()
        limit = packed.layout.max_seq_len
        if self.max_cache_len is not None:
            limit = min(limit, self.max_cache_len)
        kv = (k.shape, k.dtype, v.shape, v.dtype)
        known = self.steady
        query = known.query if known is not None and known.packed is packed and known.kv == kv else None
        self.steady = SteadyDecode(packed, kv, limit, query)

    def attend_pending(self, query: torch.Tensor) -> torch.Tensor:
        """The packed path (attention.py): queries [B, Hq, nq, D], rounded to fp16, over the packed
        cache and the pending step's new K/V, then that step's append; fp32 [B, Hq, nq, D]."""
        step, packed = self.pending, self.packed
        if step is None or packed is None:
            raise PnMixError(f"layer {self.layer_idx} has no step waiting for the pnmix attention")
        steady, signature = self.steady, (query.shape, query.dtype)
        fast = (step.steady and steady is not None and steady.packed is packed and steady.query == signature
                and not self.record_past)
        if not fast and query.dtype != torch.float16:  # (a steady step's backend rounds them: the core in
            query = query.to(torch.float16)             # its C call, without a torch cast)
        flushed = [] if fast else self._flushed_by(step.k_new, step.v_new)
        try:
            out = packed.attend_append_prechecked(query, step.k_new, step.v_new, steady=fast)
        finally:
            self.pending = None  # taken, or refused before anything changed: either way the step is over
        if not fast:
            if steady is not None and steady.packed is packed:
                steady.query = signature  # the backend's checks passed this query's shape
            self._keep_flushed(flushed)
        return out

    def _backend_checks_step(self, seq_before: int) -> bool:
        """Whether a decode step's K/V go to the backend as the model gave them: on the packed path,
        the backend's attend_append rounds and checks them itself (the core, in one C call)."""
        return (seq_before > 0 and self.packed_attention and not self.check_at_update
                and self.ops is not None and self.ops.checks_kv_values)

    def expected_mask(self, kv: int, nq: int, device) -> torch.Tensor:
        """The mask the pnmix attention accepts: the causal future hidden, [nq, kv]."""
        positions = torch.arange(kv - nq, kv, device=device).unsqueeze(-1)
        return torch.arange(kv, device=device).unsqueeze(0) <= positions

    def _append(self, k16: torch.Tensor, v16: torch.Tensor) -> None:
        """Append K/V that update checked (fp16) to the packed cache, recording the past."""
        packed = self.packed_cache()
        if packed.seq_len == 0:
            self.prefill_tokens = k16.shape[2]
            # assisted decoding's first forward is the prompt AND the first drafted tokens: a crop
            # into it redoes the prefill from these (the pair mask comes from the prefill's keys)
            self.prefill_kv = (k16, v16) if self.record_past else None
        flushed = self._flushed_by(k16, v16)
        packed.append_fp16(k16, v16)
        self._keep_flushed(flushed)

    def _flushed_by(self, k: torch.Tensor, v: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """While recording the past, the fp16 K/V [B, H, group, D] of each group an append of k/v
        (the step's, fp16 or as the model gave them) will flush, read before the append; else none."""
        if not self.record_past:
            return []
        k16, v16 = (t.detach().to(torch.float16) for t in (k, v))  # the model's K/V may carry autograd
        packed = self.packed_cache()
        before, after, stream_k, stream_v = residual_stream(packed.layout, packed.state, packed.seq_len, k16, v16)
        size = self.config.group_size
        parts = [slice(group * size, (group + 1) * size) for group in range(after.groups - before.groups)]
        return [(stream_k[:, :, part].clone(), stream_v[:, :, part].clone()) for part in parts]

    def _keep_flushed(self, flushed: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After the append that flushed them: keep them (the last MAX_KEPT_GROUPS) for crop."""
        self.flushed += flushed
        del self.flushed[:-MAX_KEPT_GROUPS]

    def packed_cache(self) -> PackedKVCache:
        """The layer's packed cache, made by its first update."""
        if self.packed is None:
            raise PnMixError(f"layer {self.layer_idx} of the PnMixCache holds no tokens yet (no update so far)")
        return self.packed

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if self.packed is None:
            return 0
        return self.packed.seq_len + (self.pending.k_new.shape[2] if self.pending is not None else 0)

    def get_max_length(self) -> int:
        return self.max_cache_len or -1

    def reset(self) -> None:
        self.packed = None
        self.pending = None
        self.steady = None  # (it holds the old state)
        self.is_initialized = False
        self.packed_attention = False
        self.peak_copy_bytes = 0
        self.flushed = []
        self.prefill_tokens = 0
        self.prefill_kv = None

    # ---- crop (assisted and speculative decoding) ------------------------------------------
    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Whether crop can take back any of the tokens appended since the last crop: while
        recording the past (activate_past_recording)."""
        return self.record_past

    def activate_past_recording(self) -> None:
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last tokens: crop(-n) removes n (transformers 5's meaning), crop(0) none;
        crop(m) with m > 0 keeps the first m (older transformers' max_length). Exact: the layer
        then holds what it would had it never seen them. Tokens still in the fp16 residual are
        simply dropped; tokens that an append flushed into a quantized group come back from the
        fp16 copy kept while recording the past (at most MAX_KEPT_GROUPS groups, since the last
        crop); a crop into the prefill redoes it from its fp16 K/V, kept while recording until the
        first crop; anything else is one line saying the lowest length it can crop to. Each crop
        ends the record: the tokens it keeps are accepted."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise PnMixValueError(f"crop: expected an integer number of tokens, got {tokens_to_remove!r}")
        if self.packed is None:
            return
        if self.pending is not None:
            raise PnMixError(f"crop: layer {self.layer_idx} is in the middle of a step (its attention has not run)")
        seq_len = self.packed.seq_len
        target = seq_len + tokens_to_remove if tokens_to_remove < 0 else (tokens_to_remove or seq_len)
        if target < 0:
            raise PnMixValueError(f"crop: cannot remove {-tokens_to_remove} tokens from a cache of {seq_len}")
        if target < seq_len:
            self._crop_to(target)
        self.flushed = []
        self.prefill_kv = None

    def _reachable(self, target: int) -> bool:
        """Whether the layer can go back to target tokens exactly."""
        packed = self.packed_cache()
        if target < self.prefill_tokens:
            return self.prefill_kv is not None
        now, then = packed.layout.lengths(packed.seq_len), packed.layout.lengths(target)
        return then.residual == 0 or then.groups >= now.groups - len(self.flushed)

    def _crop_to(self, target: int) -> None:
        packed = self.packed_cache()
        seq_len = packed.seq_len
        if not self._reachable(target):
            lowest = next(t for t in range(target, seq_len + 1) if self._reachable(t))
            why = (f"its pair mask was chosen from the {self.prefill_tokens}-token prefill"
                   if target < self.prefill_tokens else
                   f"tokens {target} on were quantized into groups and {len(self.flushed)} flushed group(s) are "
                   "kept in fp16 (cache.activate_past_recording() keeps them from the next step on)")
            raise PnMixError(f"PnMixCache cannot crop layer {self.layer_idx} from {seq_len} to {target} tokens: "
                             f"{why}; the lowest length it can crop to is {lowest}")
        if target < self.prefill_tokens and self.prefill_kv is not None:
            k16, v16 = self.prefill_kv
            layout = packed.layout
            self.packed = PackedKVCache(self.config, layout.kv_heads, layout.head_dim, layout.max_seq_len,
                                        batch=layout.batch, device=packed.device, ops=packed.ops)
            self.prefill_tokens = target
            if target:
                self.packed.append(k16[:, :, :target].contiguous(), v16[:, :, :target].contiguous())
            return
        now, then = packed.layout.lengths(seq_len), packed.layout.lengths(target)
        if then.residual:
            # the stream from the first token of group then.groups: the kept groups, then the residual
            kept = self.flushed[len(self.flushed) - (now.groups - then.groups):] if now.groups > then.groups else []
            for name, part in (("residual_k", 0), ("residual_v", 1)):
                stream = torch.cat([group[part] for group in kept] + [packed.state[name][:, :, :now.residual]], dim=2)
                packed.state[name][:, :, :then.residual] = stream[:, :, :then.residual]
        packed.seq_len = target

    # ---- the dequantized view ----------------------------------------------------------------
    # transformers 5 code reads and splices caches through layer.keys / layer.values. Here they are
    # the packed cache dequantized, in the model's dtype: a copy each time (writing to it changes
    # nothing), None before the first update. They cannot be assigned.
    @property
    def keys(self) -> Optional[torch.Tensor]:
        return self._dequantized(0)

    @keys.setter
    def keys(self, value: Any) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> Optional[torch.Tensor]:
        return self._dequantized(1)

    @values.setter
    def values(self, value: Any) -> None:
        self._refuse_assignment("values", value)

    def _dequantized(self, which: int) -> Optional[torch.Tensor]:
        if self.packed is None or self.packed.seq_len == 0:
            return None
        return self.packed.dequantized()[which].to(self.dtype)

    def _refuse_assignment(self, name: str, value: Any) -> None:
        if value is not None or getattr(self, "packed", None) is not None:  # CacheLayerMixin.__init__ sets None
            raise PnMixError(f"PnMixCache layer {name} is a dequantized copy of the packed cache and cannot be assigned")

    def offload(self):
        raise PnMixError("PnMixCache does not support offloading")

    def prefetch(self):
        raise PnMixError("PnMixCache does not support offloading")

    # Beam search and batch expansion: rebuild the packed state with the chosen rows (checked
    # first: a refused call changes nothing; the new state is built before it replaces the old).
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._install(self.selected(beam_idx, "reorder_cache"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._install(self.repeated(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._install(self.selected(indices, "batch_select_indices"))

    def selected(self, indices: Any, what: str) -> Optional[PackedKVCache]:
        """The packed cache holding the rows `indices` names (None: no tokens yet), the layer unchanged."""
        rows = batch_rows(indices, self.packed.layout.batch if self.packed is not None else None, what)
        if self.packed is None:
            return None
        return self.packed.resized(self.packed.layout.max_seq_len, rows.to(self.device))

    def repeated(self, repeats: Any) -> Optional[PackedKVCache]:
        batch = self.packed.layout.batch if self.packed is not None else None
        repeats = check_repeats(repeats, batch)
        if self.packed is None:
            return None
        rows = torch.arange(self.packed.layout.batch).repeat_interleave(repeats)
        return self.packed.resized(self.packed.layout.max_seq_len, rows.to(self.device))

    def _install(self, packed: Optional[PackedKVCache]) -> None:
        if packed is not None:
            self.packed = packed
            self.steady = None  # (it holds the old state)
            self.batch_size = packed.layout.batch
            self.flushed = []  # kept for the old rows: crop after a batch change stays within the residual

    # ---- bytes ---------------------------------------------------------------------------
    # The same two as PnMixCache's: persistent_bytes an int, bytes_by_part the split.
    def bytes_by_part(self) -> dict:
        if self.packed is None:
            return {"key_bytes": 0, "value_bytes": 0, "persistent_cache_bytes": 0}
        return self.packed.persistent_bytes()

    def persistent_bytes(self) -> int:
        return self.bytes_by_part()["persistent_cache_bytes"]

    def allocated_bytes(self) -> int:
        if self.packed is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.packed.state.values())

    # ---- helpers -------------------------------------------------------------------------
    def _rounded(self, tokens: int) -> int:
        group = self.config.group_size
        return max(group, math.ceil(tokens / group) * group)

    def _check_size(self, key_states: torch.Tensor, seq_before: int) -> None:
        """n new tokens must fit max_cache_len (or the layout's limit), and their fp16 copies memory."""
        n = key_states.shape[2]
        if self.max_cache_len is not None:
            check_room(seq_before, n, self.max_cache_len, " of PnMixCache", limit="max_cache_len")
        else:
            check_room(seq_before, n, MAX_SEQ_LEN, " of PnMixCache", limit="the layout's limit")
        need = 2 * key_states.numel() * 2
        if need > SMALL_UPDATE_BYTES:  # a decode step's few KB need no memory probe (/proc/meminfo)
            from ..memory import check_fits

            check_fits(need, f"the fp16 copies of {n} new K/V tokens of layer {self.layer_idx}",
                       "update with fewer tokens", str(key_states.device))

    def _reserve(self, n: int) -> None:
        """Make room for n more tokens: grow (double) the group slots, or refuse past max_cache_len."""
        packed = self.packed_cache()
        need = packed.seq_len + n
        if need <= packed.layout.max_seq_len:
            return
        if self.max_cache_len is not None:
            check_room(packed.seq_len, n, self.max_cache_len, " of PnMixCache", limit="max_cache_len")
        capacity = self._rounded(max(need, 2 * packed.layout.max_seq_len))
        self.packed = packed.resized(capacity)

    def _check_positions(self, forward_kwargs: Any, seq_len: int) -> None:
        """Refuse left-padded batches and inputs that do not continue the cached sequence."""
        positions = forward_kwargs.get("position_ids") if isinstance(forward_kwargs, dict) else None
        last = getattr(_checked_positions, "last", None)
        # _version: what an in-place change bumps (an inference-mode tensor has none: never kept here).
        # (positions is not None: a dead reference's None must not match a step without positions.)
        if last is not None and positions is not None and last[0]() is positions and last[1] == (positions._version, seq_len):
            return  # a step's other layers: the same tensor, found right at the same length
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.numel() == 0:
            return
        mark = None if positions.is_inference() else (positions._version, seq_len)
        if positions.shape[0] > 1 and not bool((positions == positions[:1]).all()):
            raise PnMixError(
                "PnMixCache takes a batch of equal-length prompts; these rows have different position ids "
                "(a left-padded batch?): pad-free prompts of one length, or one prompt per call"
            )
        start = int(positions[0, 0])
        if start != seq_len:
            raise PnMixError(
                f"position ids start at {start} but the cache holds {seq_len} tokens of layer "
                f"{self.layer_idx}: the input must continue the cached sequence (padding or a rewind?)"
            )
        if mark is not None:
            _checked_positions.last = (weakref.ref(positions), mark)


# The position ids the last update on this thread found right, and at which length: a step hands
# every layer the same tensor, and reading it (an index and an item) costs each of 30 layers
# microseconds with torch's code out of the caches after the layer's matrix products.
_checked_positions = threading.local()


class PnMixCache(Cache):
    """transformers' Cache with one packed pn-mix cache per layer (docs/HF.md).

    ``PnMixCache(config=None, **overrides)``: the pn-mix config (default: the manifest's values with
    ``pair_layout="half"``, the layout of HF's rotate_half), with field overrides. Keyword-only:
    ``max_cache_len`` (allocate once for that many tokens instead of growing), ``backend``
    ("torch", "core", "triton"; default: Triton on CUDA, the C++ core on CPU when built, else the
    reference), ``model_config`` (the model's config: checks the pair layout against its family).
    """

    def __init__(self, config: Optional[PnMixConfig] = None, *, max_cache_len: Optional[int] = None,
                 backend: Optional[str] = None, model_config: Any = None, **overrides: Any):
        self.config = resolve_config(config, overrides, model_config)
        # Without the model's config or a layout of the user's, the first update takes the layout
        # of the model that calls it (adopt_model_layout).
        self.layout_open = model_config is None and config is None and "pair_layout" not in overrides
        self.model_checked = model_config is not None
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise PnMixError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.backend = backend
        self.record_past = False
        super().__init__(layers=[])  # layers are made on first use, each knowing its index

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep what crop needs to take tokens back (transformers calls it before assisted
        decoding, before the prefill: layers made later record too). Keyword arguments are
        accepted and ignored: transformers 5.25 passes `recurrent_states_to_keep`, which concerns
        linear-attention layers; every token of an attention layer is kept anyway."""
        self.record_past = True
        for layer in self.pnmix_layers:
            layer.activate_past_recording()

    @property
    def is_croppable(self) -> bool:
        return self.record_past

    # torch.compile: the kernels are opaque calls (ctypes, Triton launches) and the packed state
    # changes with the data, so the cache's entry points run eagerly: without fullgraph the graph
    # breaks around them; fullgraph=True and torch.export stop at them (is_compileable is False).
    @torch.compiler.disable(reason=COMPILE_REASON)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Layers are made in order, on their first update: layer_idx is 0..len(layers); a new
        layer joins the cache only when its first update succeeds (a refused update changes nothing)."""
        made = len(self.layers)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx <= made:
            raise PnMixError(f"layer_idx must be an integer 0..{made} (layers are made in order from 0), "
                             f"got {layer_idx!r}")
        if not self.model_checked:
            self.adopt_model_layout(calling_model_config())
        if layer_idx < made:  # (self.layers, not pnmix_layers: a property call less per layer and decode step)
            layer: PnMixLayer = self.layers[layer_idx]  # type: ignore[assignment]
        else:
            layer = self._new_layer(layer_idx, key_states, kwargs)
        layer.record_past = layer.record_past or self.record_past
        out = layer.update(key_states, value_states, *args, **kwargs)
        if layer_idx == made:
            self.layers.append(layer)
        return out

    def adopt_model_layout(self, model_config: Any) -> None:
        """Before the first layer is made: the RoPE pair layout of the model that updates the cache
        (found on the call stack when no model_config was given). A default layout follows the
        model; one the user chose and the model contradicts is refused, as with model_config. On
        the dequantized path nothing else would notice: the saliency would pair the wrong channels."""
        if model_config is None or self.layers:
            return
        if self.layout_open:  # the user's other fields stay
            self.config = self.config.replace(pair_layout=pair_layout_for(model_config))
        else:
            resolve_config(self.config, {}, model_config)  # raises on a contradiction
        self.model_checked = True

    # Beam search and batch expansion: every layer's new state is built (and the arguments checked)
    # before any layer takes it, so a refused call, or one that runs out of memory, changes nothing.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._install([layer.selected(beam_idx, "reorder_cache") for layer in self._rows_layers()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._install([layer.selected(indices, "batch_select_indices") for layer in self._rows_layers()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._install([layer.repeated(repeats) for layer in self._rows_layers()])

    def _rows_layers(self) -> List[PnMixLayer]:
        """The layers a batch change rebuilds; with none yet, a dummy that checks the arguments only."""
        return self.pnmix_layers or [PnMixLayer(self.config, 0, self.max_cache_len, self.backend)]

    def _install(self, states: List[Optional[PackedKVCache]]) -> None:
        for layer, packed in zip(self.pnmix_layers, states):
            layer._install(packed)

    @torch.compiler.disable(reason=COMPILE_REASON)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise PnMixValueError(f"get_seq_length: layer_idx must be an integer >= 0, got {layer_idx!r}")
        return super().get_seq_length(layer_idx)

    def _new_layer(self, layer_idx: int, key_states: torch.Tensor, kwargs: dict) -> PnMixLayer:
        """A PnMixLayer, or for a left-padded batch (its prefill's position ids say so) a
        RowsLayer: one PnMixLayer per row, fed the row's own tokens (pnmix/hf/padded.py)."""
        forward_kwargs = kwargs.get("kwargs")
        positions = forward_kwargs.get("position_ids") if isinstance(forward_kwargs, dict) else None
        from .padded import RowsLayer, left_pads

        pads = left_pads(positions, key_states.shape[2]) if key_states.dim() == 4 else None
        if pads is None:
            return PnMixLayer(self.config, layer_idx, self.max_cache_len, self.backend)
        rows = RowsLayer(lambda: PnMixLayer(self.config, layer_idx, self.max_cache_len, self.backend), pads, layer_idx)
        return cast(PnMixLayer, rows)

    @property
    def pnmix_layers(self) -> List[PnMixLayer]:
        """self.layers as what they are: update() appends PnMixLayers only (transformers types the
        list with every layer kind it has)."""
        return cast(List[PnMixLayer], self.layers)

    def mark_packed_attention(self) -> None:
        """Decode every layer under the pnmix attention from now on. A prefill forward call under
        that attention says so itself; a cache whose prefill K/V came through update() outside a
        forward call (pnmix eval hands one prefill to many caches) says so here."""
        for layer in self.pnmix_layers:
            layer.packed_attention = True

    def persistent_bytes(self) -> int:
        """Bytes the cache holds: the used part of every layer's packed state (docs/METHOD.md section 3.5)."""
        return sum(layer.persistent_bytes() for layer in self.pnmix_layers)

    def bytes_by_part(self) -> dict:
        """key_bytes, value_bytes and persistent_cache_bytes summed over layers."""
        total = {"key_bytes": 0, "value_bytes": 0, "persistent_cache_bytes": 0}
        for layer in self.pnmix_layers:
            for name, value in layer.bytes_by_part().items():
                total[name] += value
        return total

    def allocated_bytes(self) -> int:
        """Bytes of the state tensors as allocated (capacity, spare group slots included)."""
        return sum(layer.allocated_bytes() for layer in self.pnmix_layers)

    def peak_copy_bytes(self) -> int:
        """The largest dequantized K/V copy one layer handed to the model's attention (0 on the
        packed path): the scratch the dequantized path costs, on top of persistent_bytes()."""
        return max((layer.peak_copy_bytes for layer in self.pnmix_layers), default=0)

    @property
    def ops_name(self) -> Optional[str]:
        """The backend whose kernels serve the layers (known once a layer is initialized)."""
        for layer in self.pnmix_layers:
            if layer.ops is not None:
                return layer.ops.name
        return None

    def __repr__(self) -> str:
        return f"PnMixCache(layers={len(self.layers)}, tokens={self.get_seq_length()}, config={self.config})"
