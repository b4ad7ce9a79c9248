"""PnMixConfig: the method's fields (docs/METHOD.md section 1), their validation, and where they come from.

This module is the one place that names the config fields and states their limits. The ONNX
op attributes are built from ``CONFIG_FIELDS``; the C++ side (params.h's struct, the plugin
fields, format.h's checks) reads plugins/include/pnmix/generated.h, which pnmix/codegen.py
writes from this module (a test keeps it current).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import PnMixError

PAIR_LAYOUTS = ("adjacent", "half")
# The limits every reader applies (docs/FORMAT.md 1.1). pnmix/codegen.py writes them into the
# C++ headers, so a config or layout valid here is valid in the C core, the CUDA library and the
# plugins.
MAX_TOKENS_FIELD = 1 << 20  # sink_tokens, residual_size, group_size
MAX_INT_FIELD = 2**31 - 1  # every other integer field: the C ABI and the plugin fields hold int32
MAX_BATCH = 1 << 20
MAX_KV_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_SEQ_LEN = 1 << 40  # a cache's capacity and a dump's seq_len
MAX_STATE_TENSOR_BYTES = 1 << 50  # any one state tensor at capacity


# The range of each integer field (docs/METHOD.md section 1.1). The rules between fields (group_size a
# multiple of 8, residual_size >= group_size) are _validate_fields's; those that need head_dim
# are check_head_dim's. high_ratio is in [0, 1]; pair_layout one of PAIR_LAYOUTS.
INT_FIELD_RANGES = {
    "group_size": (8, MAX_TOKENS_FIELD),
    "residual_size": (1, MAX_TOKENS_FIELD),
    "sink_tokens": (0, MAX_TOKENS_FIELD),
    "value_bits": (1, 8),
    "value_group_size": (1, MAX_INT_FIELD),
    "key_high_bits": (1, 8),
    "key_low_bits": (1, 8),
}
TOKEN_FIELDS = ("group_size", "residual_size", "sink_tokens")  # counted in tokens, <= MAX_TOKENS_FIELD


@dataclass(frozen=True)
class PnMixConfig:
    """The pn-mix method's configuration. Defaults are the manifest's values (docs/METHOD.md section 1.1)."""

    high_ratio: float = 0.5
    group_size: int = 128
    residual_size: int = 128
    sink_tokens: int = 32
    value_bits: int = 2
    value_group_size: int = 128
    pair_layout: str = "adjacent"
    key_high_bits: int = 3
    key_low_bits: int = 1

    def __post_init__(self) -> None:
        self._validate_fields()

    # ---- validation -------------------------------------------------------------------
    def _validate_fields(self) -> None:
        def need_int(name: str, lo: int, hi: int | None = None, extra: str = "") -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PnMixError(f"config field '{name}' must be an integer, got {value!r}")
            if value < lo or (hi is not None and value > hi):
                allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
                raise PnMixError(f"config field '{name}' must be {allowed}{extra}, got {value}")
            if value > MAX_INT_FIELD:  # the C ABI and the TensorRT plugin fields hold int32
                raise PnMixError(f"config field '{name}' must fit in int32 (<= {MAX_INT_FIELD}), got {value}")
            return value

        ratio = self.high_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or (isinstance(ratio, float) and not math.isfinite(ratio)):
            raise PnMixError(f"config field 'high_ratio' must be a number in [0, 1], got {ratio!r}")
        if not 0.0 <= ratio <= 1.0:
            raise PnMixError(f"config field 'high_ratio' must be in [0, 1], got {ratio}")
        lowest = {name: lo for name, (lo, _) in INT_FIELD_RANGES.items()}
        group = need_int("group_size", lowest["group_size"])
        if group % 8:
            raise PnMixError(f"config field 'group_size' must be a positive multiple of 8, got {group}")
        residual = need_int("residual_size", lowest["residual_size"])
        if residual < group:
            raise PnMixError(
                f"config field 'residual_size' must be >= group_size ({group}), got {residual}"
            )
        need_int("sink_tokens", lowest["sink_tokens"])
        for name in TOKEN_FIELDS:
            if getattr(self, name) > MAX_TOKENS_FIELD:
                raise PnMixError(f"config field '{name}' must be <= {MAX_TOKENS_FIELD}, got {getattr(self, name)}")
        for name in ("value_bits", "value_group_size", "key_high_bits", "key_low_bits"):
            lo, hi = INT_FIELD_RANGES[name]
            need_int(name, lo, None if hi == MAX_INT_FIELD else hi)  # MAX_INT_FIELD: need_int's int32 rule
        if self.pair_layout not in PAIR_LAYOUTS:
            raise PnMixError(
                f"config field 'pair_layout' must be one of {', '.join(PAIR_LAYOUTS)}, "
                f"got {self.pair_layout!r}"
            )

    def check_head_dim(self, head_dim: int) -> None:
        """The checks that need the model's head dimension (docs/METHOD.md section 1.2)."""
        if head_dim <= 0 or head_dim % 2:
            raise PnMixError(f"head_dim must be a positive even number, got {head_dim}")
        vg = self.value_block(head_dim)
        if head_dim % vg:
            raise PnMixError(
                f"config field 'value_group_size' ({self.value_group_size}) gives a value block of "
                f"{vg} channels, which must divide head_dim {head_dim}"
            )
        if (head_dim * self.value_bits) % 8:
            raise PnMixError(
                f"config field 'value_bits' ({self.value_bits}) times head_dim ({head_dim}) "
                "must be a multiple of 8"
            )

    # ---- derived quantities (one definition each) ---------------------------------------
    def value_block(self, head_dim: int) -> int:
        """vg: channels per value code group; a group never spans KV heads."""
        return min(self.value_group_size, head_dim)

    def high_pairs(self, head_dim: int) -> int:
        """n_high = floor(high_ratio * P + 0.5) pairs per KV head use key_high_bits."""
        return int(math.floor(self.high_ratio * (head_dim // 2) + 0.5))

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any], base: "PnMixConfig | None" = None) -> "PnMixConfig":
        """Build from a dict of config fields; unknown keys are an error (a typo must not pass)."""
        if not isinstance(fields, Mapping):
            raise PnMixError(f"config must be a JSON object of fields, got {type(fields).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise PnMixError(
                f"unknown config field '{unknown[0]}'; known fields: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(base or cls(), **dict(fields))

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> "PnMixConfig":
        try:
            fields = manifest["protocol"]["config"]
        except (KeyError, TypeError):
            raise PnMixError("manifest has no 'protocol.config' object") from None
        return cls.from_mapping(fields)

    def replace(self, **overrides: Any) -> "PnMixConfig":
        return self.from_mapping(overrides, base=self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PnMixConfig))
# The Python type of each field (float: high_ratio, str: pair_layout, int: the rest): what the C
# struct, the ONNX attributes and the plugin fields store it as.
CONFIG_FIELD_TYPES: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(PnMixConfig)}
assert set(INT_FIELD_RANGES) == {n for n, t in CONFIG_FIELD_TYPES.items() if t is int}

# Fields a --config file may set besides the method's: the protocol's lengths.
PROTOCOL_FIELDS = ("prefill_tokens", "decode_tokens")


@dataclass(frozen=True)
class RunConfig:
    """What one protocol run needs: the method's config and the protocol's lengths."""

    config: PnMixConfig
    prefill_tokens: int = 384
    decode_tokens: int = 64

    def __post_init__(self) -> None:
        for name in PROTOCOL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ_LEN:
                raise PnMixError(f"config field '{name}' must be an integer 0..{MAX_SEQ_LEN}, got {value!r}")
        if self.prefill_tokens < 1:
            raise PnMixError("config field 'prefill_tokens' must be >= 1: the pair mask comes from the prefill")

    @property
    def total_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


_DEFAULT_LENGTHS = RunConfig(PnMixConfig())  # the protocol's lengths when the manifest omits them


def read_json_file(path: str | Path, what: str) -> Any:
    """Read a JSON file with one-line errors for every way that can fail (pnmix.io.read_json:
    regular files only, a size limit, JSON that defeats the parser)."""
    from .io import read_json

    return read_json(path, what)


def run_config(manifest: Mapping[str, Any], override_path: str | Path | None = None) -> RunConfig:
    """The manifest's protocol, with the fields of a --config JSON file laid over it."""
    base = PnMixConfig.from_manifest(manifest)
    protocol = manifest.get("protocol", {})
    lengths = {name: protocol.get(name, getattr(_DEFAULT_LENGTHS, name)) for name in PROTOCOL_FIELDS}
    if override_path is not None:
        fields = read_json_file(override_path, "config")
        if not isinstance(fields, dict):
            raise PnMixError(f"config file {override_path} must hold a JSON object of fields")
        fields = dict(fields)
        for name in PROTOCOL_FIELDS:
            if name in fields:
                lengths[name] = fields.pop(name)
        base = PnMixConfig.from_mapping(fields, base=base)
    return RunConfig(base, **lengths)
