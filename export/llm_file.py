"""An LLM file's metadata, read back without its weights (`pnmix export --model` writes it).

This is what every reader of such a file needs (`pnmix generate`, `pnmix verify --onnx --model`,
`pnmix build-engine`): which model, which cache layout, which tokenizer. It imports nothing of
transformers or pnmix.hf, so the TensorRT build and the runtimes can use it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError, describe
from pnmix.format import CacheLayout

from .tracing import META_PREFIX

LLM_KIND = "llm"
# metadata keys of an LLM file (each read back by LlmFileInfo)
META_KEYS = ("kind", "format_version", "config", "max_seq_len", "batch", "model", "model_type", "layers",
             "q_heads", "kv_heads", "head_dim", "vocab_size", "dtype", "tokenizer_sha256")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id): two tokenizers that map any text to other
    ids differ here."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class LlmFileInfo:
    path: Path
    config: PnMixConfig
    layout: CacheLayout
    model: str
    model_type: str
    layers: int
    q_heads: int
    vocab_size: int
    dtype: str
    tokenizer_sha256: str

    @property
    def max_seq_len(self) -> int:
        return self.layout.max_seq_len

    def check_room(self, seq_len: int, n: int) -> None:
        """n more tokens must fit the file's cache (every runtime of the file checks this first)."""
        if seq_len + n > self.max_seq_len:
            raise PnMixError(f"cache capacity exceeded: {seq_len} + {n} tokens > max_seq_len {self.max_seq_len} "
                             f"of {self.path.name} (export with a larger --max-seq-len)")


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
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise PnMixError(f"{path} lacks the metadata field {META_PREFIX}{missing[0]}")
    try:
        config = PnMixConfig.from_mapping(json.loads(meta["config"]))
        layout = CacheLayout(config, int(meta["batch"]), int(meta["kv_heads"]), int(meta["head_dim"]),
                             int(meta["max_seq_len"]))
        return LlmFileInfo(path, config, layout, meta["model"], meta["model_type"], int(meta["layers"]),
                           int(meta["q_heads"]), int(meta["vocab_size"]), meta["dtype"], meta["tokenizer_sha256"])
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


