"""The packed cache format: the layout of the state tensors, their byte accounting and the checks
of a state given as tensors.

This module is the single Python statement of docs/FORMAT.md sections 1-3 and 5 (pnmix.packing holds
the bit streams, pnmix.dump the .pnkv dump of section 6). Everything else (the cache, the reference
kernels, the ONNX exporter, the backends) asks it for shapes, offsets and bytes;
``plugins/include/pnmix/format.h`` is the C++ statement of the same document.

Conventions (see docs/FORMAT.md for the full text):
* Keys of one group and KV head: channel after channel in natural channel order; channel c holds
  its ``group_size`` token codes at ``bits(c)`` bits each (pnmix.packing's LSB-first streams), so its
  byte offset is ``group_size / 8 * sum(bits(c') for c' < c)``.
* Values: one stream of ``head_dim`` codes per token and KV head.
* The pair mask: bit ``h * P + p`` set when pair p of KV head h is high.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, Mapping, NamedTuple, Tuple

import torch

from .config import MAX_BATCH, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_SEQ_LEN, MAX_STATE_TENSOR_BYTES, PAIR_LAYOUTS, PnMixConfig
from .errors import PnMixError, one_line
from .packing import pack_codes, unpack_codes

# ---------------------------------------------------------------------------------------
# Pairs of channels
# ---------------------------------------------------------------------------------------


def channel_pairs(head_dim: int, pair_layout: str) -> torch.Tensor:
    """pair index of each channel: adjacent pairs (2p, 2p+1), half pairs (p, p + D/2)."""
    channels = torch.arange(head_dim)
    if pair_layout == "adjacent":
        return channels // 2
    if pair_layout == "half":
        return channels % (head_dim // 2)
    raise PnMixError(f"pair_layout must be one of {', '.join(PAIR_LAYOUTS)}, got {pair_layout!r}")


# ---------------------------------------------------------------------------------------
# The layout: shapes of the state tensors for a given capacity
# ---------------------------------------------------------------------------------------


class Lengths(NamedTuple):
    """Where the tokens of a cache of seq_len tokens are: sink, groups, residual."""

    sink: int
    groups: int
    residual: int


# How the C calls read a query buffer (pnmix_core.h's q_is_fp32 argument, by index): fp16 bits,
# fp32 as it is, or fp32 rounded to fp16 first, as a cast to fp16 would round it (a transformers
# decode step's queries: the cast's torch call costs more than the rounding).
QUERY_ENCODINGS = ("fp16", "fp32", "fp32_as_fp16")

# Order and dtypes of the state tensors. ONNX input/output names, the C ABI's buffer order and
# the .pnkv dump all follow this list.
STATE_NAMES: Tuple[str, ...] = (
    "sink_k",
    "sink_v",
    "residual_k",
    "residual_v",
    "key_codes",
    "key_step",
    "key_offset",
    "value_codes",
    "value_step",
    "value_offset",
    "pair_mask",
)
STATE_DTYPES: Dict[str, torch.dtype] = {
    "sink_k": torch.float16,
    "sink_v": torch.float16,
    "residual_k": torch.float16,
    "residual_v": torch.float16,
    "key_codes": torch.uint8,
    "key_step": torch.float16,
    "key_offset": torch.float16,
    "value_codes": torch.uint8,
    "value_step": torch.float16,
    "value_offset": torch.float16,
    "pair_mask": torch.uint8,
}


@dataclass(frozen=True)
class CacheLayout:
    """Shapes, offsets and byte counts of a packed cache (docs/FORMAT.md sections 1-3 and 5)."""

    config: PnMixConfig
    batch: int
    kv_heads: int
    head_dim: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for name in ("batch", "kv_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PnMixError(f"{name} must be a positive integer, got {value!r}")
        self.config.check_head_dim(self.head_dim)
        # The C core's limits (params.h, applied by format.h layout_error), so every backend
        # takes the same layouts.
        for name, most in (("batch", MAX_BATCH), ("kv_heads", MAX_KV_HEADS), ("head_dim", MAX_HEAD_DIM),
                           ("max_seq_len", MAX_SEQ_LEN)):
            if getattr(self, name) > most:
                raise PnMixError(f"{name} must be <= {most}, got {getattr(self, name)}")
        for name, shape in self.state_shapes().items():
            if math.prod(shape) * STATE_DTYPES[name].itemsize > MAX_STATE_TENSOR_BYTES:
                raise PnMixError(f"cache too large: state tensor '{name}' {shape} would exceed 2^50 bytes")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def pairs(self) -> int:
        return self.head_dim // 2

    @property
    def value_block(self) -> int:
        return self.config.value_block(self.head_dim)

    @property
    def value_blocks(self) -> int:
        return self.head_dim // self.value_block

    @property
    def high_channels(self) -> int:
        return 2 * self.config.high_pairs(self.head_dim)

    @property
    def low_channels(self) -> int:
        return self.head_dim - self.high_channels

    @property
    def key_group_bytes(self) -> int:
        """Packed key bytes of one group and KV head (all channels, mixed bits)."""
        cfg = self.config
        bits = self.high_channels * cfg.key_high_bits + self.low_channels * cfg.key_low_bits
        return cfg.group_size * bits // 8

    @property
    def value_token_bytes(self) -> int:
        """Packed value bytes of one token and KV head."""
        return self.head_dim * self.config.value_bits // 8

    @property
    def mask_bytes(self) -> int:
        return math.ceil(self.kv_heads * self.pairs / 8)

    @property
    def max_groups(self) -> int:
        return self.lengths(self.max_seq_len).groups

    # ---- the append/flush schedule, closed form ---------------------------------------------
    def lengths(self, seq_len: int) -> Lengths:
        """Token counts of a cache that has taken seq_len tokens and been flushed (docs/METHOD.md section 2)."""
        cfg = self.config
        sink = min(seq_len, cfg.sink_tokens)
        rest = seq_len - sink
        groups = 0 if rest < cfg.residual_size else (rest - cfg.residual_size) // cfg.group_size + 1
        return Lengths(sink, groups, rest - groups * cfg.group_size)

    # ---- state tensors --------------------------------------------------------------------
    def state_shapes(self) -> Dict[str, Tuple[int, ...]]:
        b, h, d, cfg = self.batch, self.kv_heads, self.head_dim, self.config
        g, gs = self.max_groups, cfg.group_size
        return {
            "sink_k": (b, h, cfg.sink_tokens, d),
            "sink_v": (b, h, cfg.sink_tokens, d),
            "residual_k": (b, h, cfg.residual_size, d),
            "residual_v": (b, h, cfg.residual_size, d),
            "key_codes": (b, h, g, self.key_group_bytes),
            "key_step": (b, h, g, d),
            "key_offset": (b, h, g, d),
            "value_codes": (b, h, g, gs, self.value_token_bytes),
            "value_step": (b, h, g, gs, self.value_blocks),
            "value_offset": (b, h, g, gs, self.value_blocks),
            "pair_mask": (b, self.mask_bytes),
        }

    def check_state_shapes(self, tensors: Mapping[str, Any]) -> None:
        """Every state tensor present, of its capacity shape and of its dtype's element size (torch
        tensors or numpy arrays; codes and mask may come as int8): what a consumer of a state dict
        checks before it reads one. A one-line PnMixError names the first tensor that is not."""
        shapes = self.state_shapes()
        for name in STATE_NAMES:
            t = tensors.get(name)
            if t is None:
                raise PnMixError(f"cache state is missing tensor '{name}'")
            if tuple(t.shape) != shapes[name]:
                raise PnMixError(f"state tensor '{name}' has shape {list(t.shape)}, the layout needs {list(shapes[name])}")
            itemsize = t.element_size() if isinstance(t, torch.Tensor) else t.dtype.itemsize
            if itemsize != STATE_DTYPES[name].itemsize:
                raise PnMixError(f"state tensor '{name}' has dtype {t.dtype}, the layout needs {STATE_DTYPES[name]}")

    @property
    def state_bytes(self) -> int:
        """Bytes of all state tensors at capacity (what empty_state allocates)."""
        return sum(math.prod(shape) * STATE_DTYPES[name].itemsize for name, shape in self.state_shapes().items())

    def describe(self) -> str:
        return (f"batch {self.batch}, kv_heads {self.kv_heads}, head_dim {self.head_dim}, max_seq_len "
                f"{self.max_seq_len}, sink_tokens {self.config.sink_tokens}, residual_size {self.config.residual_size}")

    def empty_state(self, device: torch.device | str = "cpu", huge_pages: bool = False) -> Dict[str, torch.Tensor]:
        """Every state tensor at capacity, zeroed. huge_pages: a cache that lives for many decode
        steps (PackedKVCache, the benchmarks'): on the host, on transparent huge pages where it spans
        one (memory.zeros_on_huge_pages says why); a scratch state made and dropped per call stays
        on torch's pages, which its allocator reuses without a fault per page."""
        from .memory import check_fits, huge_pages_wanted, zeros_on_huge_pages

        specs = {name: (shape, STATE_DTYPES[name]) for name, shape in self.state_shapes().items()}
        check_fits(self.state_bytes, f"the cache state ({self.describe()})", "lower max_seq_len or batch",
                   str(device))
        # the switch first, on every device: a wrong PNMIX_HUGE_PAGES is an error wherever it is set
        huge_pages = huge_pages_wanted() and huge_pages and torch.device(device).type == "cpu"
        try:
            on_huge_pages = zeros_on_huge_pages(specs) if huge_pages else None
            return on_huge_pages or {name: torch.zeros(shape, dtype=dtype, device=device)
                                     for name, (shape, dtype) in specs.items()}
        except RuntimeError as exc:  # out of memory, or a size torch cannot even represent
            raise PnMixError(
                f"cannot allocate the cache state: {self.state_bytes} bytes for {self.describe()} on {device} "
                f"({one_line(exc, 120)})"
            ) from None

    def used_slices(self, seq_len: int) -> Dict[str, Tuple[slice, ...]]:
        """Index of the persistent (used) part of each state tensor at seq_len tokens."""
        n = self.lengths(seq_len)
        everything = slice(None)
        used: Dict[str, Tuple[slice, ...]] = {
            "sink_k": (everything, everything, slice(0, n.sink)),
            "residual_k": (everything, everything, slice(0, n.residual)),
            "key_codes": (everything, everything, slice(0, n.groups)),
            "pair_mask": (everything,) if seq_len > 0 else (slice(0, 0),),
        }
        used["sink_v"], used["residual_v"] = used["sink_k"], used["residual_k"]
        for name in ("key_step", "key_offset", "value_codes", "value_step", "value_offset"):
            used[name] = used["key_codes"]
        return used

    # ---- byte accounting ------------------------------------------------------------------
    def persistent_bytes(self, seq_len: int, state: Dict[str, torch.Tensor] | None = None) -> Dict[str, int]:
        """key/value/total persistent bytes: the used part of each state tensor, measured on
        ``state`` when given (else on tensors of this layout's shapes)."""
        shapes = self.state_shapes()
        sizes = {}
        for name, index in self.used_slices(seq_len).items():
            tensor = state[name] if state is not None else torch.empty(
                shapes[name], dtype=STATE_DTYPES[name], device="meta")
            used = tensor[index]
            sizes[name] = used.numel() * used.element_size()
        key = sum(sizes[n] for n in STATE_NAMES if n.startswith(("sink_k", "residual_k", "key_", "pair_")))
        value = sum(sizes[n] for n in STATE_NAMES if n.startswith(("sink_v", "residual_v", "value_")))
        return {"key_bytes": key, "value_bytes": value, "persistent_cache_bytes": key + value}

    # ---- per-channel key bit widths ---------------------------------------------------------
    def channel_bits(self, high_pairs: torch.Tensor) -> torch.Tensor:
        """bool [..., P] high pairs -> int32 [..., D] bits per channel."""
        pair_of = channel_pairs(self.head_dim, self.config.pair_layout).to(high_pairs.device)
        high = high_pairs[..., pair_of]
        cfg = self.config
        return torch.where(high, cfg.key_high_bits, cfg.key_low_bits).to(torch.int32)

    def key_channel_offsets(self, channel_bits: torch.Tensor) -> torch.Tensor:
        """[..., D] bits -> [..., D] byte offset of each channel's stream in a key group."""
        starts = torch.cumsum(channel_bits, dim=-1) - channel_bits
        return (starts * (self.config.group_size // 8)).to(torch.int64)

    # ---- key and value groups: pack / unpack --------------------------------------------------
    def pack_key_group(self, codes: torch.Tensor, channel_bits: torch.Tensor) -> torch.Tensor:
        """codes uint8 [R, D, gs] (R rows of KV heads), bits [R, D] -> uint8 [R, key_group_bytes]."""
        rows, d, gs = codes.shape
        out = torch.zeros(rows, self.key_group_bytes, dtype=torch.uint8, device=codes.device)
        offsets = self.key_channel_offsets(channel_bits)
        for bits in torch.unique(channel_bits).tolist():
            select = channel_bits == bits
            packed = pack_codes(codes[select], bits)  # [n_sel, gs*bits/8]
            dest = offsets[select].unsqueeze(-1) + torch.arange(packed.shape[-1], device=codes.device)
            row = select.nonzero()[:, 0].unsqueeze(-1).expand_as(dest)
            out[row, dest] = packed
        return out

    def unpack_key_group(self, packed: torch.Tensor, channel_bits: torch.Tensor) -> torch.Tensor:
        """uint8 [R, key_group_bytes], bits [R, D] -> codes uint8 [R, D, gs]."""
        rows = packed.shape[0]
        gs = self.config.group_size
        codes = torch.zeros(rows, self.head_dim, gs, dtype=torch.uint8, device=packed.device)
        offsets = self.key_channel_offsets(channel_bits)
        for bits in torch.unique(channel_bits).tolist():
            select = channel_bits == bits
            width = gs * bits // 8
            src = offsets[select].unsqueeze(-1) + torch.arange(width, device=packed.device)
            row = select.nonzero()[:, 0].unsqueeze(-1).expand_as(src)
            codes[select] = unpack_codes(packed[row, src], bits, gs)
        return codes

    def pack_value_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        """codes uint8 [..., D] -> uint8 [..., value_token_bytes]."""
        return pack_codes(codes, self.config.value_bits)

    def unpack_value_tokens(self, packed: torch.Tensor) -> torch.Tensor:
        return unpack_codes(packed, self.config.value_bits, self.head_dim)


# ---------------------------------------------------------------------------------------
# A state given as tensors: the checks a .pnkv dump's reader also makes (pnmix.dump)
# ---------------------------------------------------------------------------------------


def check_pair_mask(layout: CacheLayout, mask: torch.Tensor, what: str) -> None:
    """Key group offsets follow from the mask, so a mask with the wrong number of high pairs
    would make every reader walk the codes at the wrong offsets (docs/FORMAT.md 3.2)."""
    bits = unpack_codes(mask.view(torch.uint8), 1, mask.shape[-1] * 8)
    used = layout.kv_heads * layout.pairs
    if bits[:, used:].any():
        raise PnMixError(f"{what}'s pair_mask has set bits past the last pair (must be 0)")
    high = bits[:, :used].reshape(-1, layout.kv_heads, layout.pairs).sum(-1)
    want = layout.config.high_pairs(layout.head_dim)
    if (high != want).any():
        raise PnMixError(
            f"{what}'s pair_mask marks {int(high[high != want][0])} high pairs in a KV head, "
            f"the config (high_ratio {layout.config.high_ratio}) gives {want}"
        )


def checked_state(layout: CacheLayout, tensors: Mapping[str, Any], seq_len: Any,
                  what: str) -> Tuple[Dict[str, torch.Tensor], int]:
    """A state given as tensors (PackedKVCache.import_state, the ONNX backend's load_state),
    checked as load_state checks a dump: seq_len an integer (not a bool or a float) within the
    capacity; every tensor present, a torch tensor of its exact shape and dtype (codes and mask
    uint8 or int8, as export_state gives them; fp16 parts fp16, never other 16-bit types taken as
    fp16 bits); then check_state_values. Returns the tensors viewed as STATE_DTYPES, and seq_len."""
    if isinstance(seq_len, bool):
        raise PnMixError(f"{what}: seq_len must be an integer, got {seq_len!r}")
    try:
        seq_len = operator.index(seq_len)
    except TypeError:
        raise PnMixError(f"{what}: seq_len must be an integer, got {seq_len!r}") from None
    if not 0 <= seq_len <= layout.max_seq_len:
        raise PnMixError(f"{what}: seq_len {seq_len} outside 0..{layout.max_seq_len}")
    if not isinstance(tensors, Mapping):
        raise PnMixError(f"{what} must be a dict of tensors by name, got {type(tensors).__name__}")
    missing = [n for n in STATE_NAMES if n not in tensors]
    if missing:
        raise PnMixError(f"{what} is missing tensor '{missing[0]}'")
    shapes, state = layout.state_shapes(), {}
    for name in STATE_NAMES:
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise PnMixError(f"{what}: state tensor '{name}' must be a torch tensor, got {type(t).__name__}")
        if tuple(t.shape) != shapes[name]:
            raise PnMixError(f"{what}: state tensor '{name}' has shape {list(t.shape)}, expected {list(shapes[name])}")
        want = STATE_DTYPES[name]
        if t.dtype != want and not (want == torch.uint8 and t.dtype == torch.int8):
            allowed = "uint8 or int8" if want == torch.uint8 else str(want).replace("torch.", "")
            raise PnMixError(f"{what}: state tensor '{name}' has dtype {str(t.dtype).replace('torch.', '')}, "
                             f"expected {allowed}")
        state[name] = t.view(want)
    check_state_values(layout, state, seq_len, what)
    return state, seq_len


def check_state_values(layout: CacheLayout, state: Dict[str, torch.Tensor], seq_len: int, what: str) -> None:
    """The values of a state given whole (not decoded from a dump): the pair mask as load_state
    checks it, and finite fp16 values in the used part (a cache only ever stores finite K/V, steps
    and offsets)."""
    used = layout.used_slices(seq_len)
    for name in STATE_NAMES:
        if STATE_DTYPES[name] == torch.float16 and not bool(torch.isfinite(state[name][used[name]]).all()):
            raise PnMixError(f"{what}: state tensor '{name}' holds NaN or Inf in its used part")
    if seq_len:
        check_pair_mask(layout, state["pair_mask"], what)
