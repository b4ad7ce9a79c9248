#!/usr/bin/env python3
"""Fuzz the Python side of pnmix: the .pnkv dump decoder, config and manifest parsing, the ONNX
model reader, a GGUF model's header, the JSON parser every reader uses, the TensorRT engine description, and
PackedKVCache.import_state. Any exception other than PnMixError is a finding; so is a dump that
loads but does not re-dump to the same bytes, a refused import that changed the cache, and an
accepted import whose dump load_state refuses.

Two engines:
* atheris (coverage-guided, libFuzzer): ``python3 tools/fuzz_python.py --atheris -- -runs=100000``
  (arguments after ``--`` go to libFuzzer: -max_total_time=60, a corpus folder, ...).
* a plain mutation loop (no extra package): ``python3 tools/fuzz_python.py --runs 20000``. It mutates
  valid seeds (bit flips, byte sets, truncation, insertion, splices, interesting integers in the
  dump header) and prints how many cases each target ran and what it found.

Run from the repository root (or with PYTHONPATH=repo). Findings are written to --crash-dir.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ("dump", "config", "manifest", "onnx", "json", "sidecar", "state", "cache_api", "gguf", "llm_meta")


# ---------------------------------------------------------------------------------------
# Targets: each takes bytes, returns "ok" or "refused", raises on a finding
# ---------------------------------------------------------------------------------------


class Targets:
    def __init__(self) -> None:
        from pnmix.errors import PnMixError

        self.PnMixError = PnMixError
        self.folder = Path(tempfile.mkdtemp(prefix="pnmix-fuzz-"))

    def dump(self, data: bytes) -> str:
        from pnmix import reference
        from pnmix.dump import DUMP_HEADER_BYTES, dump_state, load_state

        try:
            layout, state, seq_len = load_state(data)
        except self.PnMixError as exc:
            return self._refused(exc)
        if dump_state(layout, state, seq_len) != bytes(data):
            raise AssertionError("a loaded dump does not re-dump to the same bytes")
        if layout.persistent_bytes(seq_len, state)["persistent_cache_bytes"] != len(data) - DUMP_HEADER_BYTES:
            raise AssertionError("persistent bytes disagree with the file size")
        reference.dequantize_cache(layout, state, seq_len)
        return "ok"

    def config(self, data: bytes) -> str:
        from pnmix.config import PnMixConfig

        try:
            fields = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return "not json"
        try:
            config = PnMixConfig.from_mapping(fields)
            config.check_head_dim(32)
        except self.PnMixError as exc:
            return self._refused(exc)
        if PnMixConfig.from_mapping(config.to_dict()) != config:
            raise AssertionError("config does not round-trip through to_dict")
        return "ok"

    def manifest(self, data: bytes) -> str:
        from pnmix.config import run_config
        from pnmix.manifest import compare, load_manifest

        path = self.folder / "manifest.json"
        path.write_bytes(data)
        try:
            manifest = load_manifest(path)
            run = run_config(manifest)
            ours = {name: {"mean": 1.0, "std": 0.0, "n": 1} for name in manifest["metrics"]}
            compare(manifest, run, ours, [{"metrics": {"mask_unchanged_after_decode": True}}])
        except self.PnMixError as exc:
            return self._refused(exc)
        return "ok"

    def onnx(self, data: bytes) -> str:
        from pnmix.export.modelfile import load_checked

        path = self.folder / "model.onnx"
        path.write_bytes(data)
        try:
            load_checked(path)
        except self.PnMixError as exc:
            return self._refused(exc)
        return "ok"

    def json(self, data: bytes) -> str:
        from pnmix.io import parse_json

        try:
            parse_json(data.decode("utf-8", errors="replace"), "fuzz input")
        except self.PnMixError as exc:
            return self._refused(exc)
        return "ok"

    def sidecar(self, data: bytes) -> str:
        plan = self.folder / "engine.plan"
        plan.write_bytes(b"not a plan")
        trt = trt_module()
        trt.sidecar_path(plan).write_bytes(data)
        try:
            trt.read_sidecar(plan)
        except self.PnMixError as exc:
            return self._refused(exc)
        return "ok"

    def state(self, data: bytes) -> str:
        """data: a 2-byte seq_len, then the raw bytes of the state tensors in STATE_NAMES order
        (what is missing keeps the seed cache's bytes)."""
        import torch

        from pnmix.dump import dump_state, load_state
        from pnmix.format import STATE_NAMES

        source, target = _state_caches()
        tensors = {name: t.clone() for name, t in source.export_state().items()}
        cursor = 2
        for name in STATE_NAMES:
            raw = tensors[name].view(torch.uint8).reshape(-1) if tensors[name].element_size() == 1 else \
                tensors[name].view(torch.int16).view(torch.uint8).reshape(-1)
            take = max(0, min(len(data) - cursor, raw.numel()))
            if take:
                raw[:take] = torch.frombuffer(bytearray(data[cursor:cursor + take]), dtype=torch.uint8)
            cursor += take
        seq_len = int.from_bytes(data[:2], "little") if len(data) >= 2 else 0
        before = dump_state(target.layout, target.state, target.seq_len), target.seq_len
        try:
            target.import_state(tensors, seq_len)
        except self.PnMixError as exc:
            if (dump_state(target.layout, target.state, target.seq_len), target.seq_len) != before:
                raise AssertionError("a refused import_state changed the cache") from None
            return self._refused(exc)
        blob = dump_state(target.layout, target.state, target.seq_len)
        try:
            load_state(blob)
        except self.PnMixError as exc:
            raise AssertionError(f"import_state accepts a state whose dump load_state refuses: {exc}") from None
        target.import_state(source.export_state(), source.seq_len)  # back to the seed for the next case
        return "ok"

    def cache_api(self, data: bytes) -> str:
        """data: a program of PnMixCache calls on a tiny config (cache_api_calls decodes it): any
        exception other than PnMixError is a finding, and so is a refused call that changed the
        cache (its layers, lengths, batch, capacity or state bytes)."""
        from pnmix.hf.cache import PnMixCache

        reader = ByteReader(data)
        cache = PnMixCache(config=cache_api_config(), backend="torch",
                           max_cache_len=reader.choice((None, 64, 200)))
        outcome = "refused"
        for name, call in cache_api_calls(reader, cache):
            before = cache_snapshot(cache)
            try:
                call()
            except self.PnMixError as exc:
                if cache_snapshot(cache) != before:
                    raise AssertionError(f"a refused {name} changed the cache: {exc}") from None
                self._refused(exc)
                continue
            except Exception as exc:  # a finding: name the call that raised it
                raise AssertionError(f"{name} raised {type(exc).__name__}: {exc}") from exc
            outcome = "ok"  # at least one call accepted
        return outcome

    def gguf(self, data: bytes) -> str:
        """data: a GGUF file, read as `pnmix eval/export MODEL.gguf` reads it before any weight
        (gguf_architecture, then load_model_config: the family, the shapes within the limits,
        finite numbers, no unsupported feature). A warning (numpy's, torch's) is a finding too:
        the commands print one line."""
        import warnings

        from pnmix.hf.models import ModelSource, gguf_architecture, load_model_config

        path = self.folder / "model.gguf"
        path.write_bytes(data)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                gguf_architecture(path)
                load_model_config(ModelSource(str(path), self.folder, path.name))
                outcome = "ok"
            except self.PnMixError as exc:
                outcome = self._refused(exc)
        if caught:
            raise AssertionError(f"reading a GGUF header warned: {caught[0].category.__name__}: {caught[0].message}")
        return outcome

    def llm_meta(self, data: bytes) -> str:
        """data: an LLM file's pnmix.* metadata as a JSON object (a value that is not a string is
        written as its JSON text), put on a small exported LLM file that read_llm_info reads. A
        finding: any exception other than PnMixError, a message of more than one line, or an
        accepted file whose metadata says something else of the graph than the export's."""
        from pnmix.export.llm_file import read_llm_info

        try:
            fields = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return "not json"
        if not isinstance(fields, dict):
            return "not json"
        proto, truth, folder = _llm_seed(self.folder)
        edited = type(proto)()
        edited.CopyFrom(proto)
        del edited.metadata_props[:]
        try:
            for key, value in fields.items():
                edited.metadata_props.add(key=key, value=value if isinstance(value, str) else json.dumps(value))
            blob = edited.SerializeToString()
        except (ValueError, TypeError, UnicodeError, RecursionError):  # not a protobuf string (a lone surrogate)
            return "not json"
        path = folder / "m.onnx"
        path.write_bytes(blob)
        try:
            info = read_llm_info(path)
        except self.PnMixError as exc:
            return self._refused(exc)
        for name, value in _graph_facts(info).items():
            if value != truth[name]:
                raise AssertionError(f"read_llm_info accepted metadata whose {name} is {value!r}, the graph's "
                                     f"{truth[name]!r}")
        return "ok"

    @staticmethod
    def _refused(exc: Exception) -> str:
        if "\n" in str(exc) or not str(exc):
            raise AssertionError(f"PnMixError message is not one line: {str(exc)!r}")
        return "refused"


def trt_module():
    """The TensorRT build module (it imports without TensorRT: the sidecar needs none)."""
    import importlib

    return importlib.import_module("pnmix.backends.tensorrt.engine")


_STATE_CACHES: list = []


def _state_caches():
    """(source, target): a filled cache whose state the `state` target mutates, and the cache it
    is imported into (same layout), made once."""
    if not _STATE_CACHES:
        import torch

        from pnmix.cache import PackedKVCache
        from pnmix.config import PnMixConfig

        config = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4, high_ratio=0.25)
        caches = []
        for n in (40, 40):
            cache = PackedKVCache(config, 2, 8, 48)
            g = torch.Generator().manual_seed(n)
            cache.append(torch.randn(1, 2, n, 8, generator=g).half(), torch.randn(1, 2, n, 8, generator=g).half())
            caches.append(cache)
        _STATE_CACHES.extend(caches)
    return _STATE_CACHES[0], _STATE_CACHES[1]


class ByteReader:
    """Choices drawn from the fuzzer's bytes, in order; past the end every choice is the first."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        value = self.data[self.at] if self.at < len(self.data) else 0
        self.at += 1
        return value

    def choice(self, options):
        return options[self.byte() % len(options)]

    @property
    def done(self) -> bool:
        return self.at >= len(self.data)


def cache_api_config():
    from pnmix.config import PnMixConfig

    return PnMixConfig(group_size=8, residual_size=16, sink_tokens=4, high_ratio=0.25, pair_layout="half")


CACHE_API_OPS = ("update", "update", "update", "reorder_cache", "batch_select_indices", "batch_repeat_interleave",
                 "get_seq_length", "crop")
CACHE_API_MAX_CALLS = 12


def cache_api_calls(reader: ByteReader, cache):
    """(name, zero-argument call) pairs decoded from reader: updates of random shapes, dtypes and
    values (finite, NaN, Inf, huge, expanded), and the batch calls with every kind of index."""
    import torch

    def batch() -> int:
        layers = cache.pnmix_layers
        current = layers[0].packed.layout.batch if layers and layers[0].packed is not None else 1
        return reader.choice((current, current, current, 1, 2, 3, 0))

    for _ in range(CACHE_API_MAX_CALLS):
        if reader.done:
            return
        op = reader.choice(CACHE_API_OPS)
        if op == "update":
            made = len(cache.layers)
            layer = reader.choice((made, made, 0, made - 1, -1, 2, 10**6, True, 0.0))
            shape = [batch(), reader.choice((2, 2, 1, 3)), reader.choice((1, 1, 5, 17, 40, 0, 3)),
                     reader.choice((8, 8, 8, 16, 7))]
            dtype = reader.choice((torch.float16, torch.float32, torch.bfloat16, torch.float64, torch.int32,
                                   torch.bool, torch.complex64))
            values = reader.choice(("randn", "randn", "big", "nan", "inf", "zeros", "expand", "3-D"))
            seed = reader.byte()
            yield f"update(layer_idx={layer!r}, {shape}, {dtype}, {values})", \
                _update(cache, layer, shape, dtype, values, seed)
        elif op in ("reorder_cache", "batch_select_indices"):
            size = batch() or 1
            kind = reader.choice(("tensor", "tensor", "list", "tuple", "negative", "out of range", "float",
                                  "2-D", "bool", "empty", "int32", "scalar", "list of floats"))
            rows = [reader.byte() % size for _ in range(reader.choice((size, size, 1, 2, 4)))]
            index = _indices(kind, rows, size)
            yield f"{op}({kind} {rows})", (lambda op=op, index=index: getattr(cache, op)(index))
        elif op == "batch_repeat_interleave":
            repeats = reader.choice((1, 2, 3, 0, -1, 1.5, True, 2**40, "2"))
            yield f"batch_repeat_interleave({repeats!r})", (lambda repeats=repeats: cache.batch_repeat_interleave(repeats))
        elif op == "get_seq_length":
            layer = reader.choice((0, 1, 5, -1, 1.5, True, "0"))
            yield f"get_seq_length({layer!r})", (lambda layer=layer: cache.get_seq_length(layer))
        else:
            tokens = reader.choice((1, 0, -1, 5))
            yield f"crop({tokens})", (lambda tokens=tokens: cache.crop(tokens))


def _indices(kind: str, rows: list, size: int):
    """Batch indices of one kind (valid ones, and each way of being wrong) made from rows."""
    import torch

    if kind in ("list", "tuple"):
        return rows if kind == "list" else tuple(rows)
    if kind == "list of floats":
        return [float(r) for r in rows]
    made = {"negative": ([-1] + rows, torch.int64), "out of range": (rows + [size], torch.int64),
            "float": (rows, torch.float32), "2-D": ([rows], torch.int64), "bool": ([True] * len(rows), torch.bool),
            "empty": ([], torch.int64), "int32": (rows, torch.int32), "scalar": (rows[0], torch.int64)}
    values, dtype = made.get(kind, (rows, torch.int64))
    return torch.tensor(values, dtype=dtype)


def _update(cache, layer, shape, dtype, values, seed):
    """The update call, its K/V made now (outside the call: only the cache's own errors count)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if values == "3-D":
        k = torch.randn(shape[0], shape[1], shape[2], generator=g)
    else:
        k = torch.randn(*shape, generator=g) if values != "expand" else torch.randn(
            shape[0], shape[1], 1, shape[3], generator=g)
    if values == "big":
        k = k * 1e6
    elif values == "zeros":
        k = torch.zeros_like(k)
    elif values in ("nan", "inf") and k.numel():
        k.view(-1)[seed % k.numel()] = float(values)
    k = k.to(dtype) if dtype != torch.complex64 else torch.complex(k, k)
    if values == "expand":  # no memory of its own: 10^8 tokens must be refused by the capacity first
        tokens = 10**8 if cache.max_cache_len is not None else 2000  # a growing cache takes them: keep it fast
        k = k.expand(shape[0], shape[1], tokens, shape[3])
    v = k if values == "expand" else k.clone()

    def call() -> None:
        cache.update(k, v, layer)
        if seed % 3 == 0 and cache.get_seq_length() != cache.pnmix_layers[0].get_seq_length():
            raise AssertionError("get_seq_length disagrees with layer 0")

    return call


def cache_snapshot(cache):
    """What a refused call must leave as it was: per layer the tokens, batch, capacity and state bytes."""
    import torch

    layers = []
    for layer in cache.pnmix_layers:
        packed = layer.packed
        if packed is None:
            layers.append(None)
            continue
        state = hashlib.sha1()
        for name in sorted(packed.state):
            state.update(packed.state[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        layers.append((packed.seq_len, packed.layout.batch, packed.layout.max_seq_len, layer.pending is not None,
                       state.hexdigest()))
    return layers


_LLM_FILES: list = []  # the LLM file llm_meta edits (made on first use, or set by a test)
_LLM_SEEDS: dict = {}


def _llm_file() -> Path:
    """A small LLM file (`pnmix export --model` of a tiny random 2-layer Llama), made once."""
    if not _LLM_FILES:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from pnmix.export.llm import export_llm
        from pnmix.testing import SMALL, make_tiny_model

        root = Path(tempfile.mkdtemp(prefix="pnmix-fuzz-llm-"))
        config = root / "config.json"
        config.write_text(json.dumps(SMALL))
        _LLM_FILES.append(export_llm(str(make_tiny_model(root / "llama")), root / "m.onnx", 64, config).path)
    return Path(_LLM_FILES[0])


def _graph_facts(info) -> dict:
    """What an LLM file's metadata says of its graph and weights (all checked by read_llm_info)."""
    from pnmix.export import ops

    config = dict(info.config.to_dict(), high_ratio=ops.fp32_ratio(info.config))
    return {"config": config, **{name: getattr(info, name) for name in (
        "max_seq_len", "batch", "layers", "q_heads", "kv_heads", "head_dim", "vocab_size", "dtype", "data_sha256")}}


def _llm_seed(folder: Path):
    """(the file's graph without its metadata, its graph facts, a folder holding a copy of its
    weights file), made once per file."""
    import shutil

    import onnx

    from pnmix.export.llm_file import read_llm_info

    path = _llm_file()
    if path not in _LLM_SEEDS:
        proto = onnx.load(str(path), load_external_data=False)
        place = folder / f"llm{len(_LLM_SEEDS)}"
        place.mkdir()
        location = next(e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location")
        shutil.copyfile(path.with_name(location), place / location)
        _LLM_SEEDS[path] = (proto, _graph_facts(read_llm_info(path)), place)
    return _LLM_SEEDS[path]


def llm_meta_seed() -> bytes:
    """The metadata of the LLM file as the llm_meta target's JSON: numbers as numbers, the config
    as an object."""
    import onnx

    proto = onnx.load(str(_llm_file()), load_external_data=False)
    fields = {}
    for prop in proto.metadata_props:
        try:
            fields[prop.key] = json.loads(prop.value) if prop.value[:1] in "{[0123456789" else prop.value
        except ValueError:
            fields[prop.key] = prop.value
    return json.dumps(fields).encode()


# ---------------------------------------------------------------------------------------
# Seeds: valid inputs to mutate
# ---------------------------------------------------------------------------------------


def seeds(target: str) -> List[bytes]:
    import torch

    from pnmix.cache import PackedKVCache
    from pnmix.config import PnMixConfig
    from pnmix.dump import dump_state
    from pnmix.manifest import bundled_path

    if target == "dump":
        out = []
        for config, n, heads, dim in ((PnMixConfig(group_size=8, residual_size=16, sink_tokens=4), 40, 2, 8),
                                      (PnMixConfig(group_size=8, residual_size=8, sink_tokens=0, pair_layout="half",
                                                   value_bits=1, key_high_bits=5, key_low_bits=2), 30, 1, 16),
                                      (PnMixConfig(group_size=16, residual_size=24, sink_tokens=2), 5, 1, 4)):
            cache = PackedKVCache(config, heads, dim, n)
            g = torch.Generator().manual_seed(n)
            cache.append(torch.randn(1, heads, n, dim, generator=g).half(), torch.randn(1, heads, n, dim, generator=g).half())
            out.append(dump_state(cache.layout, cache.state, n))
        empty = PackedKVCache(PnMixConfig(), 2, 32, 8)
        out.append(dump_state(empty.layout, empty.state, 0))
        return out
    if target == "config":
        return [json.dumps(PnMixConfig().to_dict()).encode(), b'{"group_size": 8, "residual_size": 8}',
                b'{"pair_layout": "half", "high_ratio": 0.25}', b"{}", b'{"group_size": 12}',
                b'{"value_bits": 9}', b'{"high_ratio": "x"}', b'{"typo": 1}', b'[]']
    if target == "manifest":
        return [bundled_path().read_bytes()]
    if target == "json":
        return seeds("config") + [bundled_path().read_bytes(), b"[" * 99 + b"]" * 99, b'{"a": ' + b"9" * 100 + b"}",
                                  b'{"a": [1, 2.5, "x", null, true, {"b": {}}]}']
    if target == "sidecar":
        sidecar = {"format": "pnmix-engine-1", "config": PnMixConfig().to_dict(), "capacity": 448, "batch": 1,
                   "seed": 42, "precision": "fp32", "refittable": True,
                   "profiles": {"decode": 0, "prefill": 1, "max_prefill": 384}}
        return [json.dumps(sidecar).encode()]
    if target == "state":
        source, _ = _state_caches()
        raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() if t.element_size() == 1 else
                       t.contiguous().view(torch.int16).numpy().tobytes() for t in source.export_state().values())
        return [source.seq_len.to_bytes(2, "little") + raw, (0).to_bytes(2, "little") + raw]
    if target == "cache_api":  # programs of calls: a prefill then decodes, and random ones
        prefill = bytes([0, 0, 0, 0, 0, 4, 0, 0, 0, 7]) + bytes([0, 0, 0, 0, 0, 0, 0, 0, 1]) * 3
        batch = bytes([1, 0, 0, 1, 0, 3, 0, 0, 0, 9, 3, 0, 0, 0, 0, 0, 5, 0, 1, 4, 0, 0, 1, 2])
        return [prefill, batch] + [random.Random(n).randbytes(80) for n in range(6)]
    if target == "gguf":  # tiny Llama-family files made with gguf's GGUFWriter (pnmix.testing)
        from pnmix.testing import make_tiny_gguf

        out = []
        with tempfile.TemporaryDirectory() as folder:
            variants = ({"layers": 1}, {"layers": 2, "architecture": "qwen2"}, {"layers": 1, "header": {"block_count": 3}})
            for number, changes in enumerate(variants):
                path = Path(folder) / f"m{number}.gguf"
                out.append(make_tiny_gguf(path, **changes, hidden=8, heads=2, kv_heads=1, ffn=16, vocab=16).read_bytes())
        return out
    if target == "onnx":
        from pnmix.export.exporter import export_onnx

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "m.onnx"
            export_onnx(path, PnMixConfig(group_size=8, residual_size=16, sink_tokens=4), max_seq_len=32)
            return [path.read_bytes()]
    if target == "llm_meta":
        valid = json.loads(llm_meta_seed())
        variants = [valid, {**valid, "pnmix.format_version": "1"}, {**valid, "pnmix.config": json.dumps(valid["pnmix.config"])},
                    {k: v for k, v in valid.items() if k != "pnmix.data_sha256"}, {**valid, "pnmix.layers": "2"}]
        # plausible lies (the mutations rarely make a valid other integer): each must be refused
        for key, value in (("layers", 3), ("kv_heads", 1), ("head_dim", 8), ("q_heads", 2), ("batch", 2),
                           ("vocab_size", 100), ("max_seq_len", 65), ("dtype", "fp16")):
            variants.append({**valid, f"pnmix.{key}": value})
        return [json.dumps(v).encode() for v in variants]
    raise ValueError(target)


# ---------------------------------------------------------------------------------------
# The plain mutation loop
# ---------------------------------------------------------------------------------------

INTERESTING_U32 = (0, 1, 2, 7, 8, 9, 31, 32, 33, 64, 127, 128, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1)
JSON_TARGETS = ("config", "manifest", "json", "sidecar", "llm_meta")
HEADER_U32_OFFSETS = (8, 12, 16, 20, 28, 32, 36, 40, 60)  # docs/FORMAT.md section 6
JSON_TOKENS = (b"null", b"true", b"-1", b"0", b"1e999", b"NaN", b"[]", b"{}", b'""', b"1" + b"0" * 400, b"0.5", b'"half"',
               b"[" * 120 + b"]" * 120, b"1" + b"0" * 21, str(2**70).encode(), b"-" + str(2**64).encode())


def mutate(rng: random.Random, data: bytes, corpus: List[bytes], target: str) -> bytes:
    blob = bytearray(data)
    json_only = target in JSON_TARGETS and rng.random() < 0.7  # keep most cases parseable
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        kind = 7 if json_only else rng.randrange(8)
        if kind == 0 and blob:  # flip a bit
            at = rng.randrange(len(blob))
            blob[at] ^= 1 << rng.randrange(8)
        elif kind == 1 and blob:  # set a byte
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        elif kind == 2 and blob:  # truncate
            del blob[rng.randrange(len(blob)):]
        elif kind == 3:  # insert bytes
            at = rng.randrange(len(blob) + 1)
            blob[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif kind == 4 and blob:  # delete a run
            at = rng.randrange(len(blob))
            del blob[at:at + rng.randrange(1, 17)]
        elif kind == 5:  # splice with another seed
            other = rng.choice(corpus)
            cut = rng.randrange(len(other) + 1)
            blob = blob[: rng.randrange(len(blob) + 1)] + other[cut:]
        elif kind == 6 and target == "dump" and len(blob) >= 64:  # an interesting header integer
            struct.pack_into("<I", blob, rng.choice(HEADER_U32_OFFSETS), rng.choice(INTERESTING_U32))
        elif kind == 6 and target == "gguf" and len(blob) >= 8:  # a count, length, type or field value
            struct.pack_into("<I", blob, rng.randrange(min(len(blob), 1024) - 3), rng.choice(INTERESTING_U32))
        elif kind == 7 and target in JSON_TARGETS:  # replace a JSON value
            text = bytes(blob)
            colons = [i for i, c in enumerate(text) if c == ord(":")]
            if colons:
                at = rng.choice(colons) + 1
                end = at
                while end < len(text) and text[end] not in b",}]":
                    end += 1
                blob = bytearray(text[:at] + b" " + rng.choice(JSON_TOKENS) + text[end:])
    return bytes(blob)


def run_loop(target: str, runs: int, seconds: float, seed: int, crash_dir: Path | None,
             log: Callable[[str], None] = print) -> Dict[str, object]:
    """Mutate the seeds `runs` times (or for `seconds`); returns counts and findings."""
    rng = random.Random(seed)
    check = getattr(Targets(), target)
    corpus = seeds(target)
    counts: Dict[str, int] = {}
    findings: List[str] = []
    began = time.monotonic()
    cases = 0
    while cases < runs and time.monotonic() - began < seconds:
        data = mutate(rng, rng.choice(corpus), corpus, target) if cases >= len(corpus) else corpus[cases]
        cases += 1
        try:
            outcome = check(data)
        except Exception as exc:  # a finding
            outcome = "FINDING"
            key = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            if key not in findings:
                findings.append(key)
                if crash_dir is not None:
                    crash_dir.mkdir(parents=True, exist_ok=True)
                    name = crash_dir / f"{target}-{hashlib.sha1(data).hexdigest()[:12]}"
                    name.with_suffix(".bin").write_bytes(data)
                    name.with_suffix(".txt").write_text(traceback.format_exc())
                log(f"  finding in {target}: {key}")
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "ok" and len(corpus) < 64 and rng.random() < 0.05:
            corpus.append(data)  # accepted inputs are good parents
    return {"target": target, "cases": cases, "seconds": round(time.monotonic() - began, 2),
            "outcomes": counts, "findings": findings}


# ---------------------------------------------------------------------------------------
# atheris
# ---------------------------------------------------------------------------------------


def run_atheris(target_names: List[str], libfuzzer_args: List[str]) -> None:
    import atheris

    import pnmix.cache
    import pnmix.config
    import pnmix.dump
    import pnmix.format
    import pnmix.io
    import pnmix.manifest

    # Instrument pnmix's own functions (instrument_imports misses modules loaded through the
    # package's custom path setup, and instrumenting torch would only slow the runs down).
    for module in (pnmix.cache, pnmix.config, pnmix.dump, pnmix.format, pnmix.io, pnmix.manifest):
        for value in list(vars(module).values()):
            for fn in [value, *vars(value).values()] if isinstance(value, type) else [value]:
                fn = getattr(fn, "__func__", fn)
                if getattr(fn, "__module__", None) == module.__name__ and hasattr(fn, "__code__"):
                    atheris.instrument_func(fn)
    targets = Targets()
    checks = [getattr(targets, name) for name in target_names]
    count = {"cases": 0}

    def one_input(data: bytes) -> None:
        count["cases"] += 1
        if count["cases"] & (count["cases"] - 1) == 0:  # powers of two: a running count
            print(f"pnmix fuzz: {count['cases']} cases", file=sys.stderr)
        if not data:
            return
        checks[data[0] % len(checks)](data[1:])

    # Seed corpus: the valid inputs, each behind its target's selector byte, so libFuzzer starts
    # past the magic and the JSON syntax.
    corpus = Path(tempfile.mkdtemp(prefix="pnmix-fuzz-corpus-"))
    for index, name in enumerate(target_names):
        for number, data in enumerate(seeds(name)):
            (corpus / f"{name}-{number}").write_bytes(bytes([index]) + data)
    # A dictionary of the formats' words (field names, JSON tokens, the magic), so mutations make
    # inputs that parse and reach the checks behind the syntax.
    from pnmix.config import CONFIG_FIELDS

    words = [f'"{name}"' for name in CONFIG_FIELDS] + ['"adjacent"', '"half"', '"protocol"', '"metrics"',
                                                     '"seeds"', '"config"', '"mean"', '"std"', "PNKV"]
    words += [token.decode() for token in JSON_TOKENS]
    dictionary = corpus.parent / (corpus.name + ".dict")
    dictionary.write_text("".join(f"{json.dumps(w)}\n" for w in words))
    if not any(arg.startswith("-dict=") for arg in libfuzzer_args):
        libfuzzer_args = [*libfuzzer_args, f"-dict={dictionary}"]
    atheris.Setup([sys.argv[0], *libfuzzer_args, str(corpus)], one_input)
    atheris.Fuzz()


def main(argv: List[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=TARGETS + ("all",), default="all")
    parser.add_argument("--runs", type=int, default=5000, help="cases per target (mutation loop)")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="time limit per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crash-dir", type=Path, default=Path("fuzz-findings"))
    parser.add_argument("--atheris", action="store_true", help="coverage-guided fuzzing with atheris")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    names = list(TARGETS) if args.target == "all" else [args.target]
    if args.atheris:
        try:
            import atheris  # noqa: F401
        except ImportError:
            print("atheris is not installed (pip install atheris); run without --atheris for the plain loop",
                  file=sys.stderr)
            return 2
        run_atheris(names, extra)
        return 0
    results = []
    for name in names:
        try:
            result = run_loop(name, args.runs, args.seconds, args.seed, args.crash_dir)
        except ImportError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        results.append(result)
        print(f"{name}: {result['cases']} cases in {result['seconds']} s, outcomes {result['outcomes']}, "
              f"{len(result['findings'])} findings")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(r["findings"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
