"""A Llama-family decoder written directly in PyTorch over the pn-mix packed cache (gpt-fast style).

``PnMixDecoder`` takes the weights of a transformers LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM or Qwen3ForCausalLM and computes what that model computes, with the cache as
explicit state: one forward is one step of the exported file (docs/OPS.md, "The LLM file"):

    input_ids [B, n], seq_len, new_len, state of every layer -> logits [B, 1, vocab], present state

Per layer: RMSNorm, q/k/v projections (biases where the model has them, Qwen2), q/k RMSNorm over
the head (Qwen3), the model's own RoPE (rotate_half with cos/sin from the model's rotary module:
its rope_theta and rope scaling, tabulated once), then ``pnmix::attention`` over the packed state
plus the new fp16 K/V and ``pnmix::append`` of those K/V, o_proj, residual, RMSNorm, gated MLP.

The arithmetic follows transformers op for op (RMSNorm in fp32, ``q*cos + rotate_half(q)*sin``,
K/V cast to fp16 after RoPE), so the fp16 K/V equal PnMixCache's whenever the projections
agree. Only the last position's logits are computed: generation needs no more, and a 4K prefill's
full logits would be [4096, vocab] fp32 (800 MB for SmolLM2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.hf.models import ModelDims

from . import torch_ops
from .tracing import state_name

# Rope types whose cos/sin do not depend on the sequence length (the table is built once from the
# model's own rotary module: yarn's and llama3's scaling included); longrope only up to its
# original_max_position_embeddings (Dims.rope_positions). "dynamic" changes with the length: refused.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ROPE_TABLE_BLOCK = 256  # positions per rotary-module call (keeps each call single-threaded)


def rope_type(model_config: Any) -> str:
    scaling = getattr(model_config, "rope_scaling", None) or {}
    params = getattr(model_config, "rope_parameters", None) or {}
    return str(scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or "default")


def rope_table(hf_model: Any, max_seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, D] from the model's own rotary module, in blocks of positions.

    Blocks keep every call below torch's parallel grain, so each element goes through the same
    vectorized cos/sin as in the model's own calls (head_dim is a multiple of the vector width)."""
    rotary = hf_model.model.rotary_emb
    probe = torch.zeros(1, dtype=hf_model.dtype)
    cos, sin = [], []
    with torch.no_grad():
        for start in range(0, max_seq_len, ROPE_TABLE_BLOCK):
            positions = torch.arange(start, min(start + ROPE_TABLE_BLOCK, max_seq_len)).unsqueeze(0)
            c, s = rotary(probe, positions)
            cos.append(c[0])
            sin.append(s[0])
    return torch.cat(cos).contiguous(), torch.cat(sin).contiguous()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal GQA attention of the new tokens over themselves (transformers' eager attention),
    fp32 [B, Hq, n, D]."""
    repeat = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(repeat, dim=1)
    v = v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * head_dim ** -0.5
    n = q.shape[2]
    # an additive mask, as transformers' eager attention adds its causal mask (ONNX Runtime's Add
    # broadcasts faster than the Where of masked_fill; x + 0 and x + -inf give the same scores)
    scores = scores + torch.full((n, n), float("-inf"), dtype=scores.dtype).triu(1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v).float()


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: the statistics in fp32, the weight applied in the model dtype."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


def _linear(source: nn.Linear) -> nn.Linear:
    layer = nn.Linear(source.in_features, source.out_features, bias=source.bias is not None,
                      dtype=source.weight.dtype)
    layer.weight = nn.Parameter(source.weight.detach(), requires_grad=False)
    if source.bias is not None:
        layer.bias = nn.Parameter(source.bias.detach(), requires_grad=False)
    return layer


def fused_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """self_attention as one SDPA, which the exporter writes as ONNX's Attention op (opset 23+):
    the same causal GQA attention, fp32 [B, Hq, n, D]."""
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                  scale=head_dim ** -0.5).float().contiguous()


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer: Any, dims: "Dims", fused_prefill: bool = False):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.dims = dims
        self.prefill_attention = fused_self_attention if fused_prefill else self_attention
        self.input_norm = RMSNorm(hf_layer.input_layernorm.weight, dims.eps)
        self.q_proj, self.k_proj, self.v_proj = _linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj)
        self.o_proj = _linear(attn.o_proj)
        self.q_norm = RMSNorm(attn.q_norm.weight, dims.eps) if hasattr(attn, "q_norm") else None
        self.k_norm = RMSNorm(attn.k_norm.weight, dims.eps) if hasattr(attn, "k_norm") else None
        self.post_norm = RMSNorm(hf_layer.post_attention_layernorm.weight, dims.eps)
        self.gate_proj, self.up_proj, self.down_proj = (_linear(mlp.gate_proj), _linear(mlp.up_proj),
                                                        _linear(mlp.down_proj))

    def forward(self, x, cos, sin, seq_len, new_len, state: Sequence[torch.Tensor], config: str, max_seq_len: int):
        d = self.dims
        batch, n, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(batch, n, d.q_heads, d.head_dim)
        k = self.k_proj(h).view(batch, n, d.kv_heads, d.head_dim)
        v = self.v_proj(h).view(batch, n, d.kv_heads, d.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: both or neither
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        q16, k16, v16 = q.to(torch.float16), k.to(torch.float16), v.to(torch.float16)
        # A prefill has nothing packed to read: like PnMixCache (pnmix.hf), it attends over the
        # prompt's own K/V in the model's precision; every other step runs the op. torch.cond
        # becomes an ONNX If, so each call computes one of the two (a prefill's op attention over
        # its own tokens cost half of a 2K prefill when both ran and a Where picked one).
        def prefill(q, k, v, q16, k16, v16, seq_len, new_len, *state):
            return self.prefill_attention(q, k, v, d.head_dim)

        def step(q, k, v, q16, k16, v16, seq_len, new_len, *state):
            return torch_ops.attention(q16, k16, v16, seq_len, new_len, state, config, max_seq_len)

        attn = torch.cond(seq_len == 0, prefill, step, (q, k, v, q16, k16, v16, seq_len, new_len, *state))
        present = torch_ops.append(k16, v16, seq_len, new_len, state, config, max_seq_len)
        attn = attn.to(x.dtype).transpose(1, 2).reshape(batch, n, d.q_heads * d.head_dim)
        x = x + self.o_proj(attn)
        h = self.post_norm(x)
        x = x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, present


@dataclass(frozen=True)
class Dims(ModelDims):
    """ModelDims plus what the decoder needs of a supported config (one-line errors for what is
    not supported: pnmix.hf.models.check_model_config, then the decoder's own limits)."""

    model_type: str
    hidden: int
    vocab: int
    eps: float
    sliding_window: Optional[int]
    rope_positions: Optional[int]  # longrope: the table is one model's only up to its original length

    @classmethod
    def from_config(cls, model_config: Any) -> "Dims":
        from pnmix.hf.models import check_model_config, rope_parameters, sliding_window

        model_type = check_model_config(model_config, "the model")
        kind = rope_type(model_config)
        if kind not in STATIC_ROPE_TYPES:
            raise PnMixError(f"rope type '{kind}' depends on the sequence length; the exporter supports "
                             f"{', '.join(STATIC_ROPE_TYPES)}")
        if getattr(model_config, "hidden_act", "silu") != "silu":
            raise PnMixError(f"hidden_act '{model_config.hidden_act}' is not the Llama family's silu")
        rope_positions = None
        if kind == "longrope":  # transformers switches to the long factors once a sequence passes it
            rope_positions = int(rope_parameters(model_config).get("original_max_position_embeddings")
                                 or getattr(model_config, "original_max_position_embeddings", 0) or 0) or None
        window = sliding_window(model_config)
        return cls(**dataclasses.asdict(ModelDims.from_config(model_config)), model_type=model_type,
                   hidden=int(model_config.hidden_size), vocab=int(model_config.vocab_size),
                   eps=float(model_config.rms_norm_eps), sliding_window=int(window) if window else None,
                   rope_positions=rope_positions)

    def check_capacity(self, max_seq_len: int) -> None:
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise PnMixError(f"--max-seq-len must be a positive integer, got {max_seq_len!r}")
        if self.max_positions and max_seq_len > self.max_positions:
            raise PnMixError(f"--max-seq-len {max_seq_len} is beyond the model's {self.max_positions} positions "
                             "(max_position_embeddings)")
        if self.sliding_window and max_seq_len > self.sliding_window:
            raise PnMixError(f"--max-seq-len {max_seq_len} is beyond the model's sliding window "
                             f"({self.sliding_window}): pn-mix keeps every token, full causal attention only")
        if self.rope_positions and max_seq_len > self.rope_positions:
            raise PnMixError(f"--max-seq-len {max_seq_len} is beyond the model's longrope "
                             f"original_max_position_embeddings ({self.rope_positions}): past it transformers "
                             "rotates every position with the long factors, a function of the sequence length "
                             "that one table cannot hold")
        from pnmix.memory import check_fits

        # the RoPE tables, cos and sin [max_seq_len, head_dim] fp32, built in blocks then joined (twice)
        check_fits(4 * max_seq_len * self.head_dim * 4, f"--max-seq-len {max_seq_len} (the RoPE tables)",
                   "lower --max-seq-len")


class PnMixDecoder(nn.Module):
    """The whole decoder of a Llama-family model over per-layer packed states (see the module doc)."""

    rope_cos: torch.Tensor  # [max_seq_len, D], buffers registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, hf_model: Any, config: PnMixConfig, max_seq_len: int, batch: int = 1,
                 fused_prefill: bool = False):
        super().__init__()
        self.dims = dims = Dims.from_config(hf_model.config)
        dims.check_capacity(max_seq_len)
        self.layout = CacheLayout(config, batch, dims.kv_heads, dims.head_dim, max_seq_len)
        self.config_text = torch_ops.config_text(config)
        self.max_seq_len = max_seq_len
        inner = hf_model.model
        self.embed = nn.Parameter(inner.embed_tokens.weight.detach(), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(layer, dims, fused_prefill) for layer in inner.layers)
        self.norm = RMSNorm(inner.norm.weight, dims.eps)
        head = hf_model.lm_head.weight
        # Tied embeddings stay one tensor (one initializer in the file).
        self.lm_head = self.embed if head is inner.embed_tokens.weight else nn.Parameter(head.detach(), requires_grad=False)
        cos, sin = rope_table(hf_model, max_seq_len)
        for name, table in (("cos", cos), ("sin", sin)):
            if not bool(torch.isfinite(table).all()):
                raise PnMixError(f"the model's RoPE {name} table holds non-finite values (rope_theta, "
                                 "rope scaling or the rotary module's inv_freq)")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # ---- state -----------------------------------------------------------------------------
    def state_names(self) -> Tuple[List[str], List[str]]:
        inputs = [state_name(name, i) for i in range(self.dims.layers) for name in STATE_NAMES]
        outputs = [state_name(name, i, present=True) for i in range(self.dims.layers) for name in STATE_NAMES]
        return inputs, outputs

    def empty_state(self) -> List[torch.Tensor]:
        """Every layer's state tensors, zeroed, flat in (layer, STATE_NAMES) order."""
        return [t for _ in range(self.dims.layers) for t in torch_ops.empty_graph_state(self.layout)]

    # ---- the step --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, seq_len: torch.Tensor, new_len: torch.Tensor,
                state: List[torch.Tensor]):
        n = input_ids.shape[1]
        # write mode starts at seq_len, evaluation (new_len 0) at seq_len - n: both seq_len + new_len - n
        positions = torch.arange(n) + (seq_len + new_len - n)
        cos = self.rope_cos[positions].unsqueeze(0).unsqueeze(0)  # [1, 1, n, D]
        sin = self.rope_sin[positions].unsqueeze(0).unsqueeze(0)
        x = nn.functional.embedding(input_ids, self.embed)
        present: List[torch.Tensor] = []
        count = len(STATE_NAMES)
        for i, layer in enumerate(self.layers):
            x, layer_present = layer(x, cos, sin, seq_len, new_len, state[i * count:(i + 1) * count],
                                     self.config_text, self.max_seq_len)
            present.extend(layer_present)
        last = self.norm(x[:, -1:, :])
        logits = nn.functional.linear(last, self.lm_head).to(torch.float32)
        return (logits, *present)
