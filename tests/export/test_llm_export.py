"""The traced LLM exporter (`pnmix export --model`), ONNX Runtime generation and `verify --onnx --model`
on tiny random Llama-family models made here (nothing downloaded)."""

import json
import os

import numpy as np
import onnx
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="the LLM exporter needs transformers")
pytest.importorskip("onnxruntime", reason="generation runs in ONNX Runtime")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (pnmix[hf])")

from pnmix import defaults  # noqa: E402
from pnmix.config import PnMixConfig  # noqa: E402
from pnmix.errors import PnMixError  # noqa: E402
from pnmix.export import ops  # noqa: E402
from pnmix.export.append_body import append_function  # noqa: E402
from pnmix.export.attention_body import attention_function  # noqa: E402
from pnmix.backends.onnxruntime.llm_session import LlmSession, greedy  # noqa: E402
from pnmix.export.llm_file import read_llm_info  # noqa: E402
from pnmix.testing import make_tiny_model  # noqa: E402
from pnmix.testing import SMALL  # noqa: E402

CAPACITY = 96


class Result:
    def __init__(self, result):
        self.returncode = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr


def run_cli(*args):
    """The CLI in this process (no re-import of torch and transformers per call)."""
    from typer.testing import CliRunner

    from pnmix.cli import app

    return Result(CliRunner().invoke(app, [str(a) for a in args]))


def default_opset(model) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def test_file_has_two_pnmix_nodes_per_layer_with_the_table_and_the_function_bodies(tiny):
    model = onnx.load(str(tiny["onnx"]), load_external_data=False)
    info = read_llm_info(tiny["onnx"])
    config = PnMixConfig.from_mapping(dict(PnMixConfig(pair_layout="half").to_dict(), **SMALL))
    assert info.config == config and info.layers == 2 and info.max_seq_len == CAPACITY
    nodes = [n for n in ops.walk_nodes(model.graph) if n.domain == ops.DOMAIN]
    assert sorted(n.op_type for n in nodes) == [ops.APPEND_OP] * 2 + [ops.ATTENTION_OP] * 2
    # each attention runs in the else branch of an If on seq_len == 0; a prefill (the then branch)
    # attends in fp32 through ONNX's Attention op (opset 23, the LLM files' default)
    ifs = [n for n in model.graph.node if n.op_type == "If"]

    def branch(node, name):
        return [x.op_type for x in ops.walk_nodes(onnx.helper.get_attribute_value(
            next(a for a in node.attribute if a.name == name)))]

    assert [branch(n, "else_branch") for n in ifs] == [[ops.ATTENTION_OP]] * 2
    assert all(branch(n, "then_branch").count("Attention") == 1 for n in ifs)
    assert default_opset(model) == defaults.LLM_EXPORT_OPSET == 23
    want = ops.node_attributes(config)
    for node in nodes:
        got = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        got = {k: v.decode() if isinstance(v, bytes) else v for k, v in got.items()}
        assert got == want
    functions = {f.name: f for f in model.functions if f.domain == ops.DOMAIN}
    assert functions[ops.ATTENTION_OP].SerializeToString() == \
        attention_function(info.layout, 4, 23).SerializeToString()
    assert functions[ops.APPEND_OP].SerializeToString() == append_function(info.layout, 23).SerializeToString()
    # the weights live beside the file (ONNX external data)
    external = [t for t in model.graph.initializer if onnx.external_data_helper.uses_external_data(t)]
    assert sum(np.prod(t.dims) * 4 for t in external) == tiny["result"].data_bytes > 300_000
    names = [i.name for i in model.graph.input]
    assert names[:3] == ["input_ids", "seq_len", "new_len"] and "past.1.pair_mask" in names
    assert "present.0.key_codes" in [o.name for o in model.graph.output]


def test_generation_in_onnx_runtime_matches_the_pytorch_decoder(tiny):
    """ORT greedy tokens equal the eager decoder's (the same module the file was traced from, with
    the custom ops' reference implementation) over enough tokens to quantize groups."""
    from pnmix.export.llm import build_decoder
    from pnmix.hf.models import resolve_model

    decoder, _, _ = build_decoder(resolve_model(str(tiny["folder"])), "fp32", CAPACITY, tiny["config"])
    prompt = list(range(3, 43))
    session = LlmSession(tiny["onnx"])
    result = greedy(session, prompt, 30)
    state, seq, ids, tokens = decoder.empty_state(), 0, prompt, []
    with torch.no_grad():
        for _ in range(30):
            out = decoder(torch.tensor([ids]), torch.tensor(seq), torch.tensor(len(ids)), state)
            seq += len(ids)
            state = list(out[1:])
            tokens.append(int(out[0][0, -1].argmax()))
            ids = [tokens[-1]]
    assert result.new_ids == tokens
    assert session.info.layout.lengths(session.seq_len).groups >= 2  # the run quantized groups


def test_opset_18_composes_the_prefill_and_generates_the_same_tokens(tiny, tmp_path):
    """`--opset 18` (runtimes without ONNX's Attention op): the prefill's attention is MatMul, a
    causal mask and Softmax; the file generates the default file's tokens, its prefill logits
    within float rounding of them."""
    out = tmp_path / "m18.onnx"
    result = run_cli("export", "--model", tiny["folder"], "--config", tiny["config"], "--max-seq-len", CAPACITY,
                     "-o", out, "--opset", 18)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "opset 18" in result.stdout
    model = onnx.load(str(out), load_external_data=False)
    assert default_opset(model) == 18
    kinds = [n.op_type for n in ops.walk_nodes(model.graph)]
    assert "Attention" not in kinds and "Softmax" in kinds
    prompt = list(range(3, 43))
    composed, fused = LlmSession(out), LlmSession(tiny["onnx"])
    logits = [s.step(prompt) for s in (composed, fused)]
    assert np.abs(logits[0] - logits[1]).max() <= 1e-4
    assert greedy(LlmSession(out), prompt, 20).new_ids == greedy(LlmSession(tiny["onnx"]), prompt, 20).new_ids
    bad = run_cli("export", "--model", tiny["folder"], "-o", tmp_path / "x.onnx", "--opset", 17)
    assert bad.returncode != 0 and "--opset must be 18.." in bad.stdout + bad.stderr
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_decoder_equals_the_transformers_model(tmp_path, model_type):
    """Biases (Qwen2), q/k norms and tied embeddings (Qwen3): the decoder's prefill logits are the
    transformers model's."""
    from pnmix.export.llama import PnMixDecoder
    from pnmix.hf.models import load_causal_lm, resolve_model

    hf = load_causal_lm(resolve_model(str(make_tiny_model(tmp_path / model_type, model_type))))
    decoder = PnMixDecoder(hf, PnMixConfig(pair_layout="half", **SMALL), 64).eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        ours = decoder(ids, torch.tensor(0), torch.tensor(ids.shape[1]), decoder.empty_state())[0]
        theirs = hf(ids).logits[:, -1:]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_cli_generate_prints_text_and_figures(tiny, tmp_path):
    out = tmp_path / "g.json"
    proc = run_cli("generate", tiny["onnx"], "--tokenizer", tiny["folder"], "--prompt", "the capital of france is",
                   "--max-new-tokens", "6", "--json", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["prompt_tokens"] == 5 and 1 <= report["new_tokens"] <= 6 and report["persistent_cache_bytes"] > 0
    assert report["completion"] in proc.stdout and "tokens/s" in proc.stdout


def test_cli_verify_onnx_model(tiny, tmp_path):
    out = tmp_path / "v.json"
    proc = run_cli("verify", "--onnx", tiny["onnx"], "--model", tiny["folder"], "--text", tiny["text"],
                   "--prompt-tokens", "40", "--decode-tokens", "12", "--json", out)
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert run["tokens_identical"] and run["graph_bytes_exact"], proc.stdout
    assert run["max_abs_diff_prefill_logits"] <= report["tolerance"]
    assert run["max_abs_diff_decode_logits"] <= run["decode_tolerance"]
    assert set(report) >= {"backend", "passed", "tolerance", "config", "runs", "manifest"}
    assert proc.returncode == (0 if report["passed"] else 1)


# ---- bad input: one line, exit 2, nothing written ------------------------------------------


def _one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    for word in words:
        assert word in lines[0]


def test_unsupported_architecture_is_one_line_naming_the_supported(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    proc = run_cli("export", "--model", folder, "-o", tmp_path / "m.onnx")
    _one_line_error(proc, "gpt2", "llama", "qwen3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_max_seq_len_beyond_positions_is_refused(tiny, tmp_path):
    proc = run_cli("export", "--model", tiny["folder"], "-o", tmp_path / "m.onnx", "--max-seq-len", "5000")
    _one_line_error(proc, "5000", "1024")
    assert list(tmp_path.iterdir()) == []


def test_prompt_over_capacity_is_refused(tiny, tmp_path):
    prompt = " ".join(["the"] * (CAPACITY + 1))
    proc = run_cli("generate", tiny["onnx"], "--tokenizer", tiny["folder"], "--prompt", prompt,
                   "--json", tmp_path / "g.json")
    _one_line_error(proc, "capacity")
    assert list(tmp_path.iterdir()) == []


def test_mismatched_tokenizer_is_refused(tiny, tmp_path):
    other = make_tiny_model(tmp_path / "other")
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {k: (v + 1) % len(vocab["model"]["vocab"]) for k, v in vocab["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    proc = run_cli("generate", tiny["onnx"], "--tokenizer", other, "--prompt", "the city", "--json", tmp_path / "g.json")
    _one_line_error(proc, "tokenizer")
    assert not (tmp_path / "g.json").exists()


def test_prompt_over_capacity_in_the_api(tiny):
    session = LlmSession(tiny["onnx"])
    with pytest.raises(PnMixError, match="capacity"):
        greedy(session, list(range(3, 3 + CAPACITY + 1)), 1)


# ---- TensorRT: the rewrite the parser gets (no TensorRT needed) ---------------------------------


def test_llm_file_rewritten_for_tensorrt_pairs_every_layer(tiny):
    from pnmix.backends.tensorrt import engine as trt

    from pnmix.export.llm_file import is_llm_file

    assert is_llm_file(tiny["onnx"])
    model = onnx.load(str(tiny["onnx"]))
    prepared = trt.prepare_onnx(model)
    assert not [f for f in prepared.functions if f.domain == ops.DOMAIN]
    order = {o: i for i, n in enumerate(prepared.graph.node) for o in n.output}
    appends = [n for n in prepared.graph.node if n.op_type == ops.APPEND_OP]
    assert len(appends) == 2
    for append in appends:
        assert len(append.input) == len(ops.APPEND_INPUTS) + 1
        attention = prepared.graph.node[order[append.input[-1]]]
        assert attention.op_type == ops.ATTENTION_OP and attention.input[1] == append.input[0]
        assert order[append.input[-1]] + 1 == order[append.output[0]]  # right after its attention
    assert trt.llm_profile_shapes(CAPACITY, 40) == [{"input_ids": ((1, 1), (1, 1), (1, 1))},
                                                   {"input_ids": ((1, 1), (1, 20), (1, 40))}]
    # the same rewrite serves the diagnostic build, which takes exactly one layer
    with pytest.raises(PnMixError, match="expected 1 PnMixAttention per PnMixAppend node, found 2 and 2"):
        trt.prepare_onnx(model, layers=1)


def test_the_flattened_branches_compute_what_the_if_computes(tiny, tmp_path):
    """TensorRT's rewrite turns each layer's If into both branches and a Where: the same logits
    after a prefill and after decode steps (run here with the function bodies)."""
    from pnmix.backends.tensorrt.engine import flatten_pnmix_branches

    model = onnx.load(str(tiny["onnx"]))
    flat = flatten_pnmix_branches(list(model.graph.node))
    assert not [n for n in flat if n.op_type == "If"]
    assert len([n for n in flat if n.op_type == ops.ATTENTION_OP]) == 2
    del model.graph.node[:]
    model.graph.node.extend(flat)
    onnx.save(model, str(tmp_path / "flat.onnx"))
    sessions = [LlmSession(path, ops="functions") for path in (tiny["onnx"], tmp_path / "flat.onnx")]
    for ids in (list(range(3, 40)), [7], [9], [11]):
        original, flattened = (s.step(ids) for s in sessions)
        np.testing.assert_array_equal(original, flattened)


@pytest.mark.skipif(__import__("importlib").util.find_spec("tensorrt") is not None, reason="TensorRT is installed")
def test_build_engine_on_the_llm_file_without_tensorrt_says_so(tiny, tmp_path):
    plugins = tmp_path / "libpnmix_trt_plugins.so"
    plugins.write_bytes(b"\x7fELF not really")
    proc = run_cli("build-engine", tiny["onnx"], "--plugins", plugins, "-o", tmp_path / "m.plan")
    _one_line_error(proc, "TensorRT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libpnmix_trt_plugins.so"]


def test_verify_of_an_llm_file_without_model_says_to_give_it(tiny):
    _one_line_error(run_cli("verify", "--onnx", tiny["onnx"]), "--model")


# ---- verify --engine --model: the engine path without TensorRT ----------------------------------


def _described_plan(tiny, folder, drop=(), **changes):
    """A stand-in plan with the description build-engine writes for the tiny file (fields changed
    or dropped as asked): everything verify reads before TensorRT."""
    from pnmix.backends.tensorrt import engine as trt
    from pnmix.export.llm_file import read_llm_info

    plan = folder / "m.plan"
    plan.write_bytes(b"not a plan")
    described = trt.llm_sidecar(read_llm_info(tiny["onnx"]), tiny["onnx"], plan, "11.1", "fp32",
                                trt.llm_profile_shapes(CAPACITY, 40))
    described = {key: value for key, value in {**described, **changes}.items() if key not in drop}
    trt.sidecar_path(plan).write_text(json.dumps(described))
    return plan


def test_llm_engine_sidecar_round_trips_through_the_reader(tiny, tmp_path):
    from pnmix.backends.tensorrt import engine as trt

    plan = _described_plan(tiny, tmp_path)
    described = trt.read_sidecar(plan)
    assert (described["kind"], described["layers"], described["capacity"]) == ("llm", 2, CAPACITY)
    described["layers"] = 0
    trt.sidecar_path(plan).write_text(json.dumps(described))
    with pytest.raises(PnMixError, match="field 'layers' must be an integer >= 1"):
        trt.read_sidecar(plan)


class _EngineLike:
    """An ONNX Runtime session posing as a runtime without K/V outputs (what a TensorRT engine is to
    verify): the engine path of verify_llm, everything but the TensorRT calls."""

    backend, runtime_name = "engine-llm", "TensorRT"

    def __init__(self, path):
        from pnmix.backends.onnxruntime.llm_session import LlmSession

        self._session = LlmSession(path)
        self.info = self._session.info

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_verify_llm_checks_a_session_without_kv_outputs(tiny):
    from pnmix.verify.llm import verify_llm

    session = _EngineLike(tiny["onnx"])
    report = verify_llm(tiny["onnx"], str(tiny["folder"]), tiny["text"], 40, 6, session=session)
    run = report["runs"][0]
    assert report["backend"] == "engine-llm" and run["runtime"]["name"] == "TensorRT"
    assert run["graph_bytes_exact"] is None and all(s["graph_bytes_exact"] is None for s in run["steps"])
    assert run["tokens_identical"] and report["passed"] and len(run["steps"]) == 7
    assert session.seq_len == 46  # the session really ran: prefill 40, then 6 steps


def test_verify_engine_model_errors_are_one_line(tiny, tmp_path):
    proc = run_cli("verify", "--engine", tmp_path / "missing.plan", "--model", tiny["folder"])
    _one_line_error(proc, "engine not found")
    proc = run_cli("verify", "--engine", tmp_path / "x.plan", "--onnx", tiny["onnx"], "--model", tiny["folder"])
    _one_line_error(proc, "not both")


def test_engine_session_checks_the_description_before_tensorrt(tiny, tmp_path):
    from pnmix.backends.tensorrt import engine as trt

    def verify(plan):
        return run_cli("verify", "--engine", plan, "--plugins", plan, "--model", tiny["folder"])

    _one_line_error(verify(_described_plan(tiny, tmp_path, onnx=str(tmp_path / "gone.onnx"))), "not there any more")
    _one_line_error(verify(_described_plan(tiny, tmp_path, layers=3)), "does not match")
    diagnostic = _described_plan(tiny, tmp_path, drop=trt.SIDECAR_LLM_FIELDS, config=PnMixConfig().to_dict())
    _one_line_error(verify(diagnostic), "diagnostic model's engine")
