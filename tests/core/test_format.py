import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pnmix.config import PnMixConfig, RunConfig
from pnmix.errors import PnMixError
from pnmix.dump import DUMP_HEADER_BYTES, dump_state, load_state
from pnmix.format import CacheLayout
from pnmix.packing import pack_codes, pack_pair_mask, unpack_codes, unpack_pair_mask
from pnmix.manifest import spec_formula_bytes


def test_manifest_byte_counts_exactly():
    layout = CacheLayout(PnMixConfig(), 1, 2, 32, 448)
    assert layout.persistent_bytes(448) == {
        "key_bytes": 15108, "value_bytes": 17408, "persistent_cache_bytes": 32516}
    assert layout.lengths(448) == (32, 3, 32)


def test_format_doc_example_three_bit_stream():
    codes = torch.tensor([5, 2, 7, 0, 0, 0, 0, 0], dtype=torch.uint8)
    assert pack_codes(codes, 3).tolist() == [0xD5, 0x01, 0x00]


@settings(max_examples=80, deadline=None)
@given(bits=st.integers(1, 8), bytes_=st.integers(1, 12), rows=st.integers(1, 3), seed=st.integers(0, 999))
def test_pack_unpack_round_trip(bits, bytes_, rows, seed):
    n = bytes_ * 8  # any n with n*bits % 8 == 0 works; multiples of 8 cover every bit width
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, n * bits // 8)  # dense: no padding bits
    assert torch.equal(unpack_codes(packed, bits, n), codes)


@settings(max_examples=40, deadline=None)
@given(high=st.integers(1, 8), low=st.integers(1, 8), layout_name=st.sampled_from(["adjacent", "half"]),
       head_dim=st.sampled_from([8, 16, 32]), group=st.sampled_from([8, 16, 64]), ratio=st.floats(0, 1),
       seed=st.integers(0, 999))
def test_key_group_pack_unpack_round_trip_with_mixed_bits(high, low, layout_name, head_dim, group, ratio, seed):
    config = PnMixConfig(key_high_bits=high, key_low_bits=low, pair_layout=layout_name, group_size=group,
                         residual_size=group, high_ratio=ratio, value_group_size=head_dim)
    layout = CacheLayout(config, 1, 3, head_dim, 64)
    g = torch.Generator().manual_seed(seed)
    n_high = config.high_pairs(head_dim)
    order = torch.rand(3, head_dim // 2, generator=g).argsort(-1)
    high_pairs = torch.zeros(3, head_dim // 2, dtype=torch.bool).scatter_(-1, order[:, :n_high], True)
    bits = layout.channel_bits(high_pairs)
    codes = (torch.rand(3, head_dim, group, generator=g) * (2 ** bits.unsqueeze(-1))).to(torch.uint8)
    packed = layout.pack_key_group(codes, bits)
    assert torch.equal(layout.unpack_key_group(packed, bits), codes)


def test_channel_streams_sit_at_prefix_sum_offsets():
    config = PnMixConfig(group_size=8, residual_size=8, value_group_size=4)
    layout = CacheLayout(config, 1, 1, 4, 16)
    bits = torch.tensor([[3, 3, 1, 1]], dtype=torch.int32)
    assert layout.key_channel_offsets(bits).tolist() == [[0, 3, 6, 7]]
    codes = torch.zeros(1, 4, 8, dtype=torch.uint8)
    codes[0, 3] = 1  # channel 3, one bit per token: its byte is all ones
    assert layout.pack_key_group(codes, bits).tolist() == [[0, 0, 0, 0, 0, 0, 0, 0xFF]]


@pytest.mark.parametrize("layout_name, expected", [("adjacent", [0, 0, 1, 1, 2, 2, 3, 3]),
                                                    ("half", [0, 1, 2, 3, 0, 1, 2, 3])])
def test_pair_layouts(layout_name, expected):
    from pnmix.format import channel_pairs

    assert channel_pairs(8, layout_name).tolist() == expected


def test_pair_mask_bits_are_head_major_lsb_first():
    high = torch.zeros(1, 2, 16, dtype=torch.bool)
    high[0, 0, 0] = True  # bit 0
    high[0, 1, 1] = True  # bit 17
    packed = pack_pair_mask(high)
    assert packed.tolist() == [[1, 0, 2, 0]]
    assert torch.equal(unpack_pair_mask(packed, 2, 16), high)


@settings(max_examples=60, deadline=None)
@given(group=st.sampled_from([8, 16, 64, 128]), extra=st.integers(0, 64), sink=st.integers(0, 40),
       vbits=st.sampled_from([1, 2, 4, 8]), high=st.integers(1, 8), low=st.integers(1, 8),
       ratio=st.floats(0, 1), vgs=st.sampled_from([4, 8, 32, 128]), n=st.integers(1, 700))
def test_measured_bytes_equal_spec_formula(group, extra, sink, vbits, high, low, ratio, vgs, n):
    config = PnMixConfig(group_size=group, residual_size=group + extra, sink_tokens=sink, value_bits=vbits,
                         key_high_bits=high, key_low_bits=low, high_ratio=ratio, value_group_size=vgs)
    layout = CacheLayout(config, 1, 2, 32, n)
    run = RunConfig(config, prefill_tokens=n, decode_tokens=0)
    assert layout.persistent_bytes(n) == spec_formula_bytes(run, n)


def test_dump_size_is_header_plus_persistent_bytes_and_round_trips(other_config, random_kv):
    from pnmix.cache import PackedKVCache

    cache = PackedKVCache(other_config, 2, 32, 300, batch=2)
    k, v = random_kv(2, 2, 250, 32)
    cache.append(k, v)
    blob = dump_state(cache.layout, cache.state, cache.seq_len)
    assert len(blob) == DUMP_HEADER_BYTES + cache.layout.persistent_bytes(250)["persistent_cache_bytes"]
    layout, state, seq_len = load_state(blob)
    assert seq_len == 250 and layout.config == other_config and layout.batch == 2
    assert dump_state(layout, state, seq_len) == blob


@pytest.mark.parametrize("cut", [0, 10, DUMP_HEADER_BYTES, -1])
def test_truncated_dump_fails_cleanly(cut, random_kv):
    from pnmix.cache import PackedKVCache

    cache = PackedKVCache(PnMixConfig(), 2, 32, 448)
    cache.append(*random_kv(1, 2, 448, 32))
    blob = dump_state(cache.layout, cache.state, cache.seq_len)
    with pytest.raises(PnMixError):
        load_state(blob[:cut] if cut >= 0 else blob + b"\0")


def test_dump_with_bad_magic_or_config_fails_cleanly():
    cache_blob = dump_state(CacheLayout(PnMixConfig(), 1, 2, 32, 8), CacheLayout(PnMixConfig(), 1, 2, 32, 8).empty_state(), 0)
    with pytest.raises(PnMixError, match="magic"):
        load_state(b"XXXX" + cache_blob[4:])
    bad_group = cache_blob[:8] + (100).to_bytes(4, "little") + cache_blob[12:]
    with pytest.raises(PnMixError, match="group_size"):
        load_state(bad_group)
