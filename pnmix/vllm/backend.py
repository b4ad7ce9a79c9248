"""The PNMIX attention backend for vLLM's CPU platform (docs/VLLM.md). Imported by vLLM only.

vLLM owns the pages and the batching; this backend owns a page's bytes (``customize_spec``: a
block of ``group_size`` tokens per page, ``PageLayout.token_bytes`` per KV head and token) and,
per layer, the sequence slots (sink, residual, pair mask). Each step, per sequence:

* a sequence's first chunk (nothing cached yet): causal attention over its own K/V in the model's
  precision, as PnMixCache's prefill; then the chunk is appended (the pair mask from its keys);
* any later chunk or decode token: attention over the cache as stored plus the new tokens in fp16
  through libpnmix_core; then the tokens are appended, full groups flushed into their pages.

Attention comes before the append (``forward_includes_kv_cache_update``), as the pn-mix ops run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, List, Optional, Tuple

import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..errors import PnMixError
from .config import engine_config, layer_pages
from .plugin import SELECT_AS
from .paged import PagedLayerCache, PageLayout, SlotTable, prefill_attention, sequence_rows


def _engine_group_size() -> int:
    return engine_config().group_size


def _fail(exc: PnMixError) -> ValueError:
    """vLLM reports a worker's start-up exception by its message: keep it one line, say whose."""
    return ValueError(f"pnmix: {exc}")


class PnMixAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[List[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[List[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return SELECT_AS  # vLLM looks the backend up by this name in its registry

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [_engine_group_size()]  # a block is one quantized group

    @classmethod
    def supported_kv_cache_layouts(cls) -> Tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # a head's part of a block is one run of bytes

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """A page is bytes: per KV head and token, the share of one packed group."""
        if spec.state_content_bytes is not None:
            return spec
        try:
            pages = PageLayout(engine_config(), spec.num_kv_heads, spec.head_size, spec.block_size)
        except PnMixError as exc:
            raise _fail(exc) from None
        return replace(spec, dtype=torch.uint8, state_content_bytes=pages.token_bytes)

    @staticmethod
    def get_impl_cls() -> type["PnMixAttentionImpl"]:
        return PnMixAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["PnMixMetadataBuilder"]:
        return PnMixMetadataBuilder


@dataclass
class DecodeRows:
    """The step's sequences that decode one token over a cache they already hold: attended in one
    core call and appended together (PagedLayerCache.attend_decode, append_decode)."""

    tokens: torch.Tensor        # int64 [N]: each one's query token
    block_table: torch.Tensor   # [N, max_blocks]
    slots: List[int]
    seq_lens: List[int]         # tokens cached before this step


@dataclass
class PnMixMetadata:
    num_actual_tokens: int
    rows: List[Tuple[int, int, int]]  # (first query token, query tokens, tokens cached before)
    slots: List[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    decode: Optional[DecodeRows] = None
    others: List[int] = field(default_factory=list)  # the rows that are not decode's: first and later chunks


def split_decode(rows: List[Tuple[int, int, int]], slots: List[int], table: torch.Tensor):
    """(DecodeRows or None, the other rows' indices): one-token rows over a cache apart."""
    decode = [i for i, (_, n, cached) in enumerate(rows) if n == 1 and cached > 0]
    others = sorted(set(range(len(rows))) - set(decode))
    if not decode:
        return None, others
    index = torch.tensor(decode, dtype=torch.long)
    return DecodeRows(tokens=torch.tensor([rows[i][0] for i in decode], dtype=torch.long),
                      block_table=table.index_select(0, index.to(table.device)),
                      slots=[slots[i] for i in decode], seq_lens=[rows[i][2] for i in decode]), others


class PnMixMetadataBuilder(AttentionMetadataBuilder[PnMixMetadata]):
    """Gives each sequence of the step its slot (once per step, shared by every layer)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: List[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.slot_table = SlotTable(vllm_config.scheduler_config.max_num_seqs)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PnMixMetadata:
        cam = common_attn_metadata
        seq_lens = cam.seq_lens_cpu_upper_bound if cam.seq_lens_cpu_upper_bound is not None else cam.seq_lens.cpu()
        rows = sequence_rows(cam.query_start_loc_cpu.tolist()[: cam.num_reqs + 1], seq_lens.tolist()[: cam.num_reqs])
        table = cam.block_table_tensor[: cam.num_reqs]
        try:
            slots = [self.slot_table.assign(int(table[i, 0]), starting=cached == 0)
                     for i, (_, _, cached) in enumerate(rows)]
        except PnMixError as exc:
            raise _fail(exc) from None
        decode, others = split_decode(rows, slots, table)
        return PnMixMetadata(num_actual_tokens=cam.num_actual_tokens, rows=rows, slots=slots, block_table=table,
                             decode=decode, others=others)


class PnMixAttentionImpl(AttentionImpl[PnMixMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[List[float]], sliding_window: Optional[int], kv_cache_dtype: str,
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, sinks: Optional[torch.Tensor] = None,
                 **_: Any) -> None:
        vllm_config = get_current_vllm_config()
        model = vllm_config.model_config.hf_config
        try:
            self.pages = layer_pages(
                model, num_kv_heads=num_kv_heads, head_size=head_size,
                block_size=vllm_config.cache_config.block_size, kv_cache_dtype=kv_cache_dtype,
                prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching), sliding_window=sliding_window,
                alibi=alibi_slopes is not None, logits_soft_cap=logits_soft_cap, sinks=sinks is not None,
                kv_sharing=kv_sharing_target_layer_name is not None)
        except PnMixError as exc:
            raise _fail(exc) from None
        from ..backends import default_ops

        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        # The slots are allocated here, at start-up, before vLLM sizes its pages from what is left.
        self.cache = PagedLayerCache(self.pages, vllm_config.scheduler_config.max_num_seqs, ops=default_ops("cpu"))

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[PnMixMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None, output_block_scale: Optional[torch.Tensor] = None,
                **_: Any) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the PNMIX backend")
        if attn_metadata is None:  # the profiling run
            return output
        pages = kv_cache.view(kv_cache.shape[0], self.num_kv_heads, self.pages.head_page_bytes)
        decode = attn_metadata.decode
        if decode is not None:  # the decode tokens: one core call, one append, for all of them
            q, k, v = query.index_select(0, decode.tokens), key.index_select(0, decode.tokens), \
                value.index_select(0, decode.tokens)
            out = self.cache.attend_decode(pages, decode.block_table, decode.slots, decode.seq_lens, q, k, v,
                                           self.scale)
            output.index_copy_(0, decode.tokens, out.to(output.dtype))
            self.cache.append_decode(pages, decode.block_table, decode.slots, decode.seq_lens, k, v)
        for row in attn_metadata.others:
            (start, n, cached), slot = attn_metadata.rows[row], attn_metadata.slots[row]
            q, k, v = query[start:start + n], key[start:start + n], value[start:start + n]
            table = attn_metadata.block_table[row]
            k_h, v_h = k.transpose(0, 1), v.transpose(0, 1)  # [H, n, D]
            if cached == 0:
                out = prefill_attention(q, k, v, self.scale)
            else:
                out = self.cache.attend(pages, table, slot, cached, q, k_h, v_h, self.scale)
            output[start:start + n] = out.to(output.dtype)
            self.cache.append(pages, table, slot, cached, k_h, v_h)
        return output


__all__ = ["PnMixAttentionBackend", "PnMixAttentionImpl", "PnMixMetadataBuilder", "PnMixMetadata"]
