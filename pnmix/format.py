"""The packed cache format: layout, byte accounting, bit packing and the .pnkv dump.

This module is the single Python statement of docs/FORMAT.md. Everything else (the cache, the
reference kernels, the ONNX exporter, the backends) asks it for shapes, offsets and bytes;
``plugins/include/pnmix/format.h`` is the C++ statement of the same document.

Conventions (see docs/FORMAT.md for the full text):
* Bit streams are LSB-first: code i of a b-bit stream occupies stream bits [i*b, (i+1)*b), and
  stream bit k is bit (k % 8) of byte k // 8. A code may straddle two bytes (b = 3, 5, 6, 7).
* Keys of one group and KV head: channel after channel in natural channel order; channel c holds
  its ``group_size`` token codes at ``bits(c)`` bits each, so its byte offset is
  ``group_size / 8 * sum(bits(c') for c' < c)``.
* Values: one stream of ``head_dim`` codes per token and KV head.
* The pair mask: bit ``h * P + p`` set when pair p of KV head h is high.
"""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, NamedTuple, Tuple

import torch

from .config import (
    CONFIG_FIELDS, MAX_BATCH, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_SEQ_LEN, MAX_STATE_TENSOR_BYTES, PAIR_LAYOUTS, PnMixConfig,
)
from .errors import PnMixError, one_line

# ---------------------------------------------------------------------------------------
# Bit packing (dense, LSB-first)
# ---------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes [..., n] (each < 2**bits) into uint8 [..., n * bits / 8]."""
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise PnMixError(f"cannot pack {n} codes of {bits} bits densely into whole bytes")
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., n, bits]
    stream = stream.reshape(*codes.shape[:-1], n * bits // 8, 8)
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [..., n * bits / 8] -> uint8 codes [..., n]."""
    if packed.shape[-1] * 8 != n * bits:
        raise PnMixError(
            f"packed stream of {packed.shape[-1]} bytes does not hold {n} codes of {bits} bits"
        )
    raw = packed.to(torch.int32)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((raw.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], n, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.uint8)


# ---------------------------------------------------------------------------------------
# The pair mask and per-channel bit widths
# ---------------------------------------------------------------------------------------


def channel_pairs(head_dim: int, pair_layout: str) -> torch.Tensor:
    """pair index of each channel: adjacent pairs (2p, 2p+1), half pairs (p, p + D/2)."""
    channels = torch.arange(head_dim)
    if pair_layout == "adjacent":
        return channels // 2
    if pair_layout == "half":
        return channels % (head_dim // 2)
    raise PnMixError(f"pair_layout must be one of {', '.join(PAIR_LAYOUTS)}, got {pair_layout!r}")


def pack_pair_mask(high_pairs: torch.Tensor) -> torch.Tensor:
    """bool [B, H, P] -> uint8 [B, ceil(H*P/8)], bit h*P + p LSB-first."""
    batch = high_pairs.shape[0]
    flat = high_pairs.reshape(batch, -1).to(torch.uint8)
    nbits = flat.shape[1]
    padded = torch.zeros(batch, math.ceil(nbits / 8) * 8, dtype=torch.uint8, device=flat.device)
    padded[:, :nbits] = flat
    return pack_codes(padded, 1)


def unpack_pair_mask(mask_bytes: torch.Tensor, kv_heads: int, pairs: int) -> torch.Tensor:
    """uint8 [B, ceil(H*P/8)] -> bool [B, H, P]."""
    bits = unpack_codes(mask_bytes, 1, mask_bytes.shape[-1] * 8)
    return bits[:, : kv_heads * pairs].reshape(-1, kv_heads, pairs).bool()


# ---------------------------------------------------------------------------------------
# The layout: shapes of the state tensors for a given capacity
# ---------------------------------------------------------------------------------------


class Lengths(NamedTuple):
    """Where the tokens of a cache of seq_len tokens are: sink, groups, residual."""

    sink: int
    groups: int
    residual: int


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
        """Token counts of a cache that has taken seq_len tokens and been flushed (SPEC 2)."""
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


    def check_state(self, tensors: Mapping[str, Any]) -> None:
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

    def empty_state(self, device: torch.device | str = "cpu") -> Dict[str, torch.Tensor]:
        from .memory import check_fits

        shapes = self.state_shapes()
        check_fits(self.state_bytes, f"the cache state ({self.describe()})", "lower max_seq_len or batch",
                   str(device))
        try:
            return {name: torch.zeros(shape, dtype=STATE_DTYPES[name], device=device)
                    for name, shape in shapes.items()}
        except RuntimeError as exc:  # out of memory, or a size torch cannot even represent
            raise PnMixError(
                f"cannot allocate the cache state: {self.state_bytes} bytes for {self.describe()} on {device} "
                f"({one_line(exc, 120)})"
            ) from None

    def used_slices(self, seq_len: int) -> Dict[str, Tuple[slice, ...]]:
        """Index of the persistent (used) part of each state tensor at seq_len tokens."""
        n = self.lengths(seq_len)
        everything = slice(None)
        used = {
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
# The .pnkv dump: a self-describing file of the persistent bytes (docs/FORMAT.md section 6)
# ---------------------------------------------------------------------------------------

DUMP_MAGIC = b"PNKV"
DUMP_VERSION = 1
# The header's fields in file order with their struct codes (little-endian, no padding): the
# one statement of the header (docs/FORMAT.md section 6). The C core reads the offsets from
# generated.h (PNMIX_DUMP_AT_*), which pnmix/codegen.py writes from this table.
DUMP_HEADER_FIELDS: Tuple[Tuple[str, str], ...] = (
    ("magic", "4s"), ("version", "H"), ("header_bytes", "H"),
    ("group_size", "I"), ("residual_size", "I"), ("sink_tokens", "I"), ("value_group_size", "I"),
    ("value_bits", "B"), ("key_high_bits", "B"), ("key_low_bits", "B"), ("pair_layout", "B"),
    ("batch", "I"), ("kv_heads", "I"), ("head_dim", "I"), ("reserved0", "I"),
    ("high_ratio", "d"), ("seq_len", "Q"), ("reserved1", "I"),
)
_DUMP_HEADER = struct.Struct("<" + "".join(code for _, code in DUMP_HEADER_FIELDS))
DUMP_HEADER_BYTES = _DUMP_HEADER.size  # 64


def dump_header_offsets() -> Dict[str, int]:
    """Byte offset of each header field."""
    offsets, at = {}, 0
    for name, code in DUMP_HEADER_FIELDS:
        offsets[name] = at
        at += struct.calcsize("<" + code)
    return offsets


# Unused sink/residual capacity a loaded state may add beyond the file's own bytes (generated.h
# PNMIX_DUMP_SLACK_BYTES).
DUMP_SLACK_BYTES = 1 << 30


def _dump_sections(layout: CacheLayout, seq_len: int) -> Iterator[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of each stored section, in STATE_NAMES order, used part only."""
    shapes = layout.state_shapes()
    used = layout.used_slices(seq_len)
    for name in STATE_NAMES:
        probe = torch.empty(shapes[name], dtype=STATE_DTYPES[name], device="meta")[used[name]]
        yield name, tuple(probe.shape)


def dump_state(layout: CacheLayout, state: Dict[str, torch.Tensor], seq_len: int) -> bytes:
    """Serialize the persistent part of a cache state (little-endian)."""
    cfg = layout.config
    fields = {**cfg.to_dict(), "magic": DUMP_MAGIC, "version": DUMP_VERSION, "header_bytes": DUMP_HEADER_BYTES,
              "pair_layout": PAIR_LAYOUTS.index(cfg.pair_layout), "high_ratio": float(cfg.high_ratio),
              "batch": layout.batch, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim, "seq_len": seq_len,
              "reserved0": 0, "reserved1": 0}
    header = _DUMP_HEADER.pack(*(fields[name] for name, _ in DUMP_HEADER_FIELDS))
    used = layout.used_slices(seq_len)
    parts = [header]
    for name in STATE_NAMES:
        tensor = state[name][used[name]].contiguous().cpu()
        parts.append(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return b"".join(parts)


def load_state(blob: bytes) -> Tuple[CacheLayout, Dict[str, torch.Tensor], int]:
    """Parse a .pnkv dump; the layout's capacity is the dump's seq_len. Checks every size."""
    if len(blob) < DUMP_HEADER_BYTES:
        raise PnMixError(f"pnkv dump too short: {len(blob)} bytes, header needs {DUMP_HEADER_BYTES}")
    header = dict(zip((name for name, _ in DUMP_HEADER_FIELDS), _DUMP_HEADER.unpack_from(blob)))
    magic, version, header_bytes = header["magic"], header["version"], header["header_bytes"]
    _reserved, _reserved2, layout_index = header["reserved0"], header["reserved1"], header["pair_layout"]
    batch, kv_heads, head_dim, seq_len = header["batch"], header["kv_heads"], header["head_dim"], header["seq_len"]
    sink_tokens, residual_size = header["sink_tokens"], header["residual_size"]
    if magic != DUMP_MAGIC:
        raise PnMixError(f"not a pnkv dump: magic {magic!r}, expected {DUMP_MAGIC!r}")
    if version != DUMP_VERSION or header_bytes != DUMP_HEADER_BYTES:
        raise PnMixError(f"unsupported pnkv dump version {version} (header {header_bytes} bytes)")
    if _reserved or _reserved2:
        raise PnMixError(f"pnkv dump has non-zero reserved header fields ({_reserved}, {_reserved2})")
    if layout_index >= len(PAIR_LAYOUTS):
        raise PnMixError(f"pnkv dump has an unknown pair_layout code {layout_index}")
    if seq_len > MAX_SEQ_LEN:
        raise PnMixError(f"pnkv dump claims an implausible seq_len {seq_len}")
    config = PnMixConfig(**{name: header[name] for name in CONFIG_FIELDS if name != "pair_layout"},
                         pair_layout=PAIR_LAYOUTS[layout_index])
    layout = CacheLayout(config, batch, kv_heads, head_dim, max(seq_len, 1))
    # The state holds full sink/residual rows; a 64-byte header must not make us allocate
    # (or overflow torch's size arithmetic on) more than the file plus a bounded slack.
    capacity = layout.state_bytes
    if capacity > len(blob) + DUMP_SLACK_BYTES:
        raise PnMixError(
            f"pnkv dump header describes a {capacity}-byte state for a {len(blob)}-byte file "
            f"(batch {batch}, kv_heads {kv_heads}, head_dim {head_dim}, sink_tokens {sink_tokens}, "
            f"residual_size {residual_size}): implausible, refusing to allocate it"
        )
    sections = list(_dump_sections(layout, seq_len))
    expected = DUMP_HEADER_BYTES + sum(
        math.prod(shape) * torch.empty(0, dtype=STATE_DTYPES[name]).element_size()
        for name, shape in sections
    )
    if len(blob) != expected:
        raise PnMixError(
            f"pnkv dump size mismatch: header describes {expected} bytes, file has {len(blob)}"
        )
    state = layout.empty_state()
    used = layout.used_slices(seq_len)
    cursor = DUMP_HEADER_BYTES
    for name, shape in sections:
        dtype = STATE_DTYPES[name]
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if nbytes:
            raw = torch.frombuffer(bytearray(blob[cursor:cursor + nbytes]), dtype=torch.uint8)
            state[name][used[name]] = raw.view(dtype).reshape(shape)
        cursor += nbytes
    if seq_len:
        check_pair_mask(layout, state["pair_mask"], "pnkv dump")
    return layout, state, seq_len


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
    fp16 bits); then check_state. Returns the tensors viewed as STATE_DTYPES, and seq_len."""
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
    check_state(layout, state, seq_len, what)
    return state, seq_len


def check_state(layout: CacheLayout, state: Dict[str, torch.Tensor], seq_len: int, what: str) -> None:
    """A state given whole (not decoded from a dump): the pair mask as load_state checks it, and
    finite fp16 values in the used part (a cache only ever stores finite K/V, steps and offsets)."""
    used = layout.used_slices(seq_len)
    for name in STATE_NAMES:
        if STATE_DTYPES[name] == torch.float16 and not bool(torch.isfinite(state[name][used[name]]).all()):
            raise PnMixError(f"{what}: state tensor '{name}' holds NaN or Inf in its used part")
    if seq_len:
        check_pair_mask(layout, state["pair_mask"], what)
