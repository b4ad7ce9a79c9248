"""The paged pn-mix cache (pnmix/vllm/paged.py, docs/VLLM.md) against the packed cache: a flushed
block's page holds the format's bytes of its group, byte for byte, and attention over the pages
equals attention over the PackedKVCache that took the same tokens. No vLLM needed."""

import math

import pytest
import torch

from pnmix._native import library_status
from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import CacheLayout
from pnmix.vllm.paged import GROUP_TENSORS, PagedLayerCache, PageLayout, SlotTable, sequence_rows

SMALL = PnMixConfig(pair_layout="half", group_size=16, residual_size=24, sink_tokens=5, value_group_size=8,
                    key_high_bits=4, key_low_bits=2, value_bits=2, high_ratio=0.25)
HF_DEFAULT = PnMixConfig(pair_layout="half")  # PnMixCache's default: the manifest's values, rotate_half pairs
INT8_TOLERANCE = 0.05  # the integer path's error on these caches (tests/backends/test_core.py)


def make_ops(name):
    """The packed cache's ops: the C core's append is an implementation independent of the
    reference quantizers the paged cache calls; the reference is the definition."""
    if name == "torch":
        from pnmix.cache import ReferenceOps

        return ReferenceOps()
    available, reason = library_status("pnmix_core")
    if not available:
        pytest.skip(f"libpnmix_core not available: {reason}")
    from pnmix.backends.core_ops import CoreOps

    # The paged calls and the contiguous ones they are compared with bit for bit run where CoreOps
    # runs its work (torch's threads where torch has them), split alike.
    return CoreOps()


def shuffled_blocks(count: int, num_blocks: int, seed: int) -> torch.Tensor:
    """A block table of `count` distinct blocks out of `num_blocks`, in no particular order."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:count]


def chunks_of(total: int, first: int, step: int):
    sizes, left = [min(first, total)], total - min(first, total)
    while left:
        sizes.append(min(step, left))
        left -= sizes[-1]
    return sizes


@pytest.mark.parametrize("ops_name", ["torch", "core"])
@pytest.mark.parametrize("config, heads, dim, chunks", [
    (SMALL, 2, 16, (37, 1, 1, 9, 30, 1, 50)),
    (HF_DEFAULT, 3, 64, (200, 1, 90, 1, 1, 120)),
])
def test_flushed_pages_hold_the_format_bytes_of_their_group(config, heads, dim, chunks, ops_name):
    ops = make_ops(ops_name)
    pages = PageLayout(config, heads, dim, config.group_size)
    total = sum(chunks)
    table = shuffled_blocks(pages.blocks_for(total), 64, seed=1)
    kv_pages = torch.zeros(64, heads, pages.head_page_bytes, dtype=torch.uint8)
    paged = PagedLayerCache(pages, slots=3)
    packed = PackedKVCache(config, heads, dim, total, ops=ops)
    gen = torch.Generator().manual_seed(7)
    k_all = (torch.randn(heads, total, dim, generator=gen) * 2).half()
    v_all = torch.randn(heads, total, dim, generator=gen).half()
    done = 0
    for n in chunks:
        paged.append(kv_pages, table, 2, done, k_all[:, done:done + n], v_all[:, done:done + n])
        packed.append(k_all[None, :, done:done + n], v_all[None, :, done:done + n])
        done += n
        lengths = packed.lengths()
        for g in range(lengths.groups):
            page = kv_pages[int(table[pages.block_of_group(g)])]
            for h in range(heads):
                want = b"".join(packed.state[name][0, h, g].contiguous().view(torch.uint8).numpy().tobytes()
                                for name in GROUP_TENSORS)
                got = page[h].numpy().tobytes()
                assert got[:len(want)] == want, f"group {g} head {h} after {done} tokens"
                assert set(got[len(want):]) <= {0}  # the padding is zeros
        assert torch.equal(paged.sink_k[2, :, :lengths.sink], packed.state["sink_k"][0, :, :lengths.sink])
        assert torch.equal(paged.residual_v[2, :, :lengths.residual],
                           packed.state["residual_v"][0, :, :lengths.residual])
        assert torch.equal(paged.pair_mask[2], packed.state["pair_mask"][0])
    assert packed.lengths().groups >= 2  # the cases flush more than one group


# one group per append, several at once (a prefill, a long chunk), a group completed by one token
@pytest.mark.parametrize("config, heads, dim, chunks, flushed", [
    (SMALL, 2, 16, (37, 1, 1, 9, 30, 1, 50, 16, 17), {1, 2, 3}),
    (SMALL.replace(sink_tokens=0), 2, 16, (16, 24, 1, 7, 40, 1, 33), {2, 3}),  # no sink: the mask stays the slot's
    (HF_DEFAULT, 3, 64, (200, 1, 90, 1, 1, 120), {1}),
    (HF_DEFAULT, 3, 64, (1024,), {7}),
    (HF_DEFAULT, 3, 64, (4096, 127, 1, 128), {1, 31}),
    (HF_DEFAULT, 3, 64, (31, 1, 256, 130, 400), {1, 2, 3}),
])
def test_the_cores_flush_writes_the_references_pages(config, heads, dim, chunks, flushed):
    """PagedLayerCache with the core as ops flushes its groups through the core's append; the pages,
    sink, residual and mask equal those of the reference's flush (ops None) byte for byte."""
    core = make_ops("core")
    pages = PageLayout(config, heads, dim, config.group_size)
    total = sum(chunks)
    num_blocks = pages.blocks_for(total) + 3
    table = shuffled_blocks(pages.blocks_for(total), num_blocks, seed=total)
    caches = {"reference": PagedLayerCache(pages, slots=2), "core": PagedLayerCache(pages, slots=2, ops=core)}
    kv = {name: torch.zeros(num_blocks, heads, pages.head_page_bytes, dtype=torch.uint8) for name in caches}
    gen = torch.Generator().manual_seed(total)
    k_all = (torch.randn(heads, total, dim, generator=gen) * 2).half()
    v_all = torch.randn(heads, total, dim, generator=gen).float()  # any float dtype; stored as fp16
    done, flushes = 0, set()
    for n in chunks:
        before = pages.layout.lengths(done).groups if done else 0
        for name, cache in caches.items():
            cache.append(kv[name], table, 1, done, k_all[:, done:done + n], v_all[:, done:done + n])
        done += n
        flushes.add(CacheLayout(config, 1, heads, dim, done).lengths(done).groups - before)
        assert torch.equal(kv["core"], kv["reference"]), f"pages after {done} tokens"
        for t in ("sink_k", "sink_v", "residual_k", "residual_v", "pair_mask"):
            assert torch.equal(getattr(caches["core"], t), getattr(caches["reference"], t)), (t, done)
    assert kv["core"].any()
    assert flushes - {0} == flushed  # the groups one append flushed: one, or several at once


@pytest.mark.parametrize("ops_name", ["torch", "core"])
@pytest.mark.parametrize("nq", [1, 7])
def test_attention_over_pages_equals_the_packed_cache(nq, ops_name):
    ops = make_ops(ops_name)
    config, heads, dim, q_heads = HF_DEFAULT, 3, 64, 9
    pages = PageLayout(config, heads, dim, config.group_size)
    total = 700
    table = shuffled_blocks(pages.blocks_for(total + nq), 40, seed=3)
    kv_pages = torch.zeros(40, heads, pages.head_page_bytes, dtype=torch.uint8)
    paged = PagedLayerCache(pages, slots=1, ops=ops)
    packed = PackedKVCache(config, heads, dim, total + nq, ops=ops)
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(heads, total + nq, dim, generator=gen).half()
    v = torch.randn(heads, total + nq, dim, generator=gen).half()
    paged.append(kv_pages, table, 0, 0, k[:, :total], v[:, :total])
    packed.append(k[None, :, :total], v[None, :, :total])
    q = torch.randn(nq, q_heads, dim, generator=gen).half()  # the kernels take fp16 queries
    scale = 1.0 / math.sqrt(dim)
    got = paged.attend(kv_pages, table, 0, total, q, k[:, total:], v[:, total:], scale)
    want = packed.attend(q.transpose(0, 1)[None], k[None, :, total:], v[None, :, total:])[0].transpose(0, 1)
    assert torch.equal(got, want)
    # A model scale other than 1/sqrt(D) is folded into the queries.
    got2 = paged.attend(kv_pages, table, 0, total, q, k[:, total:], v[:, total:], 2 * scale)
    want2 = packed.attend((2 * q).transpose(0, 1)[None], k[None, :, total:], v[None, :, total:])[0].transpose(0, 1)
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)


# ---- the core's paged entry point (pnmix_attend_paged): the pages read in place ----------------------

@pytest.mark.parametrize("config, heads, dim", [(SMALL, 2, 16), (HF_DEFAULT, 3, 64), (HF_DEFAULT, 8, 128),
                                                (HF_DEFAULT.replace(value_group_size=32), 2, 64)])
def test_page_sections_are_the_cores(config, heads, dim):
    """PageLayout's offsets (from the format's state shapes) are the C core's (pnmix_group_sections,
    what pnmix_attend_paged reads), not a second statement of them."""
    make_ops("core")
    from pnmix.backends.core_ops import group_sections

    pages = PageLayout(config, heads, dim, config.group_size)
    assert group_sections(pages.layout) == pages.section_offsets()


def filled_pages(total: int, n_new: int, num_blocks: int = 48, seed: int = 5):
    """A SmolLM2-shaped paged cache (3 KV heads, head dim 64, PnMixCache's default config) holding
    `total` tokens in slot 1 over a shuffled block table, and n_new more tokens [H, n_new, D]."""
    pages = PageLayout(HF_DEFAULT, 3, 64, HF_DEFAULT.group_size)
    table = shuffled_blocks(pages.blocks_for(total + n_new), num_blocks, seed=seed)
    kv_pages = torch.randint(0, 256, (num_blocks, 3, pages.head_page_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(seed))  # stale bytes in unused pages
    paged = PagedLayerCache(pages, slots=2)
    gen = torch.Generator().manual_seed(seed + total)
    k = (torch.randn(3, total + n_new, 64, generator=gen) * 2).half()
    v = torch.randn(3, total + n_new, 64, generator=gen).half()
    paged.append(kv_pages, table, 1, 0, k[:, :total], v[:, :total])
    return paged, kv_pages, table, k[:, total:], v[:, total:]


@pytest.fixture(params=["fp32", "fp32:avx2", "fp32:scalar", "int8:avx2", "int8:avx512vnni"])
def core_arith(request):
    """The core with each arithmetic and integer kernel (skipped where the CPU lacks it); fp32 on the
    AVX2 kernel decodes keys with the 4-byte loads that read past a chunk (attend_group's `masked`)."""
    ops = make_ops("core")
    arith, _, isa = request.param.partition(":")
    try:
        ops.set_isa(isa or "auto")
    except PnMixError:
        pytest.skip(f"this CPU has no {isa} kernel")
    ops.set_arith(arith)
    assert ops.arith() == arith and (not isa or ops.isa() == isa)
    yield ops
    ops.set_arith("auto")
    ops.set_isa("auto")


# inside the sink, the sink full and no group, the first group, many groups (each with a residual)
@pytest.mark.parametrize("total", [3, 100, 165, 1000, 4096])
@pytest.mark.parametrize("nq", [1, 5])
def test_paged_attention_equals_the_core_over_the_gathered_state(core_arith, total, nq):
    ops = core_arith
    paged, kv_pages, table, k_new, v_new = filled_pages(total, nq)
    q = torch.randn(1, 9, nq, 64, generator=torch.Generator().manual_seed(total)).half()
    lay, state = paged.state(kv_pages, table, 1, total)  # the gather: the contiguous state
    k16, v16 = k_new[None], v_new[None]
    want = ops.attend(q, lay, state, total, k16, v16)
    for block_ids in (table, table.to(torch.int32)):
        got = ops.attend_paged(q, lay, kv_pages, block_ids, 128, paged.slot_state(1), total, k16, v16)
        assert torch.equal(got, want), block_ids.dtype
    # PagedLayerCache.attend (the engine's call) reads the pages in place when its ops are the core
    paged.ops = ops
    got = paged.attend(kv_pages, table, 1, total, q[0].transpose(0, 1), k_new, v_new, 1.0 / math.sqrt(64))
    assert torch.equal(got, want[0].transpose(0, 1))


def filled_batch(totals, num_blocks: int = 160, seed: int = 9):
    """Several SmolLM2-shaped sequences in one layer's pages: sequence i holds totals[i] tokens in
    slot i + 1 (slot 0 left empty), its blocks drawn from one shuffled pool; the block tables as
    one [N, max_blocks] tensor (rows padded with block 0, which no group reads); one more token each."""
    pages = PageLayout(HF_DEFAULT, 3, 64, HF_DEFAULT.group_size)
    pool = shuffled_blocks(num_blocks, num_blocks, seed)
    kv_pages = torch.randint(0, 256, (num_blocks, 3, pages.head_page_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(seed))
    paged = PagedLayerCache(pages, slots=len(totals) + 1)
    width = max(pages.blocks_for(total + 1) for total in totals)
    tables = torch.zeros(len(totals), width, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed + 1)
    k_new, v_new, at = [], [], 0
    for i, total in enumerate(totals):
        need = pages.blocks_for(total + 1)
        tables[i, :need] = pool[at:at + need]
        at += need
        k = (torch.randn(3, total + 1, 64, generator=gen) * 2).half()
        v = torch.randn(3, total + 1, 64, generator=gen).half()
        paged.append(kv_pages, tables[i], i + 1, 0, k[:, :total], v[:, :total])
        k_new.append(k[:, total])
        v_new.append(v[:, total])
    return paged, kv_pages, tables, torch.stack(k_new), torch.stack(v_new)


SLOT_NAMES = ("sink_k", "sink_v", "residual_k", "residual_v", "pair_mask")


def batch_attend(ops, paged, kv_pages, tables, totals, q, k_new, v_new, slot_ids=None):
    lay = paged.layout_at(max(totals) + 1)
    slots = {name: getattr(paged, name) for name in SLOT_NAMES}
    ids = list(range(1, len(totals) + 1)) if slot_ids is None else slot_ids
    return ops.attend_paged_batch(q, lay, kv_pages, tables, 128, slots, ids, totals, k_new, v_new)


# a sequence in its sink, one with no group yet, several with groups; a decode step of each
@pytest.mark.parametrize("totals", [[4096], [3, 100, 165, 1000, 4096, 700, 129]])
def test_a_batched_decode_step_equals_each_sequences_own_call(core_arith, totals):
    ops = core_arith
    paged, kv_pages, tables, k_new, v_new = filled_batch(totals)
    q = torch.randn(len(totals), 9, 64, generator=torch.Generator().manual_seed(3)).half()
    got = batch_attend(ops, paged, kv_pages, tables, totals, q, k_new, v_new)
    assert got.shape == (len(totals), 9, 64) and got.dtype == torch.float32
    for i, total in enumerate(totals):
        want = ops.attend_paged(q[i, :, None][None], paged.layout_at(total + 1), kv_pages, tables[i], 128,
                                paged.slot_state(i + 1), total, k_new[i, :, None][None], v_new[i, :, None][None])
        if len(totals) == 1:  # one sequence: the same split as its own call, so the same bits
            assert torch.equal(got[i], want[0, :, 0]), total
        elif ops.arith() == "fp32":  # the batch splits each sequence's groups by its share: fp32 sums in another order
            torch.testing.assert_close(got[i], want[0, :, 0], rtol=1e-5, atol=1e-5)
        else:  # the integer path quantizes its weights per split: its own error, per split
            assert (got[i] - want[0, :, 0]).abs().max().item() <= INT8_TOLERANCE, total
    # the int32 tables an engine hands (vLLM's block_table tensor) read the same blocks
    assert torch.equal(batch_attend(ops, paged, kv_pages, tables.to(torch.int32), totals, q, k_new, v_new), got)


def test_a_batched_decode_step_runs_on_a_callers_threads_split_as_on_torchs():
    """attend_paged_batch hands its work items to CoreOps' runner (torch's OpenMP team, or here one
    that runs them in reverse order): each item once, split for the runner's awake threads, and the
    same bits as torch's team, which splits alike."""
    from pnmix.backends import native
    from pnmix.backends.core_ops import CoreOps
    from pnmix.testing import reverse_order_runner

    make_ops("core")  # (skips without the library)
    totals = [3, 100, 165, 1000, 8500, 700, 129]  # 8,500 tokens: 66 groups, two splits of 32 or more
    paged, kv_pages, tables, k_new, v_new = filled_batch(totals)
    q = torch.randn(len(totals), 9, 64, generator=torch.Generator().manual_seed(3)).half()
    ran: list = []
    runner = reverse_order_runner(ran)
    ops = CoreOps(threads=2, torch_threads=False)
    ops.runner, ops.team_address = native.address(runner), None  # the split is for ops.threads
    got = batch_attend(ops, paged, kv_pages, tables, totals, q, k_new, v_new)
    # 3 KV heads a sequence: more items than that only where the groups were split for 2 awake threads
    assert len(ran) > 3 * len(totals) and sorted(ran) == list(range(len(ran)))
    pool = batch_attend(CoreOps(threads=2, torch_threads=False), paged, kv_pages, tables, totals, q, k_new, v_new)
    torch.testing.assert_close(got, pool, rtol=1e-5, atol=1e-5)  # the pool (2 MiB a thread): no split here
    team = CoreOps(threads=2, torch_threads=True)
    if team.team is None:
        pytest.skip("torch has no OpenMP runtime here: no team to compare with")
    assert torch.equal(batch_attend(team, paged, kv_pages, tables, totals, q, k_new, v_new), got)


def test_a_batched_decode_step_refuses_bad_input_naming_the_sequence():
    ops = make_ops("core")
    totals = [700, 300, 1000]
    paged, kv_pages, tables, k_new, v_new = filled_batch(totals)
    q = torch.randn(3, 9, 64).half()
    bad = tables.clone()
    bad[2, paged.pages.block_of_group(2)] = kv_pages.shape[0]
    cases = [
        (dict(tables=bad), "sequence 2: block table entry 3 \\(group 2\\) is block 160, outside 0..159"),
        (dict(tables=tables[:, :2]), "sequence 0: the block table has 2 blocks, 700 tokens need 6"),
        (dict(tables=tables[:2]), "block_tables has 2 rows for 3 sequences"),
        (dict(slot_ids=[1, 2, 9]), "slot id 9 outside 0..3"),
        (dict(q=q[:, :4]), "queries must be \\[sequences=3, q_heads \\(a multiple of 3\\), head_dim=64\\]"),
    ]
    for kwargs, message in cases:
        args = {"tables": tables, "q": q, "slot_ids": None, **kwargs}
        with pytest.raises(PnMixError, match=message) as info:
            batch_attend(ops, paged, kv_pages, args["tables"], totals, args["q"], k_new, v_new, args["slot_ids"])
        assert "\n" not in str(info.value)


def test_paged_attention_bad_inputs_are_one_line_errors():
    ops = make_ops("core")
    paged, kv_pages, table, k_new, v_new = filled_pages(700, 1)
    lay = paged.layout_at(700)
    q = torch.randn(1, 9, 1, 64).half()
    slot = paged.slot_state(1)

    def attend(pages=kv_pages, block_ids=table, block_size=128, slot=slot, seq_len=700, layout=lay):
        return ops.attend_paged(q, layout, pages, block_ids, block_size, slot, seq_len, k_new[None], v_new[None])

    bad = table.clone()
    bad[paged.pages.block_of_group(2)] = kv_pages.shape[0]
    cases = [
        (dict(block_ids=bad), "block table entry 3 \\(group 2\\) is block 48, outside 0..47"),
        (dict(block_ids=table[:5]), "the block table has 5 blocks, 700 tokens need 6"),
        (dict(pages=kv_pages[:0]), "pages or block_table pointer is null"),
        (dict(block_size=64), "block_size 64 must equal group_size 128"),
        (dict(pages=torch.zeros(48, 3, 100, dtype=torch.uint8)), "head_bytes 100 must be even and at least a group's 4864"),
        (dict(slot={**slot, "sink_k": slot["sink_k"][:, :2], "sink_v": slot["sink_v"][:, :2]}),
         "'sink_k' has 8192 bytes, the layout needs 12288"),
    ]
    for kwargs, message in cases:
        with pytest.raises(PnMixError, match=message) as info:
            attend(**kwargs)
        assert "\n" not in str(info.value)
    # a null paged state through the C ABI: an error, and the output untouched
    import ctypes

    from pnmix.backends.core_ops import c_layout

    out = torch.full((1, 9, 1, 64), 7.0)
    c_lay = c_layout(lay)
    status = ops.lib.pnmix_attend_paged(ctypes.byref(c_lay), None, 700, q.data_ptr(), 0, 9, 1, q.numel() * 2,
                                        None, None, 0, 0, out.data_ptr(), out.numel() * 4, 0)
    assert status != 0 and ops.lib.pnmix_last_error() == b"paged state pointer is null"
    assert torch.equal(out, torch.full((1, 9, 1, 64), 7.0))


def test_a_block_and_a_slot_cost_what_the_format_says():
    pages = PageLayout(HF_DEFAULT, 3, 64, 128)
    lay = CacheLayout(HF_DEFAULT, 1, 3, 64, 4096)
    cfg = HF_DEFAULT
    one_group = (lay.persistent_bytes(cfg.sink_tokens + cfg.residual_size + cfg.group_size)["persistent_cache_bytes"]
                 - lay.persistent_bytes(cfg.sink_tokens + cfg.residual_size)["persistent_cache_bytes"])
    assert pages.kv_heads * pages.group_bytes == one_group
    assert pages.head_page_bytes >= pages.group_bytes > pages.head_page_bytes - pages.block_size
    assert pages.token_bytes == 38  # SmolLM2's dims: 18 key + 20 value bytes per token and head
    assert pages.slot_bytes == 2 * 2 * 3 * 64 * (32 + 128) + lay.mask_bytes


def test_group_g_lives_in_the_block_of_its_last_token():
    pages = PageLayout(SMALL, 2, 16, 16)  # sink 5, groups of 16
    assert [pages.block_of_group(g) for g in range(4)] == [1, 2, 3, 4]  # last tokens 20, 36, 52, 68
    no_sink = PageLayout(SMALL.replace(sink_tokens=0), 2, 16, 16)
    assert [no_sink.block_of_group(g) for g in range(3)] == [0, 1, 2]


def test_start_up_refusals_are_one_line_errors():
    with pytest.raises(PnMixError, match="block size to equal group_size"):
        PageLayout(HF_DEFAULT, 3, 64, 16)
    with pytest.raises(PnMixError, match="head_dim"):
        PageLayout(HF_DEFAULT.replace(value_bits=3), 3, 4, 128)


def test_slot_table_reuses_a_freed_first_block_and_evicts_the_least_recent():
    table = SlotTable(2)
    a, b = table.assign(10, starting=True), table.assign(20, starting=True)
    assert {a, b} == {0, 1}
    assert table.assign(10, starting=False) == a  # a running sequence keeps its slot
    assert table.assign(20, starting=True) == b  # block 20 freed and taken by a new sequence
    table.assign(10, starting=False)
    c = table.assign(30, starting=True)  # full: the least recently used (block 20's) goes
    assert c == b
    with pytest.raises(PnMixError, match="has no slot"):
        table.assign(20, starting=False)


def test_sequence_rows():
    assert sequence_rows([0, 5, 6, 9], [5, 41, 3]) == [(0, 5, 0), (5, 1, 40), (6, 3, 0)]
