"""libpnmix_ort: the two pn-mix ops as ONNX Runtime custom ops over libpnmix_core. The same
one-op models run once through the native kernels and once through their function bodies; the
present state must be byte-identical and the attention within the ONNX ops' tolerance, and bad
input must come back as one line."""

import json

import numpy as np
import onnx
import pytest
import torch

from pnmix._native import find_library
from pnmix.config import PnMixConfig
from pnmix.export import ops
from pnmix.export.exporter import build_op_model
from pnmix.format import STATE_NAMES

ort = pytest.importorskip("onnxruntime")

CAPACITY = 160
CONFIG = PnMixConfig(group_size=16, residual_size=24, sink_tokens=4, key_high_bits=5, key_low_bits=3,
                     value_bits=3, pair_layout="half")


@pytest.fixture(scope="module")
def library():
    path, reason = find_library("pnmix_ort")
    if path is None:
        pytest.skip(reason)
    return str(path)


def session(op, config=CONFIG, library=None, profile_dir=None, threads=None, model=None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if threads is not None:
        so.add_session_config_entry("pnmix.threads", str(threads))
    if profile_dir:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_dir / op)
    if library:
        so.register_custom_ops_library(library)
    model = model if model is not None else build_op_model(op, config, CAPACITY)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def empty_state(config=CONFIG):
    from pnmix.cache import PackedKVCache
    state = PackedKVCache(config, 2, 32, CAPACITY).layout.empty_state()
    return {name: (t.view(torch.int8) if t.dtype == torch.uint8 else t).numpy() for name, t in state.items()}


def kv(n, seed, heads=2):
    g = np.random.default_rng(seed)
    return g.standard_normal((1, heads, n, 32)).astype(np.float16), g.standard_normal((1, 2, n, 32)).astype(np.float16)


def append_feeds(k, v, seq_len, new_len, state):
    return {"k_new": k, "v_new": v, "seq_len": np.array(seq_len, np.int64), "new_len": np.array(new_len, np.int64), **state}


def attention_feeds(q, k, v, seq_len, new_len, state):
    return {"q": q, **append_feeds(k, v, seq_len, new_len, state)}


def test_native_and_function_bodies_agree_through_prefill_decode_and_evaluation(library):
    native = {op: session(op, library=library) for op in (ops.APPEND_OP, ops.ATTENTION_OP)}
    bodies = {op: session(op) for op in (ops.APPEND_OP, ops.ATTENTION_OP)}
    states = {"native": empty_state(), "bodies": empty_state()}
    seq_len = 0
    # prefill 30, decode steps across two group flushes, a chunk of 9, then an evaluation call
    steps = [30] + [1] * 20 + [9] + [0]
    for i, n in enumerate(steps):
        tokens = n or 3  # the evaluation call: 3 queries over the last 3 cached positions
        q, _ = kv(tokens, 100 + i, heads=4)
        k, v = kv(tokens, 200 + i)
        new_len = n
        outs = {}
        for which, sessions in (("native", native), ("bodies", bodies)):
            state = states[which]
            att = sessions[ops.ATTENTION_OP].run(None, attention_feeds(q, k, v, seq_len, new_len, state))[0]
            present = sessions[ops.APPEND_OP].run(None, append_feeds(k, v, seq_len, new_len, state))
            states[which] = dict(zip(STATE_NAMES, present))
            outs[which] = att
        for name in STATE_NAMES:
            assert states["native"][name].tobytes() == states["bodies"][name].tobytes(), (i, name)
        assert np.abs(outs["native"] - outs["bodies"]).max() <= 2e-3, i
        seq_len += new_len


def profiled_ops(sess):
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def test_the_native_kernel_runs_not_the_function_body(library, tmp_path):
    # The model holds BOTH the local function bodies and, once registered, the custom op.
    k, v = kv(30, 1)
    for op, feeds in ((ops.APPEND_OP, append_feeds(k, v, 0, 30, empty_state())),
                      (ops.ATTENTION_OP, attention_feeds(kv(30, 2, heads=4)[0], k, v, 0, 30, empty_state()))):
        native = session(op, library=library, profile_dir=tmp_path)
        native.run(None, feeds)
        assert profiled_ops(native) == {op}
        bodies = session(op, profile_dir=tmp_path)
        bodies.run(None, feeds)
        inlined = profiled_ops(bodies)
        assert op not in inlined and len(inlined) > 5


def one_line_error(sess, feeds):
    with pytest.raises(Exception) as info:
        sess.run(None, feeds)
    text = str(info.value)
    line = [part for part in text.splitlines() if "pnmix " in part]
    assert line, text
    return line[0][line[0].index("pnmix "):]


def test_a_wrong_state_size_is_one_line(library):
    sess = session(ops.APPEND_OP, library=library, model=_relaxed(build_op_model(ops.APPEND_OP, CONFIG, CAPACITY)))
    state = empty_state()
    state["value_step"] = state["value_step"][:, :, :1]
    k, v = kv(4, 3)
    msg = one_line_error(sess, append_feeds(k, v, 0, 4, state))
    assert msg.startswith("pnmix PnMixAppend: state tensor 'value_step' has") and "\n" not in msg


def test_a_wrong_dtype_is_one_line(library):
    model = build_op_model(ops.ATTENTION_OP, CONFIG, CAPACITY)
    for value in model.graph.input:
        if value.name == "key_step":
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    model.functions.pop()  # no body accepts it either: only the native kernel is left
    state = empty_state()
    state["key_step"] = state["key_step"].astype(np.float32)
    q, _ = kv(2, 4, heads=4)
    k, v = kv(2, 5)
    with pytest.raises(Exception) as info:
        session(ops.ATTENTION_OP, library=library, model=model).run(None, attention_feeds(q, k, v, 0, 2, state))
    assert "key_step" in str(info.value)


def test_a_config_the_core_refuses_is_one_line(library):
    model = build_op_model(ops.APPEND_OP, CONFIG, CAPACITY)
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "residual_size":
            attribute.i = 8  # < group_size
    with pytest.raises(Exception) as info:
        session(ops.APPEND_OP, library=library, model=model)
    text = str(info.value)
    assert "pnmix PnMixAppend: config field 'residual_size' must be >= group_size" in text


def test_seq_len_past_the_capacity_is_one_line(library):
    sess = session(ops.APPEND_OP, library=library)
    k, v = kv(4, 6)
    msg = one_line_error(sess, append_feeds(k, v, 10 * CAPACITY, 4, empty_state()))
    assert "exceeds the state's capacity" in msg


def test_a_runtime_too_old_gets_one_status_line_not_a_crash(library):
    """RegisterCustomOps against a runtime that offers only API 1 (a stand-in OrtApiBase, whose
    table holds CreateStatus alone): the library asks for its minimum, gets NULL, and returns one
    ORT_FAIL status naming both versions, without touching any other slot."""
    import ctypes

    made = []
    create_status_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
    create_status = create_status_type(lambda code, text: made.append((code, text.decode())) or 0x5EED)
    table = (ctypes.c_void_p * 1)(ctypes.cast(create_status, ctypes.c_void_p).value)
    asked = []

    def get_api(version):
        asked.append(version)
        return ctypes.addressof(table) if version == 1 else None

    version = ctypes.create_string_buffer(b"1.10.0")
    get_api_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
    version_type = ctypes.CFUNCTYPE(ctypes.c_void_p)

    class ApiBase(ctypes.Structure):
        _fields_ = [("GetApi", get_api_type), ("GetVersionString", version_type)]

    base = ApiBase(get_api_type(get_api), version_type(lambda: ctypes.addressof(version)))
    register = ctypes.CDLL(library).RegisterCustomOps
    register.restype = ctypes.c_void_p
    register.argtypes = [ctypes.c_void_p, ctypes.POINTER(ApiBase)]
    assert register(None, ctypes.byref(base)) == 0x5EED
    assert asked[0] > 1 and asked[-1] == 1
    ORT_FAIL = 1
    assert len(made) == 1 and made[0][0] == ORT_FAIL
    assert made[0][1].startswith(f"libpnmix_ort needs ONNX Runtime API {asked[0]} (")
    assert made[0][1].endswith("or newer, this runtime is 1.10.0")


def test_threads_come_from_the_session_config(library):
    k, v = kv(30, 7)
    q, _ = kv(30, 8, heads=4)
    feeds = attention_feeds(q, k, v, 0, 30, empty_state())
    one = session(ops.ATTENTION_OP, library=library, threads=1).run(None, feeds)[0]
    assert np.array_equal(one, session(ops.ATTENTION_OP, library=library, threads=2).run(None, feeds)[0])
    with pytest.raises(Exception) as info:
        session(ops.ATTENTION_OP, library=library, threads="many")
    assert "pnmix.threads must be an integer" in str(info.value)


def _relaxed(model):
    """The model with dynamic state shapes, so ONNX Runtime lets a wrongly sized state reach the op."""
    for value in model.graph.input:
        if value.name in STATE_NAMES:
            for dim in value.type.tensor_type.shape.dim:
                dim.dim_param = "s_" + value.name
    return model


@pytest.fixture(scope="module")
def tiny_llm_file(tmp_path_factory):
    pytest.importorskip("transformers")
    from pnmix.export.llm import export_llm
    from pnmix.testing import make_tiny_model

    folder = tmp_path_factory.mktemp("llm")
    return export_llm(str(make_tiny_model(folder / "model")), folder / "m.onnx", 300).path


@pytest.mark.slow
def test_an_llm_session_updates_its_state_in_place_exactly_as_a_copying_one(library, tiny_llm_file):
    """Native ops with present.* bound onto past.* (no copy between calls) against native ops
    that copy: the same bytes in every layer and the same tokens after a prefill and 40 decode
    steps (group flushes included), so each layer's attention reads the state before its append."""
    from pnmix.backends.onnxruntime.llm_session import LlmSession, greedy

    ids = [3 + (i * 7) % 120 for i in range(150)]
    in_place = LlmSession(tiny_llm_file, ops="native")
    copying = LlmSession(tiny_llm_file, ops="native")
    copying.in_place = False
    copying.reset()
    assert in_place.in_place
    first, second = greedy(in_place, ids, 40), greedy(copying, ids, 40)
    assert first.new_ids == second.new_ids
    np.testing.assert_array_equal(first.first_logits, second.first_logits)
    assert in_place.seq_len == copying.seq_len == 189
    for name, array in in_place.state.items():
        np.testing.assert_array_equal(array, copying.state[name], err_msg=name)


@pytest.mark.slow
def test_an_llm_session_with_native_ops_generates_as_the_function_bodies(library, tiny_llm_file):
    from pnmix.backends.onnxruntime.llm_session import LlmSession, greedy

    ids = [3 + (i * 5) % 120 for i in range(60)]
    native, functions = LlmSession(tiny_llm_file, ops="native"), LlmSession(tiny_llm_file, ops="functions")
    assert (native.ops, functions.ops) == ("native", "functions")
    assert greedy(native, ids, 20).new_ids == greedy(functions, ids, 20).new_ids
