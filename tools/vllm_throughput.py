"""Output throughput of vLLM with its default, fp8 and pn-mix caches on SmolLM2-135M (docs/VLLM.md 6).

    python tools/vllm_throughput.py [--caches default,fp8,pnmix] [--requests 16] [--prompt-tokens 4032]
                                    [--max-tokens 64] [--kv-gib 3] [--work DIR] [--nice 0]

Writes the packaged SmolLM2-135M as a Hugging Face folder (once, under --work), and per cache a
driver spec (pnmix/vllm/driver.py): `requests` prompts, prompt i the tokenized Hamlet's tokens
[3000 i, 3000 i + prompt_tokens) (a shorter stride where the text is too short for 3000),
`max_tokens` greedy tokens each with
`ignore_eos`, all submitted at once to one `LLM.generate`. The engine: fp32, eager, max_model_len
prompt + max_tokens rounded up to the block size, `kv_cache_memory_bytes` --kv-gib GiB,
`max_num_seqs` = requests, prefix caching off (pn-mix refuses it; off for all so all run alike).
Each cache runs in vLLM's Python ($PNMIX_VLLM_PYTHON or .venv-vllm/bin/python), one after the
other, and prints generate's wall time, output tokens/s and the ratio to the default's; with
--json, the rows and every sequence's tokens (so pn-mix's can be compared with PnMixCache's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHES = {
    "default": {},
    "fp8": {"kv_cache_dtype": "fp8"},
    "pnmix": {"attention_backend": "CUSTOM"},
}


def hf_folder(work: Path) -> Path:
    from pnmix.hf.models import resolve_model, save_hf_folder

    folder = work / "smollm2-hf"
    if not (folder / "config.json").is_file():
        save_hf_folder(resolve_model("smollm2-135m"), folder)
    return folder


def prompts(folder: Path, requests: int, prompt_tokens: int) -> list:
    from transformers import AutoTokenizer

    from pnmix.dataset import text_or_hamlet

    ids = AutoTokenizer.from_pretrained(folder)(text_or_hamlet(None))["input_ids"]
    stride = min(3000, (len(ids) - prompt_tokens) // max(requests - 1, 1))
    if stride < 1:
        sys.exit(f"error: the text has {len(ids)} tokens, too few for {requests} prompts of {prompt_tokens}")
    return [ids[stride * i: stride * i + prompt_tokens] for i in range(requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", default="default,fp8,pnmix")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=4032)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-gib", type=float, default=3.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pnmix-vllm-throughput"))
    parser.add_argument("--nice", type=int, default=0, help="run the engines at this niceness")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    caches = args.caches.split(",")
    unknown = [c for c in caches if c not in CACHES]
    if unknown:
        sys.exit(f"error: unknown cache {unknown[0]!r}; choose from {', '.join(CACHES)}")
    python = Path(os.environ.get("PNMIX_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
    if not python.is_file():
        sys.exit(f"error: vLLM's Python not found at {python} (docs/VLLM.md 1)")
    args.work.mkdir(parents=True, exist_ok=True)
    folder = hf_folder(args.work)
    spec_prompts = prompts(folder, args.requests, args.prompt_tokens)
    model_len = -(-(args.prompt_tokens + args.max_tokens) // 64) * 64
    rows = []
    for cache in caches:
        engine = dict(dtype="float32", enforce_eager=True, max_model_len=model_len,
                      kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)), max_num_seqs=args.requests,
                      enable_prefix_caching=False, seed=0, **CACHES[cache])
        spec = dict(model=str(folder), prompts=spec_prompts, max_tokens=[args.max_tokens] * args.requests,
                    engine=engine)
        spec_path, out_path = args.work / f"spec-{cache}.json", args.work / f"out-{cache}.json"
        spec_path.write_text(json.dumps(spec))
        command = ["nice", "-n", str(args.nice), str(python), "-m", "pnmix.vllm.driver", str(spec_path), str(out_path)]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            sys.exit(f"error: the {cache} engine failed: {tail}")
        out = json.loads(out_path.read_text())
        tokens = sum(len(r["tokens"]) for r in out["rows"])
        row = dict(cache=cache, generate_s=out["generate_seconds"], output_tokens=tokens,
                   tokens_per_s=tokens / out["generate_seconds"], process_s=time.perf_counter() - started,
                   sequences=[r["tokens"] for r in out["rows"]])
        rows.append(row)
        base = rows[0]["tokens_per_s"] if rows[0]["cache"] == "default" else None
        ratio = f" ({row['tokens_per_s'] / base:.2f}x default)" if base else ""
        print(f"{cache}: generate {row['generate_s']:.1f} s, {tokens} output tokens, "
              f"{row['tokens_per_s']:.2f} tokens/s{ratio} (process {row['process_s']:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(requests=args.requests, prompt_tokens=args.prompt_tokens,
                                              max_tokens=args.max_tokens, kv_gib=args.kv_gib, rows=rows)))


if __name__ == "__main__":
    main()
