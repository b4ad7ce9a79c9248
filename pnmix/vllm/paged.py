"""The pn-mix cache over an engine's fixed-size blocks (docs/VLLM.md): one block = one quantized group.

An engine such as vLLM owns the KV memory as pages of ``block_size`` tokens and hands each sequence
a block table. Here ``block_size`` equals the config's ``group_size``, and the page of a block holds,
for every KV head, the packed bytes of exactly one group in the pn-mix format (docs/FORMAT.md
section 3: the ``key_codes``, ``key_step``, ``key_offset``, ``value_codes``, ``value_step`` and
``value_offset`` of one (sequence, head, group), one after another, then zero padding). Group ``g``
of a sequence lives in the block that holds its last token, ``(S + (g + 1) * gs - 1) // block_size``,
which the engine has always allocated by the time the group is flushed.

What a page cannot hold lives in a *sequence slot* beside the pages: the fp16 sink, the fp16
residual (the newest tokens, fewer than ``residual_size``) and the pair mask. Slots are few (one per
sequence the engine runs at once); ``SlotTable`` gives a running sequence its slot, keyed by the
first block of its block table, which no other running sequence holds while prefix caching is off.

This module knows nothing of vLLM: it takes K/V, queries, block tables and lengths as tensors, so
the byte format and the schedule are tested without an engine (tests/vllm/test_paged.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import reference
from ..backends.core_ops import CoreOps
from ..cache import CacheOps
from ..config import PnMixConfig
from ..errors import PnMixError
from ..format import STATE_DTYPES, CacheLayout
from ..packing import pack_pair_mask

# The per-group tensors of docs/FORMAT.md section 3, in the order a page holds them.
GROUP_TENSORS = ("key_codes", "key_step", "key_offset", "value_codes", "value_step", "value_offset")


@dataclass(frozen=True)
class PageLayout:
    """Where a group's bytes sit in a page, and what a block and a slot cost."""

    config: PnMixConfig
    kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        self.config.check_head_dim(self.head_dim)
        if self.block_size != self.config.group_size:
            raise PnMixError(
                f"the pn-mix cache needs the engine's block size to equal group_size "
                f"({self.config.group_size}): a full block is one quantized group; got block size {self.block_size}"
            )

    @property
    def layout(self) -> CacheLayout:
        """A batch-1 layout of one group: the format's byte counts for these dims."""
        return CacheLayout(self.config, 1, self.kv_heads, self.head_dim,
                           self.config.sink_tokens + self.config.residual_size)

    def section_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shape of each group tensor for one (sequence, head, group): the format's state shapes
        (CacheLayout.state_shapes, [B, H, G, ...]) past their first three dimensions."""
        shapes = self.layout.state_shapes()
        return {name: shapes[name][3:] for name in GROUP_TENSORS}

    def section_offsets(self) -> Dict[str, Tuple[int, int]]:
        """(first byte, byte count) of each group tensor inside one head's part of a page: the C core's
        layout of a page (pnmix_group_sections, what pnmix_attend_paged reads; test_paged checks they agree)."""
        out, at = {}, 0
        for name, shape in self.section_shapes().items():
            size = math.prod(shape) * STATE_DTYPES[name].itemsize
            out[name] = (at, size)
            at += size
        return out

    @property
    def group_bytes(self) -> int:
        """Packed bytes of one group and KV head (docs/FORMAT.md section 5: KB + 4D + gs*(VB + 4*NVB))."""
        return sum(size for _, size in self.section_offsets().values())

    @property
    def token_bytes(self) -> int:
        """Bytes per (KV head, token) of a page: what the engine's spec calls state_content_bytes.
        A head's part of a page is block_size * token_bytes >= group_bytes (the rest is padding)."""
        return -(-self.group_bytes // self.block_size)

    @property
    def head_page_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def page_bytes(self) -> int:
        """One block of one layer, all KV heads."""
        return self.kv_heads * self.head_page_bytes

    @property
    def slot_bytes(self) -> int:
        """One sequence slot of one layer: the fp16 sink and residual (K and V) and the pair mask."""
        cfg = self.config
        return 2 * 2 * self.kv_heads * self.head_dim * (cfg.sink_tokens + cfg.residual_size) + self.layout.mask_bytes

    def block_of_group(self, group: int) -> int:
        """The block (index into a sequence's block table) whose page holds group ``group``."""
        return (self.config.sink_tokens + (group + 1) * self.config.group_size - 1) // self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def bytes_for(self, tokens: int, layers: int) -> int:
        """Pages plus one slot of a sequence of ``tokens`` tokens over ``layers`` layers."""
        return layers * (self.blocks_for(tokens) * self.page_bytes + self.slot_bytes)

    # ---- a page's bytes <-> the format's group tensors -----------------------------------
    def write_groups(self, kv_pages: torch.Tensor, blocks: torch.Tensor, tensors: Dict[str, torch.Tensor]) -> None:
        """Write groups' tensors [count, H, ...] into the pages of ``blocks`` (int64 [count]) of
        kv_pages (uint8 [num_blocks, H, head_page_bytes]); the padding is left as it is."""
        count = blocks.shape[0]
        for name, (at, size) in self.section_offsets().items():
            kv_pages[blocks, :, at:at + size] = tensors[name].contiguous().view(torch.uint8).reshape(
                count, self.kv_heads, size)

    def read_groups(self, pages: torch.Tensor) -> Dict[str, torch.Tensor]:
        """pages uint8 [G, H, head_page_bytes] (a sequence's group pages, oldest first) -> the state's
        group tensors [1, H, G, ...] (a copy, contiguous: what the core's attention takes)."""
        groups = pages.shape[0]
        out = {}
        for name, (at, size) in self.section_offsets().items():
            raw = pages[:, :, at:at + size].transpose(0, 1).contiguous()  # [H, G, size]
            shape = (1, self.kv_heads, groups, *self.section_shapes()[name])
            out[name] = raw.view(STATE_DTYPES[name]).reshape(shape)
        return out


class SlotTable:
    """Which sequence slot each running sequence holds, keyed by the first block of its block table.

    A sequence that starts (no token cached yet) takes the slot its first block already names (that
    block was freed, so its earlier owner is gone), else a free slot, else the least recently used
    one. Preemption in vLLM frees a sequence's blocks and recomputes it from its first token, so a
    preempted sequence simply starts again."""

    def __init__(self, slots: int):
        if slots < 1:
            raise PnMixError(f"the slot table needs at least one slot, got {slots}")
        self.slots = slots
        self.by_block: "OrderedDict[int, int]" = OrderedDict()

    def assign(self, first_block: int, starting: bool) -> int:
        slot = self.by_block.get(first_block)
        if slot is not None:
            self.by_block.move_to_end(first_block)
            return slot
        if not starting:
            raise PnMixError(f"a running sequence (first block {first_block}) has no slot: it was evicted; "
                             f"raise the slot count (max_num_seqs)")
        if len(self.by_block) < self.slots:
            slot = len(self.by_block)
        else:
            _, slot = self.by_block.popitem(last=False)
        self.by_block[first_block] = slot
        return slot


class PagedLayerCache:
    """One attention layer's pn-mix state over an engine's pages: the slots are owned here, the pages
    are the engine's (passed to every call as uint8 [num_blocks, H, head_page_bytes])."""

    def __init__(self, pages: PageLayout, slots: int, ops: Optional[CacheOps] = None, device="cpu"):
        self.pages = pages
        cfg, h, d = pages.config, pages.kv_heads, pages.head_dim
        self.ops = ops
        # the core's flush appends to a scratch state of one sink token (_quantize_core)
        self._scratch_config = cfg.replace(sink_tokens=1)
        self.sink_k = torch.zeros(slots, h, cfg.sink_tokens, d, dtype=torch.float16, device=device)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.residual_k = torch.zeros(slots, h, cfg.residual_size, d, dtype=torch.float16, device=device)
        self.residual_v = torch.zeros_like(self.residual_k)
        self.pair_mask = torch.zeros(slots, pages.layout.mask_bytes, dtype=torch.uint8, device=device)
        self._schedule = pages.layout  # its lengths(n): the flush schedule (config only)

    # ---- append: sink, residual, and full groups flushed into their pages ----------------------
    def append(self, kv_pages: torch.Tensor, block_table: torch.Tensor, slot: int, seq_len: int,
               k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k/v [H, n, D] (any float dtype; stored as fp16) to the sequence in ``slot`` that
        holds ``seq_len`` tokens; block_table: the sequence's block ids (int tensor [blocks])."""
        pages, cfg = self.pages, self.pages.config
        k16, v16 = k.to(torch.float16).unsqueeze(0), v.to(torch.float16).unsqueeze(0)  # [1, H, n, D]
        n = k16.shape[2]
        if n == 0:
            return
        lay = CacheLayout(cfg, 1, pages.kv_heads, pages.head_dim, seq_len + n)
        if seq_len == 0:  # the prefill's keys choose the pair mask, once
            self.pair_mask[slot] = pack_pair_mask(reference.saliency_mask(k16, lay))[0]
        before, after = lay.lengths(seq_len), lay.lengths(seq_len + n)
        into_sink = after.sink - before.sink
        if into_sink:
            self.sink_k[slot, :, before.sink:after.sink] = k16[0, :, :into_sink]
            self.sink_v[slot, :, before.sink:after.sink] = v16[0, :, :into_sink]
        stream_k = torch.cat([self.residual_k[slot, :, :before.residual], k16[0, :, into_sink:]], dim=1)
        stream_v = torch.cat([self.residual_v[slot, :, :before.residual], v16[0, :, into_sink:]], dim=1)
        flushed = after.groups - before.groups
        if flushed:
            self._flush(kv_pages, block_table, slot, before.groups, stream_k, stream_v, flushed, lay)
        rest = flushed * cfg.group_size
        self.residual_k[slot, :, :after.residual] = stream_k[:, rest:]
        self.residual_v[slot, :, :after.residual] = stream_v[:, rest:]

    def append_decode(self, kv_pages: torch.Tensor, block_tables: torch.Tensor, slots: Sequence[int],
                      seq_lens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token to each of N sequences (a decode step): k/v [N, H, D]; sequence i in slot
        slots[i] holds seq_lens[i] tokens, its block ids in block_tables[i]. A token that only
        lengthens its residual (most steps) is written with the others in one indexed copy; one that
        goes to the sink or completes a group takes append's path."""
        k16, v16 = k.to(torch.float16), v.to(torch.float16)
        plain, positions = [], []
        for i, seq_len in enumerate(seq_lens):
            before, after = self._schedule.lengths(seq_len), self._schedule.lengths(seq_len + 1)
            if after.sink == before.sink and after.groups == before.groups:
                plain.append(i)
                positions.append(before.residual)
            else:
                self.append(kv_pages, block_tables[i], slots[i], seq_len, k16[i, :, None], v16[i, :, None])
        if plain:
            rows = torch.tensor(plain, dtype=torch.long)
            at_slot = torch.tensor([slots[i] for i in plain], dtype=torch.long)
            at = torch.tensor(positions, dtype=torch.long)
            self.residual_k[at_slot, :, at] = k16.index_select(0, rows)
            self.residual_v[at_slot, :, at] = v16.index_select(0, rows)

    def _flush(self, kv_pages, block_table, slot, first, stream_k, stream_v, count, lay) -> None:
        """Quantize ``count`` groups (the stream's first tokens) into their pages: the bytes are the
        format's (docs/FORMAT.md section 4). With the C core as ops its append quantizes them (the
        same bytes as the reference's quantizers, which quantize them otherwise)."""
        if isinstance(self.ops, CoreOps):
            parts = self._quantize_core(slot, stream_k, stream_v, count)
        else:
            parts = self._quantize_reference(slot, stream_k, stream_v, count, lay)
        self._write_pages(kv_pages, block_table, first, parts)

    def _quantize_reference(self, slot, stream_k, stream_v, count, lay) -> Dict[str, torch.Tensor]:
        """The groups' six tensors [count, H, ...] from the reference's quantizers."""
        h, d, gs = self.pages.kv_heads, self.pages.head_dim, self.pages.config.group_size
        state = {"pair_mask": self.pair_mask[slot:slot + 1]}
        bits = reference.state_channel_bits(lay, state)[0]  # [H, D]
        keys = stream_k[:, :count * gs].reshape(h, count, gs, d).transpose(0, 1).reshape(-1, gs, d)
        rows_bits = bits.unsqueeze(0).expand(count, h, d).reshape(-1, d)
        key_codes, key_step, key_offset = reference.quantize_key_groups(keys, rows_bits, lay)
        values = stream_v[:, :count * gs].reshape(h, count, gs, d).transpose(0, 1)  # [count, H, gs, D]
        value_codes, value_step, value_offset = reference.quantize_values(values, lay)
        return {"key_codes": key_codes.reshape(count, h, -1), "key_step": key_step.reshape(count, h, d),
                "key_offset": key_offset.reshape(count, h, d), "value_codes": value_codes,
                "value_step": value_step, "value_offset": value_offset}

    def _quantize_core(self, slot, stream_k, stream_v, count) -> Dict[str, torch.Tensor]:
        """The groups' six tensors [count, H, ...] from the core's append (pnmix_append): the stream
        appended to a scratch batch-1 state of one sink token (already full, so nothing of the stream
        goes there, and seq_len > 0 so the slot's pair mask is used, not chosen again) whose capacity
        is just the stream. The stream's groups are flushed exactly as in the sequence (a flush
        depends on the residual's length only) into the scratch's groups 0..count-1."""
        assert isinstance(self.ops, CoreOps)
        h, d = self.pages.kv_heads, self.pages.head_dim
        length = stream_k.shape[1]
        lay = CacheLayout(self._scratch_config, 1, h, d, 1 + length)
        if lay.lengths(1 + length).groups != count:
            raise PnMixError(f"internal: a stream of {length} tokens flushes "
                             f"{lay.lengths(1 + length).groups} groups, not {count}")
        state = lay.empty_state()
        state["pair_mask"].copy_(self.pair_mask[slot:slot + 1])
        self.ops.append(lay, state, 1, stream_k.unsqueeze(0), stream_v.unsqueeze(0))
        return {name: state[name][0, :, :count].transpose(0, 1) for name in GROUP_TENSORS}

    def _write_pages(self, kv_pages, block_table, first, parts: Dict[str, torch.Tensor]) -> None:
        """Write groups first.. (tensors [count, H, ...]) into their pages: consecutive groups are in
        consecutive entries of the block table (block_size == group_size)."""
        start = self.pages.block_of_group(first)
        blocks = block_table[start:start + parts["key_step"].shape[0]].to(device=kv_pages.device, dtype=torch.long)
        self.pages.write_groups(kv_pages, blocks, parts)

    # ---- attention -----------------------------------------------------------------------------
    def layout_at(self, seq_len: int) -> CacheLayout:
        """The batch-1 layout of a sequence of ``seq_len`` tokens (the attention's)."""
        pages = self.pages
        return CacheLayout(pages.config, 1, pages.kv_heads, pages.head_dim, max(seq_len, 1))

    def slot_tensors(self) -> Dict[str, torch.Tensor]:
        """Every slot's sink, residual and pair mask: [slots, ...] each."""
        return dict(sink_k=self.sink_k, sink_v=self.sink_v, residual_k=self.residual_k, residual_v=self.residual_v,
                    pair_mask=self.pair_mask)

    def slot_state(self, slot: int) -> Dict[str, torch.Tensor]:
        """The slot's sink, residual and pair mask as batch-1 state tensors (views, no copy)."""
        return {name: t[slot:slot + 1] for name, t in self.slot_tensors().items()}

    def kernel_queries(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Queries as the kernels take them: scaled by the model's scale over the kernels' 1/sqrt(D),
        in fp16 (as PnMixCache's packed path hands them)."""
        ratio = scale * math.sqrt(self.pages.head_dim)
        if not math.isclose(ratio, 1.0, rel_tol=1e-6):
            q = q * ratio
        return q.to(torch.float16)

    def state(self, kv_pages: torch.Tensor, block_table: torch.Tensor, slot: int, seq_len: int):
        """The batch-1 pn-mix state of a sequence (its slot's sink, residual and mask; its group pages
        gathered: a copy), with the layout it has at ``seq_len`` tokens. The reference path's input;
        the core reads the pages in place instead (attend)."""
        pages = self.pages
        lay = self.layout_at(seq_len)
        groups = lay.lengths(seq_len).groups
        blocks = [int(block_table[pages.block_of_group(g)]) for g in range(groups)]
        index = torch.tensor(blocks, dtype=torch.long, device=kv_pages.device)
        state = pages.read_groups(kv_pages.index_select(0, index))
        state.update(self.slot_state(slot))
        return lay, state

    def attend(self, kv_pages, block_table, slot: int, seq_len: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of q [nq, Hq, D] (the last nq positions) over the sequence's cache as stored, then
        the new k/v [H, n, D] in fp16 (the op semantics, docs/METHOD.md section 2.4) -> fp32 [nq, Hq, D].
        ``scale`` is the model's; the kernels use 1/sqrt(D), so q is scaled by their ratio. Queries go
        to the kernels in fp16, as PnMixCache's packed path (pnmix/hf/attention.py) hands them.
        With the C core as ops the kernel reads the group pages in place through the block table
        (CoreOps.attend_paged: nothing of the cache is copied); other ops get the gathered state."""
        q4 = self.kernel_queries(q, scale).transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, nq, D]
        k16, v16 = k.to(torch.float16).unsqueeze(0), v.to(torch.float16).unsqueeze(0)
        attend_paged = getattr(self.ops, "attend_paged", None)
        if attend_paged is not None:  # the core: the pages read in place through the block table
            out = attend_paged(q4, self.layout_at(seq_len), kv_pages, block_table, self.pages.block_size,
                               self.slot_state(slot), seq_len, k16, v16)
        else:
            lay, state = self.state(kv_pages, block_table, slot, seq_len)
            if self.ops is None:
                out = reference.attend(q4, lay, state, seq_len, k16, v16)
            else:
                out = self.ops.attend(q4, lay, state, seq_len, k16, v16)
        return out[0].transpose(0, 1)

    def attend_decode(self, kv_pages: torch.Tensor, block_tables: torch.Tensor, slots: Sequence[int],
                      seq_lens: Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """A decode step of N sequences: q [N, Hq, D] (one query each) over sequence i's cache as
        stored (slot slots[i], seq_lens[i] tokens, blocks block_tables[i]) then its new k/v [N, H, D]
        -> fp32 [N, Hq, D]. With the C core as ops, one call for the whole step
        (CoreOps.attend_paged_batch: the work of every sequence shared by the threads, the pages
        read in place); other ops take each sequence on its own (attend)."""
        batch = getattr(self.ops, "attend_paged_batch", None)
        if batch is None:
            return torch.stack([self.attend(kv_pages, block_tables[i], slot, seq_len, q[i:i + 1], k[i, :, None],
                                             v[i, :, None], scale)[0]
                                for i, (slot, seq_len) in enumerate(zip(slots, seq_lens))])
        return batch(self.kernel_queries(q, scale), self.layout_at(max(seq_lens) + 1), kv_pages, block_tables,
                     self.pages.block_size, self.slot_tensors(), slots, seq_lens, k, v)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A sequence's first chunk: causal attention over its own K/V in the model's precision, as
    PnMixCache's prefill does. q [n, Hq, D], k/v [n, H, D] -> [n, Hq, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def sequence_rows(query_start: List[int], seq_lens: List[int]) -> List[Tuple[int, int, int]]:
    """(first query token, query tokens, tokens cached before this step) of each sequence."""
    rows = []
    for i, seq_len in enumerate(seq_lens):
        n = query_start[i + 1] - query_start[i]
        rows.append((query_start[i], n, seq_len - n))
    return rows
