"""Each pn-mix op alone through ONNX Runtime (its function body) on K/V chosen to hit the
edge rules of docs/METHOD.md section 3: energy ties, constant groups (step 0), saturating fp16, 1-bit
fits, codes straddling bytes. Packed bytes must equal append_reference's."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from pnmix import reference
from pnmix.cache import PackedKVCache
from pnmix.config import PnMixConfig
from pnmix.export import ops
from pnmix.export.exporter import build_op_model
from pnmix.dump import dump_state
from pnmix.format import STATE_NAMES

CAPACITY = 160
SMALL = dict(group_size=16, residual_size=24, sink_tokens=4)


def session(op, config):
    model = build_op_model(op, config, CAPACITY)
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def as_onnx(state):
    return {name: (t.view(torch.int8) if t.dtype == torch.uint8 else t).numpy() for name, t in state.items()}


def append_both(config, chunks):
    """Append the K/V chunks with the ONNX op and with the reference; return both caches' dumps."""
    sess = session(ops.APPEND_OP, config)
    cache = PackedKVCache(config, 2, 32, CAPACITY)
    state = as_onnx(cache.layout.empty_state())
    for k, v in chunks:
        feeds = {"k_new": k.numpy(), "v_new": v.numpy(), "seq_len": np.array(cache.seq_len),
                 "new_len": np.array(k.shape[2]), **state}
        state = dict(zip(STATE_NAMES, sess.run(None, feeds)))
        cache.append(k, v)
    mine = {name: torch.from_numpy(a).view(cache.state[name].dtype) for name, a in state.items()}
    return dump_state(cache.layout, mine, cache.seq_len), dump_state(cache.layout, cache.state, cache.seq_len)


def split(k, v, sizes):
    out, at = [], 0
    for n in sizes:
        out.append((k[:, :, at:at + n], v[:, :, at:at + n]))
        at += n
    return out


CONFIGS = {
    "manifest-bits": dict(SMALL),
    "straddling": dict(SMALL, key_high_bits=5, key_low_bits=3, value_bits=3, pair_layout="half"),
    "one-bit": dict(SMALL, key_high_bits=1, key_low_bits=1, value_bits=1, value_group_size=8),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("scale", [1.0, 3000.0])
def test_random_kv_in_chunks(random_kv, name, scale):
    k, v = random_kv(1, 2, 120, 32, seed=3, scale=scale)
    ours, ref = append_both(PnMixConfig(**CONFIGS[name]), split(k, v, [30, 1, 1, 40, 1, 47]))
    assert ours == ref


def test_energy_ties_go_to_the_lower_pair_and_constant_groups_give_step_zero():
    k = torch.ones(1, 2, 60, 32, dtype=torch.float16)  # every pair has the same energy
    v = torch.full((1, 2, 60, 32), -2.5, dtype=torch.float16)
    config = PnMixConfig(**SMALL)
    ours, ref = append_both(config, split(k, v, [60]))
    assert ours == ref
    cache = PackedKVCache(config, 2, 32, CAPACITY)
    cache.append(k, v)
    assert cache.pair_mask()[0, 0].tolist() == [True] * 8 + [False] * 8


def test_saturating_steps_and_offsets():
    g = torch.Generator().manual_seed(5)
    k = (torch.randint(0, 2, (1, 2, 70, 32), generator=g) * 2 - 1).to(torch.float16) * 65504
    v = k.flip(2)
    for bits in (dict(key_high_bits=2, key_low_bits=1, value_bits=1), dict(key_high_bits=8, key_low_bits=4)):
        ours, ref = append_both(PnMixConfig(**SMALL, **bits), split(k, v, [70]))
        assert ours == ref


def test_attention_op_matches_reference_attend(random_kv):
    config = PnMixConfig(**CONFIGS["straddling"])
    cache = PackedKVCache(config, 2, 32, CAPACITY)
    k, v = random_kv(1, 2, 100, 32, seed=8)
    cache.append(k, v)
    q = random_kv(1, 4, 3, 32, seed=9)[0]
    k_new, v_new = random_kv(1, 2, 3, 32, seed=10)
    sess = session(ops.ATTENTION_OP, config)
    for new_len, (kn, vn) in ((3, (k_new, v_new)), (0, (k_new, v_new))):
        feeds = {"q": q.numpy(), "k_new": kn.numpy(), "v_new": vn.numpy(), "seq_len": np.array(cache.seq_len),
                 "new_len": np.array(new_len), **as_onnx(cache.state)}
        ours = sess.run(None, feeds)[0]
        expected = reference.attend(q, cache.layout, cache.state, cache.seq_len,
                                    k_new if new_len else None, v_new if new_len else None)
        assert np.abs(ours - expected.numpy()).max() <= 2e-3


def test_garbage_in_unused_slots_does_not_reach_the_output(random_kv):
    # Only the used part of the state is defined (FORMAT.md section 3); NaN elsewhere must not leak.
    config = PnMixConfig(**SMALL)
    cache = PackedKVCache(config, 2, 32, CAPACITY)
    k, v = random_kv(1, 2, 50, 32, seed=11)
    cache.append(k, v)
    n = cache.lengths()
    dirty = {name: t.clone() for name, t in cache.state.items()}
    for name in ("residual_k", "residual_v"):
        dirty[name][:, :, n.residual:] = float("nan")
    for name in ("key_step", "key_offset", "value_step", "value_offset"):
        dirty[name][:, :, n.groups:] = float("nan")
    q = random_kv(1, 4, 2, 32, seed=12)[0]
    feeds = {"q": q.numpy(), "k_new": q[:, :2].numpy(), "v_new": q[:, :2].numpy(),
             "seq_len": np.array(cache.seq_len), "new_len": np.array(0), **as_onnx(dirty)}
    ours = session(ops.ATTENTION_OP, config).run(None, feeds)[0]
    expected = reference.attend(q, cache.layout, cache.state, cache.seq_len)
    assert np.isfinite(ours).all() and np.abs(ours - expected.numpy()).max() <= 2e-3
