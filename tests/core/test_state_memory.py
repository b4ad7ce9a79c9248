"""Where a cache's host state lives: a long-lived state (PackedKVCache's, the benchmarks') of a huge
page or more is one mapping asked for transparent huge pages (memory.zeros_on_huge_pages); smaller
ones, scratch states and other devices' are torch's own tensors."""

import gc
import mmap
from pathlib import Path

import pytest
import torch

from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.memory import HUGE_PAGES_SWITCH, LINE_BYTES, huge_page_bytes, zeros_on_huge_pages

# 4 KV heads of dim 64 over 32K tokens: a 5.1 MB state, two whole huge pages of 2 MiB and more
BIG = CacheLayout(PnMixConfig(), 1, 4, 64, 32768)
SMALL = CacheLayout(PnMixConfig(), 1, 2, 32, 512)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
on_linux = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="huge pages are asked with Linux's madvise")
two_huge_pages = pytest.mark.skipif(BIG.state_bytes < 2 * huge_page_bytes(),
                                    reason=f"this kernel's huge pages ({huge_page_bytes()} bytes) are too big")


@pytest.fixture(autouse=True)
def switch_unset(monkeypatch):
    """The tests' own setting of PNMIX_HUGE_PAGES, whatever the shell exports."""
    monkeypatch.delenv(HUGE_PAGES_SWITCH, raising=False)


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps fields of the mapping holding `address` ({} where none does)."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = low <= address < high
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def on_torchs_pages(state) -> bool:
    return all(t.untyped_storage().resizable() for t in state.values())


@on_linux
@two_huge_pages
def test_a_big_state_is_one_zeroed_mapping_of_separate_tensors():
    state = BIG.empty_state(huge_pages=True)
    shapes = BIG.state_shapes()
    for name in STATE_NAMES:
        t = state[name]
        assert tuple(t.shape) == shapes[name] and t.is_contiguous() and not t.untyped_storage().resizable()
        assert t.data_ptr() % LINE_BYTES == 0
        assert not t.any()
    # no two tensors share a byte: mark each with its own value, then every one still holds its own
    for i, name in enumerate(STATE_NAMES, start=1):
        state[name].fill_(i)
    for i, name in enumerate(STATE_NAMES, start=1):
        assert bool((state[name] == i).all()), name
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in state.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


@on_linux
@two_huge_pages
def test_a_tensor_keeps_the_mapping_alive():
    codes = BIG.empty_state(huge_pages=True)["key_codes"]  # the dict and the other tensors are gone
    gc.collect()
    assert mapping_of(codes.data_ptr()), "the mapping was unmapped under a live tensor"
    codes.fill_(7)
    assert int(codes.sum()) == 7 * codes.numel()


@on_linux
@two_huge_pages
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps to read the request from")
def test_the_mapping_is_asked_for_huge_pages():
    state = BIG.empty_state(huge_pages=True)
    fields = mapping_of(state["key_codes"].data_ptr())
    if "VmFlags" not in fields:
        pytest.skip("this kernel's smaps gives no VmFlags")
    assert "hg" in fields["VmFlags"].split()  # madvise(MADV_HUGEPAGE), whatever the kernel then does
    if THP_MODE.exists() and "[never]" not in THP_MODE.read_text() and "THPeligible" in fields:
        assert fields["THPeligible"] == "1", fields


def test_scratch_small_and_unwanted_states_are_torchs_own(monkeypatch):
    assert SMALL.state_bytes < huge_page_bytes()
    assert zeros_on_huge_pages({n: (s, torch.uint8) for n, s in SMALL.state_shapes().items()}) is None
    assert on_torchs_pages(SMALL.empty_state(huge_pages=True))
    assert on_torchs_pages(BIG.empty_state())  # a scratch state (huge_pages not asked)
    assert BIG.empty_state("meta", huge_pages=True)["key_codes"].is_meta
    monkeypatch.setenv(HUGE_PAGES_SWITCH, "0")
    state = BIG.empty_state(huge_pages=True)
    assert on_torchs_pages(state) and not any(t.any() for t in state.values())


def test_a_wrong_switch_is_a_one_line_error_on_every_path(monkeypatch):
    for bad in ("", "yes", "2", " 1"):
        monkeypatch.setenv(HUGE_PAGES_SWITCH, bad)
        cases = ((BIG, True, "cpu"), (SMALL, True, "cpu"), (BIG, False, "cpu"), (BIG, True, "meta"))
        for layout, huge, device in cases:
            with pytest.raises(PnMixError, match=f"^{HUGE_PAGES_SWITCH} must be 0 or 1, got"):
                layout.empty_state(device, huge_pages=huge)


@on_linux
@two_huge_pages
def test_no_mapping_or_no_huge_pages_still_gives_a_state(monkeypatch):
    # a kernel without huge pages refuses the request: the mapping is kept, as zeroed memory
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 12345)
    state = BIG.empty_state(huge_pages=True)
    assert not on_torchs_pages(state) and not any(t.any() for t in state.values())
    # no mapping to be had (e.g. the mapping count at its limit): torch's allocator serves

    def no_mapping(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_mapping)
    state = BIG.empty_state(huge_pages=True)
    assert on_torchs_pages(state) and not any(t.any() for t in state.values())


def cpu_ops():
    """The caches' CPU ops to run on either kind of page: the C core's where it is built (it reads
    the state through raw pointers), else the reference's."""
    try:
        from pnmix.backends.core_ops import CoreOps

        return CoreOps(1)
    except Exception:  # no libpnmix_core in this checkout
        from pnmix.cache import ReferenceOps

        return ReferenceOps()


@pytest.mark.parametrize("arith", ["fp32", "int8"])
def test_a_cache_on_huge_pages_gives_the_bytes_and_outputs_of_one_on_torchs_pages(arith, random_kv):
    ops = cpu_ops()
    if hasattr(ops, "set_arith"):
        ops.set_arith(arith)  # process-wide: given back after the test, for the tests that follow
        try:
            _compare_page_kinds(ops, random_kv)
        finally:
            ops.set_arith("auto")
    elif arith == "int8":
        pytest.skip("the integer path is the C core's")
    else:
        _compare_page_kinds(ops, random_kv)


def _compare_page_kinds(ops, random_kv) -> None:
    k, v = random_kv(1, 4, 2000, 64, seed=3)
    q = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(4)).half()
    cache = PackedKVCache(PnMixConfig(), 4, 64, 16384, ops=ops)  # a 2.6 MB state
    plain = PackedKVCache(PnMixConfig(), 4, 64, 16384, ops=ops)
    plain.state = {name: torch.zeros_like(t).clone() for name, t in cache.state.items()}
    if hasattr(mmap, "MADV_HUGEPAGE") and cache.layout.state_bytes >= huge_page_bytes():
        assert not on_torchs_pages(cache.state)
    assert on_torchs_pages(plain.state)
    for c in (cache, plain):
        c.append(k[:, :, :1800], v[:, :, :1800])
        c.append(k[:, :, 1800:], v[:, :, 1800:])
    assert all(torch.equal(cache.state[name], plain.state[name]) for name in STATE_NAMES)
    assert torch.equal(cache.attend(q), plain.attend(q))
