"""Property tests (hypothesis): every parser either accepts its input or says why in one
PnMixError line, and the append/flush schedule equals a list model of docs/METHOD.md section 2.

Example counts are bounded so the file runs in well under a minute; run with
``--hypothesis-show-statistics`` to see how many cases each property generated, or with ``-s``
to see the per-outcome counts the tests keep in ``CASES`` (printed when the module finishes).
"""

from __future__ import annotations

import collections
import ctypes
import json
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pnmix._native import NativeLibraryError
from pnmix.backends.native import CConfig
from pnmix.testing import PluginField, make_random_kv, schedule_list_model
from pnmix import reference
from pnmix.cache import PackedKVCache
from pnmix.config import CONFIG_FIELDS, PnMixConfig, run_config
from pnmix.errors import PnMixError
from pnmix.dump import DUMP_HEADER_BYTES, dump_state, load_state
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.packing import pack_pair_mask
from pnmix.manifest import compare, load_manifest

CASES: collections.Counter = collections.Counter()
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])



@pytest.fixture(scope="module", autouse=True)
def report_case_counts():
    yield
    print("\nproperty cases:", json.dumps(dict(sorted(CASES.items())), indent=1))


# ---------------------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30), st.just(10**400), st.just(-(10**400)),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Values near each field's valid range, so the generator reaches past the type checks.
field_values = st.one_of(
    st.integers(min_value=-4, max_value=300), st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, -0.1]),
    st.sampled_from(["adjacent", "half", "diag", ""]), json_scalars,
)
config_dicts = st.dictionaries(
    st.sampled_from(CONFIG_FIELDS + ("prefill_tokens", "decode_tokens", "typo_field")),
    field_values, max_size=6,
)
# The manifest's config with one or two fields replaced: mostly valid, so acceptance is exercised.
near_valid_configs = st.builds(
    lambda base, changes: {**base, **changes},
    st.just(PnMixConfig().to_dict()),
    st.dictionaries(st.sampled_from(CONFIG_FIELDS), st.one_of(
        st.sampled_from([1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 0.0, 0.3, 1.0, "half", "adjacent"]),
        field_values), max_size=2),
)


@st.composite
def small_configs(draw) -> PnMixConfig:
    """Valid configs with small sizes, so caches of a few hundred tokens cross many flushes."""
    group = draw(st.sampled_from([8, 16]))
    return PnMixConfig(
        high_ratio=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        group_size=group,
        residual_size=draw(st.integers(min_value=group, max_value=3 * group)),
        sink_tokens=draw(st.integers(min_value=0, max_value=6)),
        value_bits=draw(st.integers(min_value=1, max_value=8)),
        value_group_size=draw(st.sampled_from([2, 4, 8, 128])),
        pair_layout=draw(st.sampled_from(["adjacent", "half"])),
        key_high_bits=draw(st.integers(min_value=1, max_value=8)),
        key_low_bits=draw(st.integers(min_value=1, max_value=8)),
    )


@st.composite
def filled_caches(draw):
    """(cache, k, v, chunks): a small cache fed random chunk sizes (0 included)."""
    config = draw(small_configs())
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    chunks = draw(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=8))
    total = sum(chunks)
    k, v = make_random_kv(batch, heads, total, 8, seed=draw(st.integers(0, 2**16)))
    cache = PackedKVCache(config, heads, 8, max(total, 1), batch=batch)
    start = 0
    for n in chunks:
        cache.append(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    return cache, k, v, chunks


# ---------------------------------------------------------------------------------------
# The .pnkv decoder: PnMixError or a consistent state, never another exception
# ---------------------------------------------------------------------------------------

_HEADER = struct.Struct("<4sHHIIIIBBBBIIIIdQI")  # docs/FORMAT.md section 6, written out again

u32 = st.one_of(st.integers(0, 40), st.sampled_from([2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
HEADER_FIELDS = {  # field index in _HEADER -> values to corrupt it with
    0: st.sampled_from([b"pnkv", b"\0\0\0\0", b"PNK\0"]), 1: st.sampled_from([0, 2, 65535]),
    2: st.sampled_from([0, 63, 65, 65535]), 3: u32, 4: u32, 5: u32, 6: u32,
    7: st.integers(0, 255), 8: st.integers(0, 255), 9: st.integers(0, 255), 10: st.integers(0, 255),
    11: u32, 12: u32, 13: u32, 14: u32, 15: st.floats(), 16: st.integers(0, 2**64 - 1), 17: u32,
}


@st.composite
def dump_headers(draw) -> bytes:
    """A header of a small valid cache, with up to two fields replaced by arbitrary values."""
    cfg = draw(small_configs())
    fields = [
        b"PNKV", 1, 64, cfg.group_size, cfg.residual_size, cfg.sink_tokens, cfg.value_group_size,
        cfg.value_bits, cfg.key_high_bits, cfg.key_low_bits, ["adjacent", "half"].index(cfg.pair_layout),
        draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([2, 4, 8])), 0,
        cfg.high_ratio, draw(st.integers(0, 80)), 0,
    ]
    for index in draw(st.lists(st.sampled_from(sorted(HEADER_FIELDS)), max_size=2)):
        fields[index] = draw(HEADER_FIELDS[index])
    return _HEADER.pack(*fields)


def body_for(header: bytes, noise: bytes) -> bytes:
    """When the header describes a small valid cache: a body of exactly its size, filled with
    noise (so codes, steps and offsets are arbitrary, NaN and Inf included) and a pair mask with
    the right number of high pairs, so the parse reaches the dequantization."""
    f = _HEADER.unpack(header)
    try:
        config = PnMixConfig(high_ratio=f[15], group_size=f[3], residual_size=f[4], sink_tokens=f[5],
                             value_group_size=f[6], value_bits=f[7], key_high_bits=f[8], key_low_bits=f[9],
                             pair_layout=("adjacent", "half")[f[10] % 2])
        layout = CacheLayout(config, f[11], f[12], f[13], max(f[16], 1))
    except PnMixError:
        return noise
    if f[11] * f[12] * f[13] > 64 or f[16] > 200 or f[16] == 0:
        return noise
    size = layout.persistent_bytes(f[16])["persistent_cache_bytes"]
    body = bytearray((noise * (size // max(len(noise), 1) + 1))[:size] if noise else bytes(size))
    high = torch.zeros(layout.batch, layout.kv_heads, layout.pairs, dtype=torch.bool)
    high[..., : config.high_pairs(layout.head_dim)] = True
    mask = pack_pair_mask(high).numpy().tobytes()
    body[len(body) - len(mask):] = mask
    return bytes(body)


def check_loaded(blob: bytes) -> str:
    """Load blob; return 'error' or 'ok' after checking the state is consistent with the bytes."""
    try:
        layout, state, seq_len = load_state(blob)
    except PnMixError as exc:
        assert "\n" not in str(exc) and str(exc)
        return "error"
    assert set(state) == set(STATE_NAMES)
    assert layout.persistent_bytes(seq_len, state)["persistent_cache_bytes"] == len(blob) - DUMP_HEADER_BYTES
    assert dump_state(layout, state, seq_len) == bytes(blob)  # a loaded dump re-dumps byte for byte
    keys, values = reference.dequantize_cache(layout, state, seq_len)
    assert keys.shape == values.shape == (layout.batch, layout.kv_heads, seq_len, layout.head_dim)
    return "ok"


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_decoder(blob):
    CASES["load_state: arbitrary bytes"] += 1
    check_loaded(blob)


@FAST
@given(dump_headers(), st.binary(max_size=600), st.booleans())
def test_arbitrary_headers_and_bodies_never_crash_the_decoder(header, body, exact_size):
    CASES["load_state: headers"] += 1
    if exact_size:
        body = body_for(header, body)
    if check_loaded(header + body) == "ok":
        CASES["load_state: headers, accepted"] += 1


@SLOW
@given(filled_caches(), st.data())
def test_mutated_real_dumps_load_or_fail_cleanly(filled, data):
    cache, _, _, _ = filled
    blob = bytearray(dump_state(cache.layout, cache.state, cache.seq_len))
    assert check_loaded(bytes(blob)) == "ok"
    CASES["load_state: real dumps"] += 1
    how = data.draw(st.sampled_from(["truncate", "extend", "flip", "header"]))
    if how == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif how == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=16))
    elif how == "flip":
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] ^= 1 << data.draw(st.integers(0, 7))
    else:
        at = data.draw(st.integers(0, DUMP_HEADER_BYTES - 1))
        blob[at] = data.draw(st.integers(0, 255))
    result = check_loaded(bytes(blob))
    if how in ("truncate", "extend"):
        assert result == "error", "a dump of the wrong size must be refused"
    CASES[f"load_state: mutated ({how}) -> {result}"] += 1


# The C core's decoder (libpnmix_core) must agree with format.load_state: both refuse, or both
# accept the same state (the same reader rules and limits: docs/FORMAT.md 1.1 and 6).


@pytest.fixture(scope="module")
def core_decoder():
    try:
        from pnmix.backends import core_ops

        core_ops.core_library()
    except NativeLibraryError as exc:  # not built here; conftest.py fails the run where it must be
        pytest.skip(f"libpnmix_core is not available: {exc}")
    return core_ops.load_state


def _outcome(decode, blob):
    try:
        return decode(blob)
    except PnMixError as exc:
        return str(exc)


def check_core_agrees(core_decoder, blob: bytes) -> None:
    py, c = _outcome(load_state, blob), _outcome(core_decoder, blob)
    if isinstance(py, str) and isinstance(c, str):
        CASES["C vs Python: both refuse"] += 1
        return
    assert not isinstance(py, str), f"C accepts a dump Python refuses: {py}"
    assert not isinstance(c, str), f"C refuses a dump Python accepts: {c}"
    (layout, state, n), (c_layout, c_state, c_n) = py, c
    assert n == c_n and layout.config == c_layout.config
    assert dump_state(c_layout, c_state, c_n) == dump_state(layout, state, n)
    CASES["C vs Python: both accept the same state"] += 1


@FAST
@given(dump_headers(), st.binary(max_size=300), st.booleans())
def test_core_decoder_agrees_with_python_on_headers(core_decoder, header, body, exact_size):
    check_core_agrees(core_decoder, header + (body_for(header, body) if exact_size else body))


@SLOW
@given(filled_caches(), st.integers(0, 10**6), st.integers(0, 255))
def test_core_decoder_agrees_with_python_on_mutated_dumps(core_decoder, filled, at, value):
    cache = filled[0]
    blob = bytearray(dump_state(cache.layout, cache.state, cache.seq_len))
    blob[at % len(blob)] = value
    check_core_agrees(core_decoder, bytes(blob))


def test_core_decoder_refuses_reserved_fields_and_bad_masks(core_decoder):
    cache = PackedKVCache(PnMixConfig(group_size=8, residual_size=16, sink_tokens=4, high_ratio=0.25), 2, 8, 40)
    g = torch.Generator().manual_seed(0)
    cache.append(torch.randn(1, 2, 40, 8, generator=g).half(), torch.randn(1, 2, 40, 8, generator=g).half())
    blob = dump_state(cache.layout, cache.state, 40)
    reserved = bytearray(blob)
    reserved[40] = 7
    all_high = bytearray(blob)
    all_high[-1] = 0xFF  # 4 high pairs per head where the config gives 1: offsets past KB
    odd = PackedKVCache(cache.layout.config, 3, 4, 40)  # H * P = 6 bits: two trailing mask bits
    odd.append(torch.randn(1, 3, 40, 4, generator=g).half(), torch.randn(1, 3, 40, 4, generator=g).half())
    stray = bytearray(dump_state(odd.layout, odd.state, 40))
    stray[-1] |= 0x80  # the right count in every head, but a bit past the last pair
    assert "reserved header fields" in _outcome(core_decoder, bytes(reserved))
    assert "pair_mask marks 4 high pairs" in _outcome(core_decoder, bytes(all_high))
    assert "past the last pair" in _outcome(core_decoder, bytes(stray))
    for bad in (reserved, all_high, stray):
        assert isinstance(_outcome(load_state, bytes(bad)), str)


# ---------------------------------------------------------------------------------------
# Config and manifest parsing
# ---------------------------------------------------------------------------------------


@FAST
@given(st.one_of(json_values, config_dicts))
def test_any_json_gives_a_config_or_one_pnmix_error(fields):
    CASES["config: from_mapping"] += 1
    check_config(fields)


@FAST
@given(near_valid_configs)
def test_near_valid_configs_give_a_config_or_one_pnmix_error(fields):
    CASES["config: near-valid"] += 1
    check_config(fields)


def check_config(fields) -> None:
    try:
        config = PnMixConfig.from_mapping(fields)
    except PnMixError as exc:
        assert "\n" not in str(exc)
        return
    CASES["config: accepted"] += 1
    assert PnMixConfig.from_mapping(config.to_dict()) == config
    for head_dim in (2, 8, 32, 34):
        try:
            config.check_head_dim(head_dim)
        except PnMixError:
            continue
        layout = CacheLayout(config, 1, 1, head_dim, 64)
        assert layout.key_group_bytes * 8 == config.group_size * (
            layout.high_channels * config.key_high_bits + layout.low_channels * config.key_low_bits)


_tmp = tempfile.TemporaryDirectory(prefix="pnmix-props-")
_MANIFEST = json.loads(Path(load_manifest.__globals__["bundled_path"]()).read_text())
_OURS = {name: {"mean": 1.0, "std": 0.0, "n": 1} for name in _MANIFEST["metrics"]}


@st.composite
def manifests(draw):
    """The bundled manifest with parts replaced by arbitrary JSON, or arbitrary JSON."""
    if draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    data = json.loads(json.dumps(_MANIFEST))
    for _ in range(draw(st.integers(0, 2))):
        where = draw(st.sampled_from(["top", "protocol", "config", "metrics", "metric", "seeds"]))
        value = draw(st.one_of(json_values, config_dicts, field_values))
        if where == "top":
            data[draw(st.sampled_from(["protocol", "metrics", "seeds", "other"]))] = value
        elif where == "protocol" and isinstance(data.get("protocol"), dict):
            data["protocol"][draw(st.sampled_from(["prefill_tokens", "decode_tokens", "config"]))] = value
        elif where == "config" and isinstance(data.get("protocol"), dict) and isinstance(data["protocol"].get("config"), dict):
            data["protocol"]["config"][draw(st.sampled_from(CONFIG_FIELDS + ("typo",)))] = value
        elif where == "metrics":
            data["metrics"] = value
        elif where == "metric" and isinstance(data.get("metrics"), dict):
            name = draw(st.sampled_from(sorted(data["metrics"]) or ["key_mse"]))
            extreme = st.sampled_from([10**400, -(10**400), float("nan"), float("inf"), True, 1e308, -1e-320])
            value = draw(st.one_of(st.just(value), extreme))
            field = draw(st.sampled_from(["mean", "std", "whole"]))
            before = data["metrics"].get(name)  # an earlier draw may have replaced it (or emptied metrics)
            before = before if isinstance(before, dict) else {}
            data["metrics"][name] = value if field == "whole" else {**before, field: value}
        else:
            data["seeds"] = value
    return data


@FAST
@given(manifests(), st.one_of(st.none(), config_dicts, near_valid_configs))
def test_any_manifest_loads_and_compares_or_gives_one_pnmix_error(manifest, override):
    CASES["manifest: load+run_config+compare"] += 1
    check_manifest(manifest, override)


def check_manifest(manifest, override) -> None:
    path = Path(_tmp.name) / "m.json"
    path.write_text(json.dumps(manifest))
    config_path = None
    if override is not None:
        config_path = Path(_tmp.name) / "c.json"
        config_path.write_text(json.dumps(override))
    try:
        data = load_manifest(path)
        run = run_config(data, config_path)
        rows = compare(data, run, _OURS, [{"metrics": {"mask_unchanged_after_decode": True}}])
    except PnMixError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    CASES["manifest: accepted"] += 1
    from pnmix.cli import _fmt

    for row in rows:  # what `reproduce` prints for each row
        _fmt(row.manifest), _fmt(row.ours)
    assert run.prefill_tokens >= 1 and run.decode_tokens >= 0


metric_values = st.one_of(
    st.sampled_from([10**400, -(10**400), float("nan"), float("inf"), True, 1e308, -1e-320, 0, "1"]), json_scalars)


@FAST
@given(st.sampled_from(sorted(_MANIFEST["metrics"])), st.sampled_from(["mean", "std", "n", "whole"]), metric_values)
def test_any_metric_entry_is_compared_and_printed_or_refused(name, field, value):
    """A manifest's figures go through float arithmetic (the bands) and formatting (the table)."""
    CASES["manifest: metric entries"] += 1
    data = json.loads(json.dumps(_MANIFEST))
    data["metrics"][name] = value if field == "whole" else {**data["metrics"][name], field: value}
    check_manifest(data, None)


# ---------------------------------------------------------------------------------------
# The append/flush schedule against a list model
# ---------------------------------------------------------------------------------------


@SLOW
@given(filled_caches())
def test_schedule_matches_the_list_model(filled):
    cache, k, v, chunks = filled
    CASES["schedule: caches"] += 1
    CASES["schedule: appends"] += len(chunks)
    config, layout = cache.config, cache.layout
    sink, groups, residual = schedule_list_model(config, chunks)
    assert tuple(cache.lengths()) == (len(sink), len(groups), len(residual))
    assert tuple(layout.lengths(cache.seq_len)) == tuple(cache.lengths())
    assert len(residual) < config.residual_size
    state = cache.state
    assert torch.equal(state["sink_k"][:, :, : len(sink)], k[:, :, sink])
    assert torch.equal(state["sink_v"][:, :, : len(sink)], v[:, :, sink])
    assert torch.equal(state["residual_k"][:, :, : len(residual)], k[:, :, residual])
    assert torch.equal(state["residual_v"][:, :, : len(residual)], v[:, :, residual])
    first = next((n for n in chunks if n), 0)
    if first:  # the mask comes from the first non-empty append only
        assert cache.saliency_computations == 1
        assert torch.equal(state["pair_mask"], pack_pair_mask(reference.saliency_mask(k[:, :, :first], layout)))
    bits = reference.state_channel_bits(layout, state).reshape(-1, layout.head_dim)
    for g, members in enumerate(groups):  # group g holds exactly the model's tokens
        packed, step, offset = reference.quantize_key_groups(
            k[:, :, members].reshape(-1, config.group_size, layout.head_dim), bits, layout)
        assert torch.equal(state["key_codes"][:, :, g].reshape(packed.shape), packed)
        assert torch.equal(state["key_offset"][:, :, g].reshape(offset.shape), offset)
        packed_v, step_v, _ = reference.quantize_values(v[:, :, members], layout)
        assert torch.equal(state["value_codes"][:, :, g], packed_v)
        assert torch.equal(state["value_step"][:, :, g], step_v)
    # Chunking after the prefill does not change the persistent bytes.
    rest = cache.seq_len - first
    if first:
        whole = PackedKVCache(config, layout.kv_heads, layout.head_dim, layout.max_seq_len, batch=layout.batch)
        whole.append(k[:, :, :first], v[:, :, :first])
        whole.append(k[:, :, first:], v[:, :, first:])
        assert dump_state(layout, whole.state, whole.seq_len) == dump_state(layout, state, cache.seq_len)
        CASES["schedule: re-chunked tokens"] += rest


@FAST
@given(small_configs(), st.integers(0, 10_000))
def test_closed_form_lengths_match_the_list_model_token_by_token(config, n):
    CASES["schedule: closed form"] += 1
    sink, groups, residual = schedule_list_model(config, [1] * min(n, 600))
    layout = CacheLayout(config, 1, 1, 8, max(n, 1))
    assert tuple(layout.lengths(min(n, 600))) == (len(sink), len(groups), len(residual))
    got = layout.lengths(n)
    assert got.sink + got.groups * config.group_size + got.residual == n
    assert 0 <= got.residual < config.residual_size and got.sink == min(n, config.sink_tokens)


# ---------------------------------------------------------------------------------------
# Plugin field deserialization (the TensorRT plugins' parser, over libpnmix_fields' C ABI)
# ---------------------------------------------------------------------------------------

FLOAT32, INT32, CHAR = 1, 5, 6  # nvinfer1::PluginFieldType codes, as TensorRT's ONNX parser makes them
FIELDS_SOURCES = ("plugins/trt/fields_abi.cpp", "plugins/include/pnmix/plugin_fields.h")


_Field = PluginField  # pnmix_field == nvinfer1::PluginField
_Config = CConfig  # pnmix_config (plugins/include/pnmix/params.h)


@pytest.fixture(scope="module")
def fields_lib(tmp_path_factory):
    """libpnmix_fields: the CMake build when newer than its sources, else compiled here."""
    repo = Path(__file__).resolve().parents[2]
    sources = [repo / s for s in FIELDS_SOURCES]
    from pnmix import _native

    path, _ = _native.find_library("pnmix_fields")
    if path is None or path.stat().st_mtime < max(s.stat().st_mtime for s in sources):
        compiler = shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            pytest.skip("libpnmix_fields is not built and no C++ compiler is here")
        path = tmp_path_factory.mktemp("fields") / "libpnmix_fields.so"
        subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{repo / 'plugins' / 'include'}",
                        str(sources[0]), "-o", str(path)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(path))
    lib.pnmix_fields_parse.argtypes = [ctypes.POINTER(_Field), ctypes.c_int32, ctypes.POINTER(_Config),
                                       ctypes.c_char_p, ctypes.c_int32]
    return lib


@st.composite
def plugin_field_sets(draw):
    """(fields as TensorRT would hand them, python values, clean?): near-valid values, sometimes
    tampered with (a field dropped, repeated, renamed, mistyped, of wrong length)."""
    values = dict(PnMixConfig().to_dict())
    for name in draw(st.lists(st.sampled_from(CONFIG_FIELDS), max_size=3)):
        if name == "high_ratio":
            values[name] = draw(st.sampled_from([0.0, 0.25, 0.3, 1.0, 1.5, -0.5, float("nan"), float("inf")]))
        elif name == "pair_layout":
            values[name] = draw(st.sampled_from(["adjacent", "half", "diag", "", "adjacent\0x", "h" * 40]))
        else:
            values[name] = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 8, 9, 16, 24, 128, 255]),
                                          st.integers(-2**31, 2**31 - 1)))
    items = []  # (name, type, data bytes, length)
    for name, value in values.items():
        if name == "high_ratio":
            items.append((name, FLOAT32, struct.pack("<f", value), 1))
        elif name == "pair_layout":
            raw = value.encode() + b"\0"
            items.append((name, CHAR, raw, len(raw)))
        else:
            items.append((name, INT32, struct.pack("<i", value), 1))
    clean = True
    for _ in range(draw(st.integers(0, 2)) if draw(st.booleans()) else 0):
        clean = False
        at = draw(st.integers(0, len(items) - 1))
        name, kind, data, length = items[at]
        how = draw(st.sampled_from(["drop", "repeat", "rename", "retype", "short", "long", "empty"]))
        if how == "drop":
            del items[at]
        elif how == "repeat":
            items.append(items[at])
        elif how == "rename":
            items[at] = (draw(st.sampled_from(["", "group", "group_size ", "GROUP_SIZE", "x" * 300])), kind, data, length)
        elif how == "retype":
            items[at] = (name, draw(st.integers(-1, 12)), data, length)
        elif how == "short":
            items[at] = (name, kind, data[: max(len(data) - 1, 0)], max(length - 1, 0))
        elif how == "long":
            extra = draw(st.binary(min_size=1, max_size=8))
            items[at] = (name, kind, data + extra * 4, length + len(extra) * 4 // max(1, len(data) // max(length, 1)))
        else:
            items[at] = (name, kind, b"", 0)
    return items, values, clean


@FAST
@given(plugin_field_sets())
def test_plugin_fields_parse_exactly_when_the_python_config_is_valid(fields_lib, case):
    items, values, clean = case
    CASES["plugin fields: collections"] += 1
    keep = [ctypes.create_string_buffer(data, max(len(data), 1)) for _, _, data, _ in items]
    array = (_Field * max(1, len(items)))()
    for i, ((name, kind, data, length), buffer) in enumerate(zip(items, keep)):
        array[i] = _Field(name.encode(), ctypes.addressof(buffer) if data else None, kind, length)
    out, err = _Config(), ctypes.create_string_buffer(256)
    status = fields_lib.pnmix_fields_parse(array, len(items), ctypes.byref(out), err, len(err))
    message = err.value.decode(errors="replace")
    assert status in (0, 1)
    if status:
        assert message and "\n" not in message
    if not clean:
        CASES[f"plugin fields: tampered -> {'refused' if status else 'parsed'}"] += 1
        return
    # Clean collections: the C++ parser and PnMixConfig agree on what is valid (high_ratio as fp32;
    # pair_layout is the whole field less its one trailing NUL, so "adjacent\0x" is not "adjacent").
    as_sent = {**values, "high_ratio": struct.unpack("<f", struct.pack("<f", values["high_ratio"]))[0]}
    try:
        expected = PnMixConfig(**as_sent)
    except PnMixError:
        expected = None
    CASES[f"plugin fields: clean -> {'refused' if status else 'parsed'}"] += 1
    assert (status == 0) == (expected is not None), (values, message)
    if expected is not None:
        got = {name: getattr(out, name) for name in CONFIG_FIELDS}
        got["pair_layout"] = ("adjacent", "half")[got["pair_layout"]]
        assert PnMixConfig(**got) == expected
