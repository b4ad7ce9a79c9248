"""A tiny random Llama-family model in a Hugging Face folder, made locally (nothing downloaded):
what the tests and `pnmix bench onnx` smoke runs export when no real model is wanted."""

from __future__ import annotations

from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "capital city france paris river country people year new first world time water name known "
         "large small north south east west old long great part place house school war day king").split()


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
