"""The .pnkv dump: a self-describing file of a cache's persistent bytes (docs/FORMAT.md section 6).

A 64-byte little-endian header (DUMP_HEADER_FIELDS, the one statement of it) and then the used part
of each state tensor in pnmix.format.STATE_NAMES order. ``load_state`` refuses every file the C
core's ``pnmix_dump_read`` refuses, with the same rules.
"""

from __future__ import annotations

import math
import struct
from typing import Dict, Iterator, Tuple

import torch

from .config import CONFIG_FIELDS, MAX_SEQ_LEN, PAIR_LAYOUTS, PnMixConfig
from .errors import PnMixError
from .format import STATE_DTYPES, STATE_NAMES, CacheLayout, check_pair_mask

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
