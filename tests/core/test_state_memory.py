"""Where a host state lives: a state of a huge page or more is one mapping asked for transparent
huge pages (memory.zeros_on_huge_pages), smaller ones are torch's own tensors."""

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig
from pnmix.format import STATE_NAMES, CacheLayout
from pnmix.errors import PnMixError
from pnmix.memory import HUGE_PAGE_BYTES, HUGE_PAGES_SWITCH, LINE_BYTES, zeros_on_huge_pages

# 4 KV heads of dim 64 over 32K tokens: a 5.3 MB state, two whole huge pages and more
BIG = CacheLayout(PnMixConfig(), 1, 4, 64, 32768)
on_linux = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="huge pages are asked with Linux's madvise")


def thp_mode() -> str:
    """Linux's transparent huge page mode: the bracketed word of always/madvise/never."""
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text.split("[")[1].split("]")[0]


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps fields of the mapping holding `address`."""
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


@on_linux
def test_a_big_state_is_one_zeroed_mapping_of_separate_tensors():
    assert BIG.state_bytes > 2 * HUGE_PAGE_BYTES
    state = BIG.empty_state()
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
def test_a_tensor_keeps_the_mapping_alive():
    codes = BIG.empty_state()["key_codes"]  # the dict and the other tensors are gone
    gc.collect()
    codes.fill_(7)
    assert int(codes.sum()) == 7 * codes.numel()


@on_linux
@pytest.mark.skipif(sys.platform != "linux" or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="no transparent huge pages in this kernel")
def test_the_mapping_is_asked_for_huge_pages():
    if thp_mode() == "never":
        pytest.skip("this kernel's transparent huge pages are off (never): the request is ignored")
    state = BIG.empty_state()
    fields = mapping_of(state["key_codes"].data_ptr())
    assert fields.get("THPeligible") == "1", fields
    # the madvise flag ("hg") is on the mapping itself, whatever the kernel's mode
    assert "hg" in fields["VmFlags"].split()


def test_a_state_under_a_huge_page_is_torchs_own():
    small = CacheLayout(PnMixConfig(), 1, 2, 32, 512)
    assert small.state_bytes < HUGE_PAGE_BYTES
    assert zeros_on_huge_pages({n: (s, torch.uint8) for n, s in small.state_shapes().items()}) is None
    assert all(t.untyped_storage().resizable() for t in small.empty_state().values())


def test_a_cache_on_huge_pages_gives_the_bytes_and_outputs_of_one_on_torchs_pages(random_kv):
    k, v = random_kv(1, 4, 2000, 64, seed=3)
    q = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(4)).half()
    cache = PackedKVCache(PnMixConfig(), 4, 64, 16384)
    plain = PackedKVCache(PnMixConfig(), 4, 64, 16384)
    plain.state = {name: torch.zeros_like(t).clone() for name, t in cache.state.items()}
    if hasattr(mmap, "MADV_HUGEPAGE"):  # the 2.6 MB state is on the mapping, the copies on torch's pages
        assert not any(t.untyped_storage().resizable() for t in cache.state.values())
    assert all(t.untyped_storage().resizable() for t in plain.state.values())
    for c in (cache, plain):
        c.append(k[:, :, :1800], v[:, :, :1800])
        c.append(k[:, :, 1800:], v[:, :, 1800:])
    assert all(torch.equal(cache.state[name], plain.state[name]) for name in STATE_NAMES)
    assert torch.equal(cache.attend(q), plain.attend(q))


def test_the_switch_opts_out_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv(HUGE_PAGES_SWITCH, "0")
    assert all(t.untyped_storage().resizable() and not t.any() for t in BIG.empty_state().values())
    for bad in ("", "yes", "2", " 1"):
        monkeypatch.setenv(HUGE_PAGES_SWITCH, bad)
        for layout in (BIG, CacheLayout(PnMixConfig(), 1, 2, 32, 512)):  # a small state too
            with pytest.raises(PnMixError, match=f"{HUGE_PAGES_SWITCH} must be 0 or 1, got"):
                layout.empty_state()
