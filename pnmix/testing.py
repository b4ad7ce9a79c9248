"""Configurations that exercise every corner of the packed format, shared by the kernel tests of
every backend (and handy for checking a new backend): one table, so all backends face the same
cases; and a tiny random Llama-family model in a Hugging Face folder, made locally (nothing
downloaded): what the tests and `pnmix bench onnx` smoke runs export when no real model is wanted."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    import torch

SMALL = dict(group_size=16, residual_size=24, sink_tokens=5)

# The non-default configuration of the verify checks: other pair layout, bit widths and sizes.
OTHER_CONFIG = dict(pair_layout="half", key_high_bits=4, key_low_bits=2, value_bits=4,
                    group_size=64, residual_size=96, sink_tokens=8, high_ratio=0.25)

KERNEL_CONFIGS = {
    "manifest": {},
    "small": SMALL,
    "other": OTHER_CONFIG,
    # 1-bit and 4-bit keys, 1-bit values in blocks of 8 channels
    "bits_4_1": dict(SMALL, key_high_bits=4, key_low_bits=1, value_bits=1, value_group_size=8),
    # codes that straddle bytes: 5/3-bit keys, 3-bit values, a group of 24 (not a power of two),
    # a residual much larger than a group
    "straddle": dict(group_size=24, residual_size=56, sink_tokens=3, key_high_bits=5,
                     key_low_bits=3, value_bits=3, value_group_size=16, pair_layout="half"),
    "all_high_8": dict(SMALL, high_ratio=1.0, key_high_bits=8, value_bits=8),
    "no_sink": dict(group_size=8, residual_size=8, sink_tokens=0, key_high_bits=2, key_low_bits=1),
}


def schedule_list_model(config, chunks):
    """docs/METHOD.md section 2 in plain lists, the oracle for the cache's schedule: each token goes to the
    sink while it has room, else to the residual; after each append, while the residual holds
    >= residual_size tokens its oldest group_size become a group. Returns token positions
    (sink, groups, residual)."""
    sink: List[int] = []
    groups: List[List[int]] = []
    residual: List[int] = []
    position = 0
    for n in chunks:
        for _ in range(n):
            (sink if len(sink) < config.sink_tokens else residual).append(position)
            position += 1
        while len(residual) >= config.residual_size:
            groups.append(residual[: config.group_size])
            del residual[: config.group_size]
    return sink, groups, residual


def make_random_kv(batch: int, heads: int, n: int, dim: int, seed: int = 0, scale: float = 1.0,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (k, v) of shape (batch, heads, n, dim): k drawn first, then v, from one generator seeded
    with seed, times scale, in dtype (fp16 unless told). The one source of random K/V in the tests."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if dtype is None else dtype
    k = (torch.randn(batch, heads, n, dim, generator=g) * scale).to(dtype)
    v = (torch.randn(batch, heads, n, dim, generator=g) * scale).to(dtype)
    return k, v


WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "capital city france paris river country people year new first world time water name known "
         "large small north south east west old long great part place house school war day king").split()


def tiny_llama(seed: int = 0, vocab_size: int = 256, layers: int = 2):
    """A random LlamaForCausalLM in memory (4 query heads, 2 KV heads of 32 channels, hidden 64),
    in eval mode: the cache tests' model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(config).eval()


def make_tiny_model(folder: Path, model_type: str = "llama", layers: int = 2, seed: int = 0,
                    max_positions: int = 1024) -> Path:
    """Save a random ``model_type`` causal LM (2 layers, 4 query / 2 KV heads of 16 channels) and a
    word-level tokenizer into folder; returns folder."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + list(WORDS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    classes = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    prefix = classes[model_type]
    config = getattr(transformers, prefix + "Config")(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions, rope_theta=10000.0,
        tie_word_embeddings=model_type == "qwen3", eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
    with torch.no_grad():  # larger than the init's 0.02 so the layers matter for the logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_tiny_gguf(path: Path, layers: int = 2, seed: int = 0, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                   ffn: int = 128, vocab: int = 128, architecture: str = "llama", header: dict | None = None,
                   rename: dict | None = None, poison: str | None = None) -> Path:
    """Write a random Llama-family GGUF file (fp32 tensors, no tokenizer) of ``layers`` blocks:
    the model transformers builds from it has every weight. ``header``: llama.* fields to write
    instead (``{"block_count": 3}``, ``{"embedding_length": 0}``); ``rename``: tensor names to
    write under another name; ``poison``: a tensor whose first value is NaN. Returns path."""
    import numpy as np
    from gguf import GGUFWriter

    fields = {"context_length": 256, "block_count": layers, "feed_forward_length": ffn, "embedding_length": hidden,
              "rope.dimension_count": hidden // heads, "attention.head_count": heads,
              "attention.head_count_kv": kv_heads, "vocab_size": vocab}
    fields.update(header or {})
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * head_dim), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture)
    writer.add_string("general.name", "pnmix-tiny")
    for key, value in fields.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.rope.freq_base", 10000.0)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-5)
    for name, shape in shapes.items():
        tensor = (np.ones(shape) if len(shape) == 1 else rng.normal(0.0, 0.15, shape)).astype(np.float32)
        if name == poison:
            tensor.reshape(-1)[0] = np.nan
        writer.add_tensor((rename or {}).get(name, name), tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class PluginField(ctypes.Structure):
    """pnmix_field (plugin_fields.h) == nvinfer1::PluginField: how the tests hand libpnmix_fields
    a TensorRT plugin's fields (the config itself is pnmix.backends.native.CConfig)."""

    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.c_void_p), ("type", ctypes.c_int32),
                ("length", ctypes.c_int32)]


# pnmix_task and pnmix_parallel_for (pnmix_core.h): a caller's parallel-for, as the tests hand one
# to the core's `_on` calls.
TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)
RUNNER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, TASK, ctypes.c_void_p, ctypes.c_int64)


def reverse_order_runner(ran: List[int]):
    """A pnmix_parallel_for that runs every item on the calling thread, last first, appending each
    item to `ran` (keep the returned callback alive while the library may call it)."""

    def backwards(ctx, task, task_ctx, items):
        for item in reversed(range(items)):
            ran.append(item)
            task(task_ctx, item)
        return 0

    return RUNNER(backwards)
