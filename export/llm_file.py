"""An LLM file's metadata, read back without its weights (`pnmix export --model` writes it).

This is what every reader of such a file needs (`pnmix generate`, `pnmix verify --onnx --model`,
`pnmix build-engine`): which model, which cache layout, which tokenizer. It imports nothing of
transformers or pnmix.hf, so the TensorRT build and the runtimes can use it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple, get_type_hints

from pnmix.cache import check_room
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError, describe
from pnmix.format import CacheLayout

from .tracing import META_PREFIX

LLM_KIND = "llm"
FORMAT_VERSION = "1"


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
    def values_from_props(props: Mapping[str, str]) -> Dict[str, Any]:
        """The fields' values from a file's metadata (ValueError/TypeError: unreadable)."""
        kinds = get_type_hints(LlmMetadata)
        values: Dict[str, Any] = {}
        for f in fields(LlmMetadata):
            text = props[f.name]
            if kinds[f.name] is PnMixConfig:
                values[f.name] = PnMixConfig.from_mapping(json.loads(text))
            else:
                values[f.name] = kinds[f.name](text)
        return values


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
    """The metadata of an exported LLM file (the graph is read without its weights)."""
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
    meta = {p.key[len(META_PREFIX):]: p.value for p in proto.metadata_props if p.key.startswith(META_PREFIX)}
    if meta.get("kind") != LLM_KIND:
        raise PnMixError(f"{path} is not an LLM file exported by `pnmix export --model` (for the diagnostic "
                         "model use `pnmix verify --onnx` without --model)")
    missing = [key for key in LlmMetadata.keys() if key not in meta]
    if missing:
        raise PnMixError(f"{path} lacks the metadata field {META_PREFIX}{missing[0]}")
    try:
        return LlmFileInfo(**LlmMetadata.values_from_props(meta), path=path)
    except (ValueError, TypeError) as exc:
        raise PnMixError(f"{path} has unreadable pnmix metadata: {describe(exc)}") from None


def check_tokenizer(info: LlmFileInfo, tokenizer: Any, name: str) -> None:
    """A tokenizer that does not match the file is refused: its ids would mean other tokens."""
    size = len(tokenizer)
    if size > info.vocab_size:
        raise PnMixError(f"tokenizer {name} has {size} tokens but {info.path.name} was exported from "
                         f"{info.model} with a vocabulary of {info.vocab_size}: use the model's own tokenizer")
    if tokenizer_fingerprint(tokenizer) != info.tokenizer_sha256:
        raise PnMixError(f"tokenizer {name} is not the tokenizer of {info.model}, which {info.path.name} was "
                         "exported from (vocabulary differs): use that model's tokenizer")


