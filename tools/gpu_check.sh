#!/usr/bin/env bash
# tools/gpu_check.sh: everything pnmix checks on a GPU machine, in one run of about 10 minutes.
#
# Needs only what a CUDA image has (python3 with torch and triton, nvcc, cmake, ninja, pytest);
# downloads nothing. Steps:
#   1. environment          nvidia-smi, torch, nvcc
#   2. build                libpnmix_core + libpnmix_cuda (cmake, sm_80 + sm_90)
#   3. CUDA kernel tests    tests/backends/test_cuda.py (bytes vs reference, attention within 1e-3)
#   4. Triton tests         tests/backends/test_triton.py
#   5. verify               pnmix verify --backend triton|cuda --device cuda
#   6. decode benchmark     pnmix bench decode, 4K / 32K / 128K tokens, batch 1 and 8,
#                           32 query heads, 8 KV heads, head_dim 128: time per step, bytes read,
#                           GB/s and the ratio against fp16 SDPA; then the kernel alone timed with
#                           CUDA events (no per-step synchronization), tensor-core and SIMT paths
#   7. TensorRT             only where `import tensorrt` works: build the plugins and the C++
#                           example, their tests, export -> build-engine -> verify --engine
#                           (verify_engine.json), pnmix_trt_run (prefill + 64 decode steps); the
#                           multi-layer LLM file of a tiny random Llama -> build-engine
# The transcript goes to $OUT/gpu_check.log (or build/gpu_check_logs/), with verify_triton.json, verify_cuda.json and
# bench_decode.json (all benchmark figures) beside it: few files, as $OUT brings back only 8.
# A failing step is reported and the later steps still run, so one lease gives every figure;
# the exit status is non-zero if any step failed.
# Options (environment): PNMIX_BENCH_REPEATS (default 30), PNMIX_SANITIZE=1 (also run a small
# kernel test under compute-sanitizer memcheck), PNMIX_SKIP_BENCH=1.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
LOGS="${OUT:-$ROOT/build/gpu_check_logs}"
mkdir -p "$LOGS"
WORK="$(mktemp -d)"  # per-step logs
exec > >(tee "$LOGS/gpu_check.log") 2>&1
BUILD="$ROOT/build/gpu"
REPEATS="${PNMIX_BENCH_REPEATS:-30}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PNMIX_LIB_DIR="$BUILD"
export PYTHONUNBUFFERED=1
FAILED=()
START=$(date +%s)

banner() { printf '\n==================== %s  (+%ss) ====================\n' "$*" "$(( $(date +%s) - START ))"; }
# run NAME TIMEOUT CMD...: show and log the output, record a failure instead of stopping.
run() {
  local name="$1" limit="$2"
  shift 2
  if timeout "$limit" "$@" 2>&1 | tee "$WORK/$name.log"; then
    echo "-- $name: ok"
  else
    echo "-- $name: FAILED"
    FAILED+=("$name")
  fi
}

banner "1/7 environment"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "torch sees no CUDA device: tools/gpu_check.sh is for a GPU machine"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
nvcc --version | tail -1
TRT=0
if python3 -c "import tensorrt" 2>/dev/null; then TRT=1; fi

banner "2/7 build (cmake, Release)"
TRT_FLAG=-DPNMIX_BUILD_TRT=OFF
if [ "$TRT" = 1 ]; then TRT_FLAG=-DPNMIX_BUILD_TRT=ON; fi
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
t0=$(date +%s)
cmake -S plugins -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release "$TRT_FLAG" > "$WORK/configure.log" 2>&1 \
  || { cat "$WORK/configure.log"; exit 1; }
cmake --build "$BUILD" -j"$(nproc)" > "$WORK/build.log" 2>&1 || { tail -60 "$WORK/build.log"; exit 1; }
tail -2 "$WORK/build.log"
echo "build: $(( $(date +%s) - t0 )) s; libraries:"
find "$BUILD" -name 'libpnmix_*.so' -printf '  %p\n'
python3 -c "from pnmix.backends import cuda_ops; ok, where = cuda_ops.library_status(); print('libpnmix_cuda:', where); assert ok"

banner "3/7 CUDA kernel tests (tests/backends/test_cuda.py)"
run test_cuda 300 python3 -m pytest -q -rs tests/backends/test_cuda.py
if [ "${PNMIX_SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  run sanitize 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 -m pytest -q -x tests/backends/test_cuda.py -k "odd_lengths or only_sink or bench_factory"
fi

banner "4/7 Triton tests (tests/backends/test_triton.py)"
if [ -f tests/backends/test_triton.py ]; then
  run test_triton 300 python3 -m pytest -q -rs tests/backends/test_triton.py
else
  echo "tests/backends/test_triton.py not present: skipped"
fi

banner "5/7 pnmix verify --backend triton|cuda --device cuda"
run verify_triton 240 python3 -m pnmix verify --backend triton --device cuda --json "$LOGS/verify_triton.json"
run verify_cuda 120 python3 -m pnmix verify --backend cuda --device cuda --json "$LOGS/verify_cuda.json"

banner "6/7 decode attention benchmark"
if [ "${PNMIX_SKIP_BENCH:-0}" = 1 ]; then
  echo "PNMIX_SKIP_BENCH=1: skipped"
else
  echo "---- 6a: pnmix bench decode (GPU implementations; per-step wall time, synchronized)"
  for context in 4096 32768 131072; do
    for batch in 1 8; do
      echo "---- context $context, batch $batch"
      run "bench_${context}_b${batch}" 240 python3 -m pnmix bench decode --device cuda --context "$context" \
        --batch "$batch" --q-heads 32 --kv-heads 8 --head-dim 128 --repeats "$REPEATS" \
        --impls sdpa_fp16,triton,cuda --json "$WORK/bench_${context}_b${batch}.json"
    done
  done
  echo
  echo "---- 6b: kernel time, CUDA events over $REPEATS back-to-back steps: libpnmix_cuda vs fp16 SDPA"
  echo "     (random cache contents: the kernels' time does not depend on the values)"
  run kernel_timing 400 python3 - "$REPEATS" "$WORK/kernel_timing.json" <<'PY'
import json, os, sys
import torch
import torch.nn.functional as F
from pnmix.backends import cuda_ops
from pnmix.config import PnMixConfig
from pnmix.format import CacheLayout

repeats, rows = int(sys.argv[1]), []

def ms_per_call(fn):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / repeats)
    return best

def pnmix_step(layout, state, context, q, path):
    # the path is fixed when the step is planned (and captured): PNMIX_CUDA_SIMT picks it
    os.environ["PNMIX_CUDA_SIMT"] = "1" if path == "simt" else "0"
    return cuda_ops.bench_factory(layout, state, context, q)

print(f"{'context':>8} {'batch':>5} {'MB read':>8} {'mma us':>8} {'GB/s':>6} {'simt us':>8} {'GB/s':>6} "
      f"{'SDPA us':>8} {'SDPA MB':>8} {'GB/s':>6} {'speed-up':>8}")
for context in (4096, 32768, 131072):
    for batch in (1, 8):
        layout = CacheLayout(PnMixConfig(), batch, 8, 128, context + 1)
        state = layout.empty_state("cuda")
        for t in state.values():
            if t.dtype == torch.uint8:
                t.random_(0, 256)
            else:
                t.normal_()
        q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.float16)
        mma = pnmix_step(layout, state, context, q, "mma")
        mma_out = mma().clone()
        t_mma = ms_per_call(mma)
        simt = pnmix_step(layout, state, context, q, "simt")
        t_simt = ms_per_call(simt)
        agree = (simt() - mma_out).abs().max().item()
        read = cuda_ops.bytes_read(layout, context, 32)
        del state, mma, simt
        k = torch.randn(batch, 8, context, 128, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        t_sdpa = ms_per_call(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        sdpa_read = 2 * k.numel() * 2 + q.numel() * 2
        del k, v
        best = min(t_mma, t_simt)
        row = dict(context=context, batch=batch, bytes_read=read, mma_ms=t_mma, simt_ms=t_simt,
                   mma_gbps=read / t_mma / 1e6, simt_gbps=read / t_simt / 1e6, mma_vs_simt_max_diff=agree,
                   sdpa_fp16_ms=t_sdpa, sdpa_bytes=sdpa_read, sdpa_gbps=sdpa_read / t_sdpa / 1e6,
                   speedup_vs_sdpa_fp16=t_sdpa / best)
        rows.append(row)
        print(f"{context:>8} {batch:>5} {read / 1e6:>8.1f} {t_mma * 1e3:>8.1f} {row['mma_gbps']:>6.0f} "
              f"{t_simt * 1e3:>8.1f} {row['simt_gbps']:>6.0f} {t_sdpa * 1e3:>8.1f} {sdpa_read / 1e6:>8.1f} "
              f"{row['sdpa_gbps']:>6.0f} {t_sdpa / best:>7.2f}x   (mma vs simt max diff {agree:.2g})")
        torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[2], "w"), indent=1)
PY
  # every figure in one file
  python3 - "$WORK" "$LOGS/bench_decode.json" <<'PY' || true
import json, pathlib, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    runs[path.stem] = json.loads(path.read_text())
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
print(f"{len(runs)} benchmark results -> {sys.argv[2]}")
PY
  echo
  echo "Goals on an H200: >= 4x faster than fp16 SDPA from 32K tokens; >= 70% of 4.8 TB/s on the bytes read."
  echo "At 4K the whole working set fits in the 60 MB L2, so GB/s there can exceed HBM bandwidth."
fi

banner "7/7 TensorRT"
if [ "$TRT" = 1 ]; then
  # ==== TensorRT section (owned by the TensorRT work: plugins/trt, plugins/examples, pnmix/backends/tensorrt/) ====
  # Headers: $TENSORRT_INCLUDE_DIR, the usual install folders, or third_party/TensorRT/include (a
  # copy of NVIDIA/TensorRT's include/; match the installed TensorRT's major version). libnvinfer:
  # $TENSORRT_LIB_DIR, else the pip wheel's tensorrt_libs folder (only the C++ example links it).
  python3 -c "import tensorrt; print('TensorRT', tensorrt.__version__)"
  TRT_INC=""
  for d in "${TENSORRT_INCLUDE_DIR:-}" /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu \
           /usr/local/tensorrt/include /opt/tensorrt/include "$ROOT/third_party/TensorRT/include"; do
    if [ -n "$d" ] && [ -f "$d/NvInfer.h" ]; then TRT_INC="$d"; break; fi
  done
  TRT_LIB="${TENSORRT_LIB_DIR:-$(python3 -c 'import os, tensorrt_libs; print(os.path.dirname(tensorrt_libs.__file__))' 2>/dev/null || true)}"
  TRT_PY_MAJOR="$(python3 -c 'import tensorrt; print(tensorrt.__version__.split(".")[0])' || true)"
  TRT_H_MAJOR=""
  if [ -n "$TRT_INC" ]; then
    TRT_H_MAJOR="$(grep -hE '#define (TRT_MAJOR_ENTERPRISE|NV_TENSORRT_MAJOR) [0-9]' "$TRT_INC/NvInferVersion.h" | head -1 | awk '{print $3}' || true)"
  fi
  if [ -z "$TRT_INC" ]; then
    echo "-- trt: no NvInfer.h found (set TENSORRT_INCLUDE_DIR): the plugins cannot be built"
    FAILED+=("trt_headers")
  elif [ "$TRT_H_MAJOR" != "$TRT_PY_MAJOR" ]; then
    # The plugin interfaces are C++ vtables: 11.x's ILogger derives from IVersionedInterface, 10.x's
    # does not, so a library built on the other major's headers crashes when it logs.
    echo "-- trt: headers in $TRT_INC are TensorRT $TRT_H_MAJOR, the runtime is $TRT_PY_MAJOR; set TENSORRT_INCLUDE_DIR to matching headers"
    FAILED+=("trt_header_version")
  else
    echo "TensorRT headers: $TRT_INC ($(grep -h 'define TRT_MAJOR_ENTERPRISE\|define NV_TENSORRT_MAJOR ' "$TRT_INC/NvInferVersion.h" | head -1)); libnvinfer folder: ${TRT_LIB:-none}"
    run trt_configure 300 cmake -S plugins -B "$BUILD" -DTENSORRT_INCLUDE_DIR="$TRT_INC" -DTENSORRT_LIB_DIR="$TRT_LIB"
    run trt_build 600 cmake --build "$BUILD" -j"$(nproc)"
    PLUGINS="$BUILD/trt/libpnmix_trt_plugins.so"
    if [ -f "$PLUGINS" ]; then
      nm -D --defined-only "$PLUGINS" | grep -E ' (getCreators|setLoggerFinder)$' || true
      run trt_tests 300 python3 -m pytest -q -rs tests/backends/test_trt_fields.py tests/backends/test_trt_build.py tests/backends/test_trt_plugin_host.py
      run trt_export 300 python3 -m pnmix export -o "$WORK/pnmix.onnx" --max-seq-len 4096
      run trt_build_engine 900 python3 -m pnmix build-engine "$WORK/pnmix.onnx" --plugins "$PLUGINS" \
        -o "$WORK/pnmix.plan" --max-seq-len 512
      if [ -f "$WORK/pnmix.plan" ]; then
        ls -l "$WORK/pnmix.plan"
        run trt_verify 900 python3 -m pnmix verify --engine "$WORK/pnmix.plan" --plugins "$PLUGINS" \
          --json "$LOGS/verify_engine.json"
        if [ -x "$BUILD/examples/pnmix_trt_run" ]; then
          run trt_example 300 "$BUILD/examples/pnmix_trt_run" --engine "$WORK/pnmix.plan" --plugins "$PLUGINS" \
            --text pnmix/data/hamlet.txt
        else
          echo "-- trt_example: not linked (libnvinfer not found; set TENSORRT_LIB_DIR)"
        fi
        if command -v trtexec >/dev/null; then  # trtexec's own plugin loading (random inputs would be bad lengths)
          run trt_trtexec 300 trtexec --loadEngine="$WORK/pnmix.plan" --dynamicPlugins="$PLUGINS" --skipInference
        fi
      fi
      # The multi-layer LLM file (pnmix export --model) on a tiny random Llama made here: the
      # rewrite for the parser, the two profiles on input_ids, the sidecar.
      run trt_llm_export 600 bash -c "python3 -c 'from pathlib import Path; from pnmix.testing import make_tiny_model; make_tiny_model(Path(\"$WORK/tiny\"))' && python3 -m pnmix export --model '$WORK/tiny' -o '$WORK/llm.onnx' --max-seq-len 512"
      if [ -f "$WORK/llm.onnx" ]; then
        run trt_llm_build_engine 900 python3 -m pnmix build-engine "$WORK/llm.onnx" --plugins "$PLUGINS" \
          -o "$WORK/llm.plan" --max-seq-len 256
        [ -f "$WORK/llm.plan.json" ] && cat "$WORK/llm.plan.json"
        if [ -f "$WORK/llm.plan" ]; then  # the engine against PyTorch with PnMixCache, as verify --onnx --model
          run trt_llm_verify 600 python3 -m pnmix verify --engine "$WORK/llm.plan" --plugins "$PLUGINS" \
            --model "$WORK/tiny" --prompt-tokens 40 --decode-tokens 8 --json "$LOGS/verify_llm_engine.json"
        fi
        if [ -f "$WORK/llm.plan" ] && [ -x "$BUILD/examples/pnmix_trt_run" ]; then  # greedy over token ids
          run trt_llm_example 300 "$BUILD/examples/pnmix_trt_run" --engine "$WORK/llm.plan" --plugins "$PLUGINS" \
            --tokens 1,2,3,4,5,6,7,8,9,10,11,12 --max-new-tokens 16
        fi
      fi
    fi
  fi
  # ==== end of the TensorRT section ====
else
  echo "TensorRT not installed (python3 -c 'import tensorrt' fails): skipped"
fi

banner "done"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "FAILED steps: ${FAILED[*]}"
  exit 1
fi
echo "all steps passed; logs in $LOGS"
