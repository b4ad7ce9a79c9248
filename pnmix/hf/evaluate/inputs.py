"""What an evaluation reads: the text (a file or the bundled Hamlet), its tokens (the model's
tokenizer, or UTF-8 bytes), and the model itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional


from ...errors import PnMixError


class Text:
    """The model's tokenizer, or UTF-8 bytes as ids for a folder without one (random test models)."""

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: an id at or past it has no embedding
        self.name = type(tokenizer).__name__ if tokenizer is not None else "utf-8 bytes"

    def encode(self, text: str) -> List[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.vocab_size and ids and max(ids) >= self.vocab_size:
            raise PnMixError(f"the tokenizer gives id {max(ids)} but the model's vocabulary has {self.vocab_size} "
                             "ids: the tokenizer is not this model's")
        return ids

    def decode(self, ids: List[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_text_tokens(source, model_config: Any) -> Text:
    from ..models import load_tokenizer

    has_tokenizer = source.gguf_file is not None or any(
        (source.folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    vocab = int(getattr(model_config, "vocab_size", 0) or 0)
    if has_tokenizer:
        return Text(load_tokenizer(source), vocab)
    if vocab < 256:
        raise PnMixError(f"{source.spec} has no tokenizer and a vocabulary of {vocab} < 256: "
                         "cannot feed text as bytes")
    return Text()


def read_text(path: Optional[Path]) -> str:
    """The text file, or the bundled Hamlet."""
    from ...dataset import text_or_hamlet

    return text_or_hamlet(path)


def load_model(model_dir: Path):
    """A causal LM from a local folder or GGUF file (pnmix.hf.models), for the speed tool."""
    from ..models import load_causal_lm, resolve_model

    return load_causal_lm(resolve_model(model_dir))
