"""An LLM file's metadata, read back without its weights and checked against its graph
(`pnmix export --model` writes it).

This is what every reader of such a file needs (`pnmix generate`, `pnmix verify --onnx --model`,
`pnmix bench onnx --model`, `pnmix build-engine`): which model, which cache layout, which tokenizer.
``read_llm_info`` trusts none of the ``pnmix.*`` metadata: each value is parsed strictly, then
checked against the graph it describes (the inputs and outputs, their shapes and types, the state
of every layer, the pn-mix nodes' config, the weights' dtype, the RoPE tables' capacity), and the
weights file beside the graph against the digest recorded at export, all before anything runs
or allocates (docs/OPS.md section 8). It imports nothing of transformers or pnmix.hf, so the
TensorRT build and the runtimes can use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, get_type_hints

from pnmix.cache import check_room
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError, describe, one_line
from pnmix.format import STATE_NAMES, CacheLayout

from .tracing import META_PREFIX, state_name

LLM_KIND = "llm"
# 2: pnmix.data_sha256 binds the graph to its weights file. Version 1 files (exported before it)
# are refused: nothing would tell their weights from a zeroed or swapped file (docs/OPS.md section 8).
FORMAT_VERSION = "2"
DATA_DIGEST = "sha256"  # hashlib's name; the fastest of sha256/blake2b/sha512 measured on SmolLM2's 540 MB
# What PnMixDecoder (export/llama.py) names in the traced graph, which the metadata is checked
# against: the RoPE tables ([max_seq_len, head_dim]) and a layer's query projection ([q_heads *
# head_dim, hidden]). The token embedding (its dtype is the file's) is the table the Gather of
# input_ids reads: "embed", or "lm_head" where the model ties them (SmolLM2).
ROPE_TABLES = ("rope_cos", "rope_sin")
Q_PROJ = "layers.0.q_proj.weight"
GRAPH_DTYPES = {1: "fp32", 10: "fp16"}  # onnx.TensorProto.FLOAT, FLOAT16
_INT64 = 7  # onnx.TensorProto.INT64
# The metadata's text fields, each as the exporter writes it (anything else is an edited file).
_INTEGER = re.compile(r"[0-9]{1,12}")
MAX_INTEGER_FIELD = 2**31 - 1
_TEXT_FIELDS = {
    "model": re.compile(r"[^\x00-\x1f\x7f]{1,4096}"),
    "model_type": re.compile(r"[a-z][a-z0-9_]{0,63}"),
    "dtype": re.compile(r"fp32|fp16"),
    "tokenizer_sha256": re.compile(r"[0-9a-f]{64}"),
    "data_sha256": re.compile(r"[0-9a-f]{64}"),
}


@dataclass(frozen=True)
class LlmMetadata:
    """The ``pnmix.*`` metadata of an LLM file: export/llm.py writes ``to_props()``, read_llm_info
    reads ``from_props()``; the keys are the field names, plus ``kind`` and ``format_version``."""

    config: PnMixConfig
    max_seq_len: int
    batch: int
    model: str
    model_type: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    tokenizer_sha256: str
    data_sha256: str  # the DATA_DIGEST of the weights file (model.onnx.data), hex

    @classmethod
    def keys(cls) -> Tuple[str, ...]:
        """Every metadata key of an LLM file (without the pnmix. prefix), in the order written."""
        return ("kind", "format_version", *(f.name for f in fields(LlmMetadata)))

    def to_props(self) -> Dict[str, str]:
        """The metadata as the file stores it: strings (the config as sorted JSON)."""
        props = {"kind": LLM_KIND, "format_version": FORMAT_VERSION}
        for f in fields(LlmMetadata):
            value = getattr(self, f.name)
            props[f.name] = json.dumps(value.to_dict(), sort_keys=True) if isinstance(value, PnMixConfig) \
                else str(value)
        return props

    @staticmethod
    def values_from_props(props: Mapping[str, str], where: str = "the file") -> Dict[str, Any]:
        """The fields' values from a file's metadata, each parsed strictly: a one-line PnMixError
        names the first field that is not what the exporter writes."""
        kinds = get_type_hints(LlmMetadata)
        values: Dict[str, Any] = {}
        for f in fields(LlmMetadata):
            text, key = props[f.name], META_PREFIX + f.name
            if kinds[f.name] is PnMixConfig:
                values[f.name] = _config_value(text, f"{where}: metadata {key}")
            elif kinds[f.name] is int:
                if not _INTEGER.fullmatch(text) or not 1 <= int(text) <= MAX_INTEGER_FIELD:
                    raise PnMixError(f"{where}: metadata {key} must be an integer 1..{MAX_INTEGER_FIELD}, "
                                     f"got {_shown(text)}")
                values[f.name] = int(text)
            else:
                if not _TEXT_FIELDS[f.name].fullmatch(text):
                    raise PnMixError(f"{where}: metadata {key} is not what `pnmix export --model` writes: {_shown(text)}")
                values[f.name] = text
        return values


def _shown(text: str, most: int = 60) -> str:
    """A metadata value in an error: quoted, escaped (one line), cut at ``most`` characters."""
    return repr(text[:most]) + ("..." if len(text) > most else "")


def _config_value(text: str, where: str) -> PnMixConfig:
    from pnmix.io import parse_json  # deep nesting and huge integers are one line there

    mapping = parse_json(text, where)
    if not isinstance(mapping, dict):
        raise PnMixError(f"{where} must be a JSON object of config fields, got {type(mapping).__name__}")
    try:
        return PnMixConfig.from_mapping(mapping)
    except PnMixError as exc:
        raise PnMixError(f"{where}: {exc}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise PnMixError(f"{where}: {describe(exc)}") from None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id): two tokenizers that map any text to other
    ids differ here."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class LlmFileInfo(LlmMetadata):
    """An LLM file's metadata and where the file is."""

    path: Path
    layout: CacheLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the layout's own checks (ValueError or PnMixError) run when the metadata is read
        object.__setattr__(self, "layout", CacheLayout(self.config, self.batch, self.kv_heads, self.head_dim,
                                                       self.max_seq_len))

    def check_room(self, seq_len: int, n: int, asked: str = "") -> None:
        """n more tokens must fit the file's cache (every runtime of the file checks this first);
        ``asked``: what asked for them, for the error."""
        check_room(seq_len, n, self.max_seq_len,
                   f" of {self.path.name}{': ' + asked if asked else ''} (export with a larger --max-seq-len)")


def is_llm_file(path: Path) -> bool:
    """Whether the file is an LLM file (metadata pnmix.kind = llm), read without its weights."""
    import onnx

    from pnmix.io import MODEL_LIMIT, read_input

    try:  # a regular file of bounded size first: /dev/zero or a FIFO must not be read here
        proto = onnx.load_from_string(read_input(path, "ONNX model", MODEL_LIMIT))
    except Exception:  # not readable as ONNX: the caller's own loader gives the one-line reason
        return False
    return any(p.key == META_PREFIX + "kind" and p.value == LLM_KIND for p in proto.metadata_props)


def read_llm_info(path: Path) -> LlmFileInfo:
    """The metadata of an exported LLM file, checked against its graph (read without its weights)
    and its weights file against the recorded digest."""
    import onnx
    from google.protobuf.message import DecodeError

    from .modelfile import check_external_data

    from pnmix.io import MODEL_LIMIT, read_input

    path = Path(path)
    try:
        proto = onnx.load_from_string(read_input(path, "ONNX model", MODEL_LIMIT))
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise PnMixError(f"{path} is not an ONNX model: {describe(exc)}") from None
    check_external_data(proto, path.parent)
    meta: Dict[str, str] = {}
    for prop in proto.metadata_props:
        if prop.key.startswith(META_PREFIX):
            if prop.key[len(META_PREFIX):] in meta:  # which of two would ONNX Runtime's readers take?
                raise PnMixError(f"{path} has the metadata field {prop.key} twice")
            meta[prop.key[len(META_PREFIX):]] = prop.value
    if meta.get("kind") != LLM_KIND:
        raise PnMixError(f"{path} is not an LLM file exported by `pnmix export --model` (for the diagnostic "
                         "model use `pnmix verify --onnx` without --model)")
    version = meta.get("format_version")
    if version == "1":
        raise PnMixError(f"{path} is an LLM file of format 1, exported before pnmix recorded the digest of its "
                         f"weights file ({META_PREFIX}data_sha256), without which a changed or swapped "
                         f"{path.name}.data cannot be told apart: export it again with `pnmix export --model`")
    if version != FORMAT_VERSION:
        raise PnMixError(f"{path}: metadata {META_PREFIX}format_version is {_shown(str(version))}; this pnmix "
                         f"reads LLM files of format {FORMAT_VERSION}")
    missing = [key for key in LlmMetadata.keys() if key not in meta]
    if missing:
        raise PnMixError(f"{path} lacks the metadata field {META_PREFIX}{missing[0]}")
    values = LlmMetadata.values_from_props(meta, str(path))
    check_graph(proto, values, path)
    try:
        info = LlmFileInfo(**values, path=path)
    except (ValueError, TypeError) as exc:
        raise PnMixError(f"{path} has unreadable pnmix metadata: {describe(exc)}") from None
    check_state_tensors(proto, info)
    check_weights_file(proto, path, info.data_sha256)
    return info


# ---------------------------------------------------------------------------------------
# The metadata against the graph
# ---------------------------------------------------------------------------------------


def _dims(value: Any) -> Optional[List[Any]]:
    """A graph value's shape: ints for fixed axes, the name (or None) for dynamic ones; None
    without a shape."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]


def _type_name(elem_type: int) -> str:
    import onnx

    try:
        return onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"element type {elem_type}"


def llm_interface(layers: int) -> Tuple[List[str], List[str]]:
    """The input and output names of an LLM file of ``layers`` layers (docs/OPS.md section 8)."""
    inputs = ["input_ids", "seq_len", "new_len"] + [state_name(n, i) for i in range(layers) for n in STATE_NAMES]
    outputs = ["logits"] + [state_name(n, i, present=True) for i in range(layers) for n in STATE_NAMES]
    return inputs, outputs


def check_graph(proto: Any, values: Mapping[str, Any], path: Path) -> None:
    """Each metadata value against what the graph says of it: the layers (state inputs and pn-mix
    nodes), batch (input_ids), vocab_size (logits), kv_heads and head_dim (the state), max_seq_len
    (the RoPE tables), q_heads (the query projection), dtype (the embedding), config (the nodes'
    attributes). The first disagreement is one PnMixError naming the field."""
    from . import ops

    graph = proto.graph

    def differs(name: str, graph_says: str) -> PnMixError:
        return PnMixError(f"{path}: metadata {META_PREFIX}{name} is {values[name]!r}, but the graph {graph_says}")

    names = [v.name for v in graph.input]
    layers = max(0, (len(names) - 3) // len(STATE_NAMES))
    want_inputs, want_outputs = llm_interface(layers)
    if names != want_inputs or layers < 1:
        raise PnMixError(f"{path} is not an LLM file of `pnmix export --model`: its inputs are {names[:4]}..., "
                         f"not input_ids, seq_len, new_len and the {len(STATE_NAMES)} state tensors of each layer")
    if [v.name for v in graph.output] != want_outputs:
        raise PnMixError(f"{path} is not an LLM file of `pnmix export --model`: its outputs are not logits and the "
                         f"present state of its {layers} layers")
    if values["layers"] != layers:
        raise differs("layers", f"has the state of {layers} layers")
    found = {op: len(ops.pnmix_nodes(graph, op)) for op in (ops.ATTENTION_OP, ops.APPEND_OP)}
    if set(found.values()) != {layers}:
        raise PnMixError(f"{path}: the graph has {found[ops.ATTENTION_OP]} {ops.ATTENTION_OP} and "
                         f"{found[ops.APPEND_OP]} {ops.APPEND_OP} nodes for {layers} layers")
    inputs = {v.name: v for v in graph.input}
    outputs = {v.name: v for v in graph.output}
    ids = _dims(inputs["input_ids"])
    if inputs["input_ids"].type.tensor_type.elem_type != _INT64 or ids is None or len(ids) != 2 \
            or not isinstance(ids[0], int) or isinstance(ids[1], int):
        raise PnMixError(f"{path}: input input_ids must be int64 [batch, n] with n dynamic, got "
                         f"{_type_name(inputs['input_ids'].type.tensor_type.elem_type)} {ids}")
    for name in ("seq_len", "new_len"):
        if inputs[name].type.tensor_type.elem_type != _INT64 or _dims(inputs[name]) != []:
            raise PnMixError(f"{path}: input {name} must be an int64 scalar")
    if values["batch"] != ids[0]:
        raise differs("batch", f"takes input_ids of batch {ids[0]}")
    logits = _dims(outputs["logits"])
    if outputs["logits"].type.tensor_type.elem_type != 1 or logits is None or len(logits) != 3 \
            or not isinstance(logits[2], int):
        raise PnMixError(f"{path}: output logits must be fp32 [batch, 1, vocab], got {logits}")
    if values["vocab_size"] != logits[2]:
        raise differs("vocab_size", f"gives logits over {logits[2]} tokens")
    state = _dims(inputs[state_name("residual_k", 0)])
    if state is None or len(state) != 4 or not all(isinstance(d, int) for d in state):
        raise PnMixError(f"{path}: input {state_name('residual_k', 0)} must have a fixed 4-D shape, got {state}")
    if values["kv_heads"] != state[1]:
        raise differs("kv_heads", f"keeps the state of {state[1]} KV heads")
    if values["head_dim"] != state[3]:
        raise differs("head_dim", f"keeps K/V of {state[3]} channels")
    weights = {t.name: t for t in graph.initializer}
    embed = embedding(graph)
    if embed is None or embed.data_type not in GRAPH_DTYPES or len(embed.dims) != 2:
        raise PnMixError(f"{path}: the graph has no 2-D fp32 or fp16 embedding that input_ids index (not an export "
                         "of this pnmix?)")
    if values["dtype"] != GRAPH_DTYPES[embed.data_type]:
        raise differs("dtype", f"holds {GRAPH_DTYPES[embed.data_type]} weights (its embedding {embed.name} is "
                               f"{_type_name(embed.data_type)})")
    for table in ROPE_TABLES:
        rows = list(weights[table].dims) if table in weights else None
        if rows is None or len(rows) != 2 or rows[1] != values["head_dim"]:
            raise PnMixError(f"{path}: the graph has no {table} table of [positions, head_dim], got {rows}")
        if values["max_seq_len"] != rows[0]:
            raise differs("max_seq_len", f"tabulates RoPE for {rows[0]} positions ({table})")
    q_proj = list(weights[Q_PROJ].dims) if Q_PROJ in weights else None
    if q_proj is None or len(q_proj) != 2 or q_proj[0] % values["head_dim"]:
        raise PnMixError(f"{path}: the graph has no {Q_PROJ} of [q_heads * head_dim, hidden], got {q_proj}")
    if values["q_heads"] != q_proj[0] // values["head_dim"]:
        raise differs("q_heads", f"projects {q_proj[0] // values['head_dim']} query heads ({Q_PROJ})")
    said = dict(values["config"].to_dict(), high_ratio=ops.fp32_ratio(values["config"]))  # as a FLOAT attribute
    for op in (ops.ATTENTION_OP, ops.APPEND_OP):
        for node in ops.pnmix_nodes(graph, op):
            try:
                carried = ops.config_from_attributes(node).to_dict()
            except (PnMixError, ValueError, TypeError) as exc:
                raise PnMixError(f"{path}: a {op} node's attributes are not a config: {describe(exc)}") from None
            for key, value in carried.items():
                if said[key] != value:
                    raise PnMixError(f"{path}: metadata {META_PREFIX}config has {key} {said[key]!r}, but the "
                                     f"graph's {op} nodes carry {value!r}")


def embedding(graph: Any) -> Any:
    """The initializer the graph's Gather of input_ids reads (the token embedding), or None."""
    weights = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == "input_ids":
            return weights.get(node.input[0])
    return None


def check_state_tensors(proto: Any, info: LlmFileInfo) -> None:
    """Every layer's past and present state: the names, element types and the shapes
    pnmix.format.CacheLayout gives the metadata's layout."""
    from . import ops

    inputs = {v.name: v for v in proto.graph.input}
    outputs = {v.name: v for v in proto.graph.output}
    want = info.layout.state_shapes()
    for layer in range(info.layers):
        for name in STATE_NAMES:
            for value in (inputs[state_name(name, layer)], outputs[state_name(name, layer, present=True)]):
                elem_type = value.type.tensor_type.elem_type
                if elem_type != ops.STATE_ONNX_TYPES[name]:
                    raise PnMixError(f"{info.path}: {value.name} is {_type_name(elem_type)}, the state's {name} "
                                     f"is {_type_name(ops.STATE_ONNX_TYPES[name])}")
                if _dims(value) != list(want[name]):
                    raise PnMixError(f"{info.path}: {value.name} has shape {_dims(value)}, but the metadata's config, "
                                     f"batch, kv_heads, head_dim and max_seq_len give {list(want[name])}")


# ---------------------------------------------------------------------------------------
# The weights file: its extent and its digest
# ---------------------------------------------------------------------------------------

RACY_SECONDS = 2.0
_DIGESTS: Dict[Tuple[int, ...], str] = {}  # (device, inode, size, mtime) -> digest: one hash per file and process


def check_weights_file(proto: Any, path: Path, recorded: str) -> None:
    """The file's one weights file must hold every external tensor's bytes where the graph says
    (ONNX Runtime would fail on it with log lines of its own) and be the file it was exported
    with: its DATA_DIGEST equals the metadata's data_sha256. A file that holds all its weights
    itself (saved again without external data) has no weights file to bind."""
    import onnx

    from .modelfile import all_tensors

    locations = set()
    for tensor in all_tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL and not len(tensor.external_data):
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location", "")
        locations.add(location)
        data = path.parent / location
        try:
            offset = _byte_count(entries.get("offset", "0"))
            length = _byte_count(entries["length"]) if "length" in entries else None
            item = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (ValueError, KeyError, TypeError):
            raise PnMixError(f"{path}: tensor '{tensor.name}' has an unreadable external-data entry "
                             f"{_shown(one_line(entries))}") from None
        need = item
        for dim in tensor.dims:
            need *= dim
        if length is not None and length != need:
            raise PnMixError(f"{path}: tensor '{tensor.name}' says its external data is {length} bytes; its shape "
                             f"{list(tensor.dims)} of {_type_name(tensor.data_type)} needs {need}")
        size = data.stat().st_size
        if offset + need > size:
            raise PnMixError(f"{path}: tensor '{tensor.name}' lies at bytes {offset}..{offset + need} of {location}, "
                             f"which has {size} bytes (truncated?)")
    if not locations:  # every weight inside the graph (onnx.save of a loaded file): nothing beside it to bind
        return
    if len(locations) != 1:
        raise PnMixError(f"{path}: an LLM file keeps its weights in one external-data file, this one names "
                         f"{len(locations)}")
    data = path.parent / locations.pop()
    digest = data_digest(data)
    if digest != recorded:
        raise PnMixError(f"{path}: the weights file {data.name} is not the one it was exported with ({DATA_DIGEST} "
                         f"{digest[:16]}..., the metadata records {recorded[:16]}...): it was changed, truncated "
                         "or swapped; export the model again")


def _byte_count(text: str) -> int:
    if not _INTEGER.fullmatch(text):
        raise ValueError(text)
    return int(text)


def data_digest(path: Path) -> str:
    """The DATA_DIGEST of a weights file (hex), computed once per process for a file that has not
    changed since (same inode, size and modification time)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise PnMixError(f"cannot read weights file {path}: {exc.strerror or describe(exc)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PnMixError(f"weights file is not a regular file: {path}")
        key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)  # a rename keeps them
        if key not in _DIGESTS:
            digest = hashlib.new(DATA_DIGEST)
            buffer = bytearray(1 << 23)
            view = memoryview(buffer)
            with os.fdopen(os.dup(fd), "rb", buffering=0) as stream:
                while True:
                    count = stream.readinto(buffer)
                    if not count:
                        break
                    digest.update(view[:count])
            # Kept only for a file older than RACY_SECONDS: a change within the file system's
            # timestamp granularity of the hash could leave the same key (git's "racily clean")
            if time.time() - info.st_mtime > RACY_SECONDS:
                _DIGESTS.clear()  # one entry: a process reads one model's weights at a time
                _DIGESTS[key] = digest.hexdigest()
            return digest.hexdigest()
        return _DIGESTS[key]
    except OSError as exc:
        raise PnMixError(f"cannot read weights file {path}: {exc.strerror or describe(exc)}") from None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# The file against a model and a tokenizer
# ---------------------------------------------------------------------------------------


def check_tokenizer(info: LlmFileInfo, tokenizer: Any, name: str) -> None:
    """A tokenizer that does not match the file is refused: its ids would mean other tokens."""
    size = len(tokenizer)
    if size > info.vocab_size:
        raise PnMixError(f"tokenizer {name} has {size} tokens but {info.path.name} was exported from "
                         f"{info.model} with a vocabulary of {info.vocab_size}: use the model's own tokenizer")
    if tokenizer_fingerprint(tokenizer) != info.tokenizer_sha256:
        raise PnMixError(f"tokenizer {name} is not the tokenizer of {info.model}, which {info.path.name} was "
                         "exported from (vocabulary differs): use that model's tokenizer")


MODEL_FACTS = ("model_type", "layers", "q_heads", "kv_heads", "head_dim", "vocab_size")


def check_model(info: LlmFileInfo, name: str, facts: Mapping[str, Any], tokenizer: Any) -> None:
    """MODEL (``name``, its ``facts``: MODEL_FACTS read from its config) must be the model the file
    was exported from, as far as its tokenizer and shapes say: another one would be measured or
    compared against this file's weights."""
    for fact in MODEL_FACTS:
        if facts[fact] != getattr(info, fact):
            raise PnMixError(f"{info.path.name} was exported from {info.model} ({fact} {getattr(info, fact)!r}), "
                             f"not from {name} ({fact} {facts[fact]!r})")
    check_tokenizer(info, tokenizer, name)
