"""`pnmix bench decode`: time one decode-attention step over a cache of N tokens, per implementation.

A synthetic cache (random fp16 K/V, one query token per sequence, attending to all N cached
tokens) is built once; the same K/V feed the dense caches of the SDPA baselines and, quantized,
the packed cache. Each implementation is warmed up, then timed for ``repeats`` steps; the median
is reported with the cache's bytes, the bytes one step reads and the achieved GB/s.

Implementations (names in the JSON):

* ``sdpa_fp32``, ``sdpa_bf16`` (and ``sdpa_fp16`` on GPU): torch
  ``scaled_dot_product_attention`` over a dense cache of that dtype, GQA via ``enable_gqa`` (the call
  a user writes);
* ``sdpa_fp32_grouped``, ``sdpa_bf16_grouped``: the same dense cache, with the query heads of each KV
  head passed as rows of one attention (``q.view(B, H, Hq/H, D)``, exact for one query token): each
  K/V byte is read once, which on CPU is several times faster than ``enable_gqa``; the strongest dense
  baseline we know, reported so the packed kernels' ratios are not flattered;
* ``reference``: pnmix.reference.attend on the packed cache (dequantizes the whole cache each
  step; skipped above 32K tokens unless named in ``--impls``);
* ``core``: libpnmix_core's packed decode attention (CPU threads, AVX2/AVX-512), exact fp32 arithmetic;
* ``core_int8``: the same library on its integer path (``pnmix_set_attend_arith("int8")``: weights
  rounded to int8, codes multiplied as bytes; the avx512vnni kernel where the CPU has AVX-512 VBMI
  and VNNI, else avx2), with ``arith`` saying which halves ran it; each core row's ``isa`` names
  its kernel;
* ``ort_gqa_fp32``, ``ort_gqa_fp16``, ``ort_gqa_int8``, ``ort_gqa_int4`` (scales per KV head and
  channel) and ``ort_gqa_int8_tensor``, ``ort_gqa_int4_tensor`` (one scale): ONNX Runtime's
  GroupQueryAttention on CPU over its dense and quantized KV caches (pnmix.bench.ort_peers), each with its
  cache bytes; a mode this onnxruntime cannot run is skipped with the reason;
* on GPU, ``triton`` and ``cuda``: the other components' kernels, loaded lazily.

GPU factory contract (``pnmix.backends.triton_ops:bench_factory``, ``pnmix.backends.cuda_ops:bench_factory``):
``bench_factory(layout, state, seq_len, q) -> callable``; ``state`` (format.STATE_NAMES tensors)
and ``q`` fp16 ``[B, Hq, 1, D]`` are already on the CUDA device; the zero-argument callable runs
one decode-attention step of q over the ``seq_len`` cached tokens and returns the fp32 output.
An import or construction failure skips that implementation with its one-line reason.

Bytes read per step: dense caches read K and V (``2 * B * H * N * D * itemsize``); the packed
kernels read the persistent bytes (FORMAT.md section 5); ``reference`` also writes and reads a
dequantized fp32 copy of the cache, counted too.

The limit, measured in the same run: ``machine.stream_gbs`` is the machine's streaming read
bandwidth with the same thread count (stream_read_gbs: the best of a few sums over a buffer far
larger than the caches, 4x the last-level cache and at least 256 MiB: ``machine.stream_bytes``);
each result's ``gbs`` (= ``gbps``) is its bytes read per second and ``bandwidth_fraction`` the
share of that limit it reaches.

The other limit, in the same run: ``machine.matmul_gflops`` is the machine's fp32 arithmetic rate
with the same thread count (matmul_gflops: the best of a few fp32 matrix products small enough to
stay in the caches). Decode attention does the same arithmetic however the cache is stored, one
multiply-add per query head, cached token and channel for the scores and one for the values
(decode_flops); each result's ``gflops`` is that over its time and ``compute_fraction`` its share
of the fp32 rate. A kernel far below both limits is bound by neither; one near the compute limit
cannot reach the bandwidth limit by better memory access.

The register rates, in the same run (libpnmix_core's pnmix_madd_rate), with the instructions of the
kernel each arithmetic runs on (``machine.fp32_fma_isa``, ``machine.int8_madd_isa``):
``machine.fp32_fma_gflops`` (independent fp32 FMAs, 8 or 16 lanes) and ``machine.int8_madd_gops``
(the integer path's inner step: vpmaddubsw + vpaddw pairs on avx2, vpdpbusd on avx512vnni), both
counting 2 operations per multiply-add; ``core_int8``'s ``int8_fraction`` is its share of the int8
rate, and the notes print the step's multiply-adds at each rate. ``core_int8``'s
``int8_stream_ceiling`` joins the two limits: the largest ``bandwidth_fraction`` a step that reads
its bytes and does its multiply-adds at the int8 register rate can reach (1 where the bytes take
longer than the products), so a goal stated as a share of the stream can be checked against what
the instructions allow on this machine. Only where both halves ran the integer path (``arith``
"int8"): with one half in fp32 the int8 rate bounds nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from pnmix import defaults
from pnmix.config import MAX_BATCH, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_SEQ_LEN, PnMixConfig, run_config
from pnmix.errors import PnMixError, describe
from pnmix.format import STATE_DTYPES, CacheLayout
from pnmix.machine import check_threads, describe_machine, last_level_cache_bytes, resolve_device
from pnmix.bench.ort_peers import DENSE as ORT_DENSE
from pnmix.bench.ort_peers import MODES as ORT_MODES
from pnmix.bench.report import optional_text, print_table, run_report, skipped_notes
from pnmix.bench.timing import Timing, best_seconds, round_order, time_calls, time_once

CPU_IMPLS = ("sdpa_fp32", "sdpa_bf16", "sdpa_fp32_grouped", "sdpa_bf16_grouped", "reference", "core", "core_int8",
             "ort_gqa_fp32", "ort_gqa_fp16", "ort_gqa_int8", "ort_gqa_int4", "ort_gqa_int8_tensor",
             "ort_gqa_int4_tensor")
SDPA_DTYPES = {"sdpa_fp32": torch.float32, "sdpa_bf16": torch.bfloat16, "sdpa_fp16": torch.float16,
               "sdpa_fp32_grouped": torch.float32, "sdpa_bf16_grouped": torch.bfloat16}
GPU_IMPLS = ("sdpa_fp16", "triton", "cuda")
PACKED_CORE = {"core": "fp32", "core_int8": "int8"}  # libpnmix_core's rows and their arithmetic
PACKED_IMPLS = ("core", "core_int8", "triton", "cuda")
ALL_IMPLS = CPU_IMPLS + GPU_IMPLS
GPU_FACTORIES = {"triton": "pnmix.backends.triton_ops:bench_factory", "cuda": "pnmix.backends.cuda_ops:bench_factory"}
STREAM_MIN_BYTES = 256 << 20  # the bandwidth probe's buffer: at least this,
STREAM_CACHE_MULTIPLE = 4  # and this many times the last-level cache (so it streams from memory),
STREAM_MAX_BYTES = 4 << 30  # but no more than this
STREAM_RUNS = 5
MATMUL_SIZE = 512  # the compute probe's square fp32 matrices: 3 MiB, cache-resident on the CPUs we target
MATMUL_RUNS = 20
REFERENCE_AUTO_LIMIT = 32768  # the reference dequantizes everything per step: too slow above this
FILL_CHUNK = 8192  # tokens per append call while filling the cache (bounds the reference's scratch)


class Skip(Exception):
    """An implementation that cannot run here, with the reason."""


# ---------------------------------------------------------------------------------------
# The synthetic cache
# ---------------------------------------------------------------------------------------


def fill_cache(layout: CacheLayout, k: torch.Tensor, v: torch.Tensor, threads: Optional[int]):
    """The packed state of k/v [B, H, N, D] fp16 on CPU through the registry's CPU default (the
    core's append when built, fast; else the reference's), chunked so whole groups are quantized
    per call. (threads: the append runs on one thread in either; kept for the callers.)"""
    from pnmix.backends import default_ops

    append = default_ops("cpu").append
    state = layout.empty_state(huge_pages=True)  # a cache's, as PackedKVCache allocates it
    n = k.shape[2]
    for start in range(0, n, FILL_CHUNK):
        stop = min(n, start + FILL_CHUNK)
        append(layout, state, start, k[:, :, start:stop], v[:, :, start:stop])
    return state


def dense_bytes(layout: CacheLayout, seq_len: int, itemsize: int) -> int:
    return 2 * layout.batch * layout.kv_heads * seq_len * layout.head_dim * itemsize


# ---------------------------------------------------------------------------------------
# Implementations: each returns (callable, device, cache_bytes, bytes_read)
# ---------------------------------------------------------------------------------------


def _sdpa(dtype: torch.dtype, device: str, k, v, q, grouped: bool) -> Callable[[], torch.Tensor]:
    import torch.nn.functional as F

    kd, vd, qd = (t.to(device=device, dtype=dtype) for t in (k, v, q))
    if not grouped:
        return lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
    batch, q_heads, _, head_dim = qd.shape
    rows = qd.reshape(batch, kd.shape[1], q_heads // kd.shape[1], head_dim)  # one query token per head
    return lambda: F.scaled_dot_product_attention(rows, kd, vd).reshape(batch, q_heads, 1, head_dim)


def make_impl(name: str, ctx: dict):
    layout, n, device = ctx["layout"], ctx["context"], ctx["device"]
    packed = layout.persistent_bytes(n)["persistent_cache_bytes"]
    if name in SDPA_DTYPES:
        dtype = SDPA_DTYPES[name]
        if name == "sdpa_fp16" and device == "cpu":
            raise Skip("fp16 SDPA is a GPU baseline (run with --device cuda)")
        size = dense_bytes(layout, n, torch.tensor([], dtype=dtype).element_size())
        fn = _sdpa(dtype, device, ctx["k"], ctx["v"], ctx["q"], grouped=name.endswith("_grouped"))
        return fn, device, size, size
    if name == "reference":
        from pnmix import reference

        state = {key: t.to(device) for key, t in ctx["state"].items()}
        q = ctx["q"].to(device)
        return (lambda: reference.attend(q, layout, state, n)), device, packed, packed + 2 * dense_bytes(layout, n, 4)
    if name in PACKED_CORE:
        from pnmix._native import NativeLibraryError
        from pnmix.backends.core_ops import CoreOps

        try:
            ops = CoreOps(ctx["threads"])
            # the arithmetic is process-wide: each row sets its own before it is timed
            ops.set_arith(PACKED_CORE[name])
        except (NativeLibraryError, PnMixError) as exc:  # not built, or no AVX2: a skip with the reason
            raise Skip(str(exc)) from None
        state, q = ctx["state"], ctx["q"]
        ctx.setdefault("isa", {})[name] = ops.isa()
        if name == "core":
            ctx["core_isa"] = ops.isa()
        ctx.setdefault("arith", {})[name] = ops.arith_for(layout)
        return (lambda: ops.attend(q, layout, state, n, None, None)), "cpu", packed, packed
    if name in ORT_MODES:
        from pnmix.bench import ort_peers  # noqa: F811

        try:
            fn = ort_peers.make_step(name, ctx["k"], ctx["v"], ctx["q"], ctx["threads"] or torch.get_num_threads())
        except ort_peers.Unavailable as why:
            raise Skip(str(why)) from None
        batch, kv_heads, _, head_dim = ctx["k"].shape
        size = ort_peers.cache_bytes(ORT_MODES[name], batch, kv_heads, n, head_dim)
        return fn, "cpu", size, size
    if name in GPU_FACTORIES:
        if device == "cpu":
            raise Skip(f"{name} is a GPU implementation (run with --device cuda on a CUDA machine)")
        module_name, attr = GPU_FACTORIES[name].split(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
            state = {key: t.to(device) for key, t in ctx["state"].items()}
            fn = factory(layout, state, n, ctx["q"].to(device))
        except Exception as exc:  # a missing module, library or GPU: skip with the reason
            raise Skip(describe(exc)) from None
        return fn, device, packed, packed
    raise PnMixError(f"unknown implementation '{name}'; choose from {', '.join(ALL_IMPLS)}")


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------


SLOW_STEP_S = 1.0  # a first warm-up step this slow is the only warm-up, and caps the timed steps
SLOW_REPEATS = 3


def time_step(fn: Callable[[], torch.Tensor], device: str, repeats: int) -> tuple[Timing, torch.Tensor]:
    """(the timed steps, the output) after warm-up (two calls: caches, thread pool, allocator); a
    slow step (> SLOW_STEP_S) runs at most SLOW_REPEATS times. The CPU time (all threads) is the
    figure to trust on a busy machine."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    return time_calls(fn, repeats, warmup=2, sync=sync, slow_s=SLOW_STEP_S, slow_repeats=SLOW_REPEATS)


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


MAX_Q_HEADS = 1 << 16
MAX_REPEATS = 1_000_000
MAX_ROUNDS = 100


def _check_args(context, batch, q_heads, kv_heads, head_dim, threads, repeats, config: PnMixConfig,
                rounds: int = 1) -> CacheLayout:
    """Every option's range, in one place, before anything is allocated; returns the layout."""
    limits = [("context", context, MAX_SEQ_LEN), ("batch", batch, MAX_BATCH), ("q-heads", q_heads, MAX_Q_HEADS),
              ("kv-heads", kv_heads, MAX_KV_HEADS), ("head-dim", head_dim, MAX_HEAD_DIM),
              ("repeats", repeats, MAX_REPEATS), ("rounds", rounds, MAX_ROUNDS)]
    check_threads(threads)
    for name, value, most in limits:
        if not 1 <= value <= most:
            raise PnMixError(f"--{name} must be 1..{most}, got {value}")
    if q_heads % kv_heads:
        raise PnMixError(f"--q-heads {q_heads} must be a multiple of --kv-heads {kv_heads}")
    return CacheLayout(config, batch, kv_heads, head_dim, context)  # head-dim vs the config, state size


def state_bytes(layout: CacheLayout) -> int:
    """Bytes of the packed state tensors as allocated (capacity = the context)."""
    return sum(math.prod(shape) * STATE_DTYPES[name].itemsize for name, shape in layout.state_shapes().items())


def memory_needed(layout: CacheLayout, q_heads: int, names: List[str], device: str) -> Dict[str, int]:
    """Peak bytes per device ("cpu", and the GPU's name) of a run over these implementations: the
    fp16 K/V and the packed state always sit in host memory; each implementation adds its own
    copies while it runs (one at a time), and the agreement check may dequantize on the host."""
    n = layout.max_seq_len
    dense = dense_bytes(layout, n, 1)  # bytes per byte of element size: 2 * B * H * N * D
    packed = state_bytes(layout)
    host = 2 * dense + packed + 2 * layout.batch * q_heads * layout.head_dim + stream_probe_bytes()
    extra = {"cpu": 0, device: 0}
    for name in names:
        where = "cpu" if name == "core" or name in ORT_MODES or device == "cpu" else device
        if name in SDPA_DTYPES:
            cost = dense * torch.tensor([], dtype=SDPA_DTYPES[name]).element_size()
        elif name == "reference":  # the whole cache dequantized to fp32, and its state copy
            cost = 4 * dense + (packed if where != "cpu" else 0)
        elif name in GPU_FACTORIES:
            cost = packed if where != "cpu" else 0
        elif name in ORT_MODES:  # its cache, and the fp32 copy of K/V it is made from
            mode = ORT_MODES[name]
            cost = dense * 4 + dense * torch.tensor([], dtype=getattr(torch, mode.cache)).element_size() // mode.codes_per_byte
        else:
            cost = 0
        extra[where] = max(extra[where], cost)
    if n <= REFERENCE_AUTO_LIMIT:  # _add_agreement's reference output, computed on the host
        extra["cpu"] = max(extra["cpu"], 4 * dense)
    # Temporaries (scores, outputs, conversions) and the process itself: a quarter more (measured at
    # 262144 tokens on CPU: a 4.6 GB peak where the tensors above count 3.4 GB).
    need = {"cpu": (host + extra["cpu"]) * 5 // 4}
    if device != "cpu":
        need[device] = extra[device] * 5 // 4
    return need


def _check_memory(layout: CacheLayout, q_heads: int, names: List[str], device: str) -> None:
    from pnmix.memory import check_fits

    for where, need in memory_needed(layout, q_heads, names, device).items():
        check_fits(need, f"--context {layout.max_seq_len} with --batch {layout.batch}, --kv-heads "
                   f"{layout.kv_heads}, --head-dim {layout.head_dim}", "lower --context (or --batch, "
                   "--kv-heads, --head-dim, or name fewer --impls)", where)


def _choose_impls(impls: Optional[str], device: str, context: int) -> tuple[List[str], Dict[str, str]]:
    skipped: Dict[str, str] = {}
    if impls is not None:
        from pnmix.errors import parse_list

        names = parse_list(impls, "--impls")
        unknown = [name for name in names if name not in ALL_IMPLS]
        if unknown:
            raise PnMixError(f"unknown implementation '{unknown[0]}'; choose from {', '.join(ALL_IMPLS)}")
        return names, skipped
    names = list(CPU_IMPLS) + (list(GPU_IMPLS) if device != "cpu" else [])
    if context > REFERENCE_AUTO_LIMIT:
        names.remove("reference")
        skipped["reference"] = (f"skipped above {REFERENCE_AUTO_LIMIT} tokens: it dequantizes the whole cache "
                                "every step (name it in --impls to run it anyway)")
    return names, skipped


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch on `threads` threads inside the block; its thread count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_seconds(threads: int, fn: Callable[[], object], runs: int) -> float:
    """The fastest of `runs` timed calls of fn with torch on `threads` threads, after one untimed
    call (pages touched, thread pool awake)."""
    with torch_threads(threads):
        return best_seconds(fn, runs)


def stream_probe_bytes() -> int:
    """The bandwidth probe's buffer size: 4x this machine's last-level cache, within 256 MiB-4 GiB.
    A fixed 256 MiB read 25 GB/s on a Xeon VM with a 480 MiB L3, where 1 and 2 GiB read 29-31:
    partly cached, it measured neither the cache nor the memory."""
    cache = last_level_cache_bytes() or 0
    return min(max(STREAM_MIN_BYTES, STREAM_CACHE_MULTIPLE * cache), STREAM_MAX_BYTES)


def stream_read_gbs(threads: int, nbytes: Optional[int] = None, runs: int = STREAM_RUNS) -> float:
    """The machine's streaming read bandwidth in GB/s with `threads` threads: the best of `runs`
    sums of an fp32 buffer far larger than the caches (stream_probe_bytes; torch's vectorized,
    multi-threaded reduction reads each byte once and does one add per element, so memory is the
    limit)."""
    nbytes = nbytes or stream_probe_bytes()
    buffer = torch.ones(nbytes // 4)
    return nbytes / _best_seconds(threads, buffer.sum, runs) / 1e9


def matmul_gflops(threads: int, n: int = MATMUL_SIZE, runs: int = MATMUL_RUNS) -> float:
    """The machine's fp32 arithmetic rate in GFLOP/s with `threads` threads: the best of `runs`
    products of two n x n fp32 matrices (2 n^3 flops each; torch's BLAS runs them near the
    multiply-add units' peak)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g) for _ in range(2))
    out = torch.empty(n, n)
    return 2 * n ** 3 / _best_seconds(threads, lambda: torch.mm(a, b, out=out), runs) / 1e9


INT8_INSTRUCTION = {"avx512vnni": "vpdpbusd"}  # else vpmaddubsw+vpaddw (avx2)


def madd_rates(threads: int) -> Dict[str, Any]:
    """fp32 FMA and int8 multiply-add rates with the data in registers (GFLOP/s and GOP/s, 2 per
    multiply-add) on the kernel each arithmetic runs on, from libpnmix_core; None where it is not
    built or the CPU lacks AVX2."""
    from pnmix._native import NativeLibraryError

    rates: Dict[str, Any] = {}
    try:
        from pnmix.backends.core_ops import CoreOps

        ops = CoreOps(threads)
        for kind, key in (("fp32", "fp32_fma"), ("int8", "int8_madd")):
            ops.set_arith(kind)  # the probe runs the instructions of this arithmetic's kernel
            rates[f"{key}_isa"] = ops.isa()
            rates[f"{key}_{'gflops' if kind == 'fp32' else 'gops'}"] = 2 * ops.madd_rate(kind, threads) / 1e9
        ops.set_arith("auto")
        return rates
    except (NativeLibraryError, PnMixError):
        return {"fp32_fma_gflops": None, "int8_madd_gops": None, "fp32_fma_isa": None, "int8_madd_isa": None}


def decode_flops(batch: int, q_heads: int, context: int, head_dim: int) -> int:
    """The arithmetic of one decode-attention step, however the cache is stored: per query head,
    cached token and channel one multiply-add for the score and one for the value sum (2 flops
    each); the softmax and the dequantization are left out, so this is a lower bound."""
    return 4 * batch * q_heads * context * head_dim


def int8_stream_ceiling(bytes_read: int, stream_gbs: float, flops: int, int8_gops: float) -> float:
    """The largest share of the stream bandwidth a step can reach whose multiply-adds (flops, 2 per
    multiply-add) run at the int8 register rate: the time to stream its bytes over the time of its
    products, capped at 1."""
    return min(1.0, (bytes_read / stream_gbs) / (flops / int8_gops))


@contextlib.contextmanager
def forced_kernel(isa: Optional[str]):
    """libpnmix_core's kernel forced to `isa` for the block (process-wide, as CoreOps.set_isa), the
    CPU's best again after it; None or "auto": nothing forced. A kernel this CPU or build lacks, or an
    unknown name, is a PnMixError before anything runs."""
    if isa is None or isa == "auto":
        yield
        return
    from pnmix.backends.core_ops import CoreOps

    try:
        ops = CoreOps()
        ops.set_isa(isa)
    except PnMixError as exc:  # not built, not this CPU's, or no such kernel
        raise PnMixError(f"--isa {isa}: {exc}") from None
    try:
        yield
    finally:
        ops.set_isa("auto")


def run_decode_bench(context: int, batch: int = defaults.DECODE_BATCH, q_heads: int = defaults.DECODE_Q_HEADS,
                     kv_heads: int = defaults.DECODE_KV_HEADS, head_dim: int = defaults.DECODE_HEAD_DIM,
                     threads: Optional[int] = None, device: str = "cpu", impls: Optional[str] = None,
                     repeats: int = defaults.BENCH_REPEATS, config: Optional[PnMixConfig] = None, seed: int = 0,
                     rounds: int = 1, isa: Optional[str] = None) -> dict:
    """The benchmark as data: {"results": [...], "skipped": [...], "machine": {...}, ...}.

    rounds > 1 times every implementation again in each round, in the reverse order of the round
    before (each set up anew, so memory stays one implementation at a time): on a shared machine a
    burst of load then falls on several implementations instead of on one. Each result's
    ``median_ms`` is the median of its rounds' medians, and ``round_medians_ms`` lists them.

    isa forces libpnmix_core's kernel (forced_kernel) for the core rows and the register rates: on an
    AVX-512 machine, "avx2" times the kernels an AVX2-only CPU runs."""
    with forced_kernel(isa):
        report = _decode_bench(context, batch, q_heads, kv_heads, head_dim, threads, device, impls, repeats, config,
                               seed, rounds)
    return {**report, "isa": isa or "auto"}


def _decode_bench(context: int, batch: int, q_heads: int, kv_heads: int, head_dim: int, threads: Optional[int],
                  device: str, impls: Optional[str], repeats: int, config: Optional[PnMixConfig], seed: int,
                  rounds: int) -> dict:
    config = config or PnMixConfig()
    layout = _check_args(context, batch, q_heads, kv_heads, head_dim, threads, repeats, config, rounds)
    names, skipped = _choose_impls(impls, device, context)
    _check_memory(layout, q_heads, names, device)
    if threads is not None:
        torch.set_num_threads(threads)
    used_threads = threads or torch.get_num_threads()
    stream_bytes = stream_probe_bytes()
    stream_gbs = stream_read_gbs(used_threads, stream_bytes)
    fp32_gflops = matmul_gflops(used_threads)
    register_rates = madd_rates(used_threads)
    flops = decode_flops(batch, q_heads, context, head_dim)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, context, head_dim, generator=g).half()
    v = torch.randn(batch, kv_heads, context, head_dim, generator=g).half()
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g).half()
    state, fill_seconds = time_once(fill_cache, layout, k, v, threads)
    ctx = dict(layout=layout, context=context, device=device, k=k, v=v, q=q, state=state, threads=threads)

    timed: Dict[str, dict] = {}
    outputs: Dict[str, torch.Tensor] = {}
    for name in round_order(names, rounds, alternate=True):
        if name in skipped:  # skipped in an earlier round: not set up again
            continue
        try:
            fn, where, cache_bytes, read = make_impl(name, ctx)
            timing, out = time_step(fn, where, repeats)
        except Skip as why:
            if name not in timed:  # a later round's failure keeps the rounds already timed
                skipped[name] = str(why)
            continue
        outputs.setdefault(name, out.float().cpu())
        entry = timed.setdefault(name, {"where": where, "cache_bytes": cache_bytes, "read": read, "rounds": []})
        entry["rounds"].append(timing)
        del fn  # before the next implementation is set up: one in memory at a time
    results = []
    for name in names:
        if name not in timed:
            continue
        entry = timed[name]
        where, cache_bytes, read, timings = entry["where"], entry["cache_bytes"], entry["read"], entry["rounds"]
        # the median of the rounds' medians: a round that met a burst of load counts as one
        median = statistics.median(t.median_s for t in timings)
        cpu = statistics.median(t.cpu_mean_s for t in timings)
        gbs = read / median / 1e9
        gflops = flops / median / 1e9
        results.append({
            "impl": name, "device": where, "median_ms": median * 1e3, "cpu_ms": cpu * 1e3,
            "repeats": sum(t.count for t in timings), "round_medians_ms": [t.median_s * 1e3 for t in timings],
            "cache_bytes": cache_bytes, "bytes_read": read, "gbps": gbs, "gbs": gbs,
            # the host's read bandwidth is the limit of the CPU implementations only
            "bandwidth_fraction": gbs / stream_gbs if where == "cpu" else None,
            "flops": flops, "gflops": gflops, "compute_fraction": gflops / fp32_gflops if where == "cpu" else None,
        })
    int8_rate = register_rates["int8_madd_gops"]
    for r in results:
        if r["impl"] in ctx.get("arith", {}):
            r["arith"] = ctx["arith"][r["impl"]]
            r["isa"] = ctx["isa"][r["impl"]]
        if r["impl"] == "core_int8" and int8_rate:
            r["int8_fraction"] = r["gflops"] / int8_rate
            if r.get("arith") == "int8":  # both halves on the integer path: all its products at that rate
                r["int8_stream_ceiling"] = int8_stream_ceiling(r["bytes_read"], stream_gbs, flops, int8_rate)
    _restore_arith(ctx)
    _add_ratios(results)
    _add_agreement(results, outputs, ctx)
    return {
        "context": context, "batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "rounds": rounds,
        "config": config.to_dict(), "fill_seconds": fill_seconds,
        "dense_fp16_bytes": dense_bytes(layout, context, 2),
        "packed_bytes": layout.persistent_bytes(context)["persistent_cache_bytes"],
        "core_isa": ctx.get("core_isa"),
        "results": results,
        "skipped": [{"impl": name, "reason": reason} for name, reason in skipped.items()],
        "machine": {**describe_machine(device, used_threads), "stream_gbs": stream_gbs, "stream_bytes": stream_bytes,
                    "last_level_cache_bytes": last_level_cache_bytes(), "matmul_gflops": fp32_gflops,
                    **register_rates},
    }


def _restore_arith(ctx: dict) -> None:
    """Back to the environment's arithmetic (PNMIX_ATTEND_ARITH) after the core rows set theirs."""
    if ctx.get("arith"):
        from pnmix.backends.core_ops import CoreOps

        CoreOps().set_arith("auto")


def _add_ratios(results: List[dict]) -> None:
    by_name = {r["impl"]: r for r in results}
    dense = [r for r in results if r["impl"] in SDPA_DTYPES]
    best = min(dense, key=lambda r: r["median_ms"]) if dense else None
    # the fastest dense peer of any kind: SDPA in any layout or ONNX Runtime's GQA on a dense cache
    peers = dense + [r for r in results if r["impl"] in ORT_DENSE]
    best_dense = min(peers, key=lambda r: r["median_ms"]) if peers else None
    for r in results:
        if best_dense is not None:
            r["best_dense"] = best_dense["impl"]
            r["speedup_vs_best_dense"] = best_dense["median_ms"] / r["median_ms"]
        for base in SDPA_DTYPES:
            if base in by_name:
                r[f"speedup_vs_{base}"] = by_name[base]["median_ms"] / r["median_ms"]
        if best is not None:
            r["best_sdpa"] = best["impl"]
            r["speedup_vs_best_sdpa"] = best["median_ms"] / r["median_ms"]


def _add_agreement(results: List[dict], outputs: Dict[str, torch.Tensor], ctx: dict) -> None:
    """max |out - reference| for the packed implementations (the reference is computed once if it
    was not timed and the cache is small enough), and vs dense fp32 SDPA for everyone."""
    want = outputs.get("reference")
    if want is None and ctx["context"] <= REFERENCE_AUTO_LIMIT and any(
            r["impl"] in PACKED_IMPLS for r in results):
        from pnmix import reference

        want = reference.attend(ctx["q"], ctx["layout"], ctx["state"], ctx["context"])
    dense = outputs.get("sdpa_fp32")
    for r in results:
        out = outputs[r["impl"]]
        if want is not None and r["impl"] in PACKED_IMPLS + ("reference",):
            r["max_abs_diff_vs_reference"] = float((out - want).abs().max())
        if dense is not None:
            r["max_abs_diff_vs_sdpa_fp32"] = float((out - dense).abs().max())


def _resolve_device(device: str) -> str:
    return resolve_device(device, allow_auto=True)


DECODE_COLUMNS = ("impl", "device", "median ms", "cpu ms", "cache MB", "read MB/step", "GB/s", "of stream",
                  "of fp32 peak", "vs sdpa_fp32", "vs best dense", "max|diff|")


def _row(r: dict) -> List[str]:
    mb = 1e6

    def ratio(key: str) -> str:
        return f"{r[key]:.2f}x" if key in r else "-"

    diff = r.get("max_abs_diff_vs_reference", r.get("max_abs_diff_vs_sdpa_fp32"))
    return [r["impl"], r["device"], f"{r['median_ms']:.3f}", f"{r['cpu_ms']:.3f}", f"{r['cache_bytes'] / mb:.2f}",
            f"{r['bytes_read'] / mb:.2f}", f"{r['gbs']:.2f}", optional_text(r.get("bandwidth_fraction"), ".0%"),
            optional_text(r.get("compute_fraction"), ".0%"), ratio("speedup_vs_sdpa_fp32"),
            ratio("speedup_vs_best_dense"), optional_text(diff, ".2g")]


def _notes(report: dict) -> List[str]:
    mb, machine = 1e6, report["machine"]
    notes = []
    best = next((r["best_dense"] for r in report["results"] if "best_dense" in r), None)
    if best:
        notes.append(f"best dense peer: {best}; max|diff| is vs the reference for the packed kernels, vs sdpa_fp32 "
                     f"for the others")
    probe = f" over {machine['stream_bytes'] / 2**20:.0f} MiB" if machine.get("stream_bytes") else ""
    cache = machine.get("last_level_cache_bytes")
    probe += f" (last-level cache {cache / 2**20:.0f} MiB)" if probe and cache else ""
    notes.append(f"streaming read bandwidth of this machine, {machine['threads']} threads{probe}: "
                 f"{machine['stream_gbs']:.1f} GB/s (\"of stream\" is each row's share of it)")
    if report["rounds"] > 1:
        spread = ", ".join(f"{r['impl']} {min(r['round_medians_ms']):.2f}-{max(r['round_medians_ms']):.2f}"
                           for r in report["results"])
        notes.append(f"median ms is the median of {report['rounds']} rounds (alternating order); round medians, "
                     f"fastest-slowest: {spread}")
    rate = machine["matmul_gflops"]
    floor_ms = decode_flops(report["batch"], report["q_heads"], report["context"], report["head_dim"]) / rate / 1e6
    notes.append(f"fp32 arithmetic rate (matrix product), same threads: {rate:.1f} GFLOP/s; a step's "
                 f"multiply-adds alone take {floor_ms:.2f} ms at that rate (\"of fp32 peak\" is each row's share of it)")
    fma, int8 = machine.get("fp32_fma_gflops"), machine.get("int8_madd_gops")
    if fma and int8:
        flops = decode_flops(report["batch"], report["q_heads"], report["context"], report["head_dim"])
        fma_isa, int8_isa = machine.get("fp32_fma_isa"), machine.get("int8_madd_isa")
        instruction = INT8_INSTRUCTION.get(int8_isa or "", "vpmaddubsw+vpaddw")
        notes.append(f"register rates, same threads: fp32 FMA ({fma_isa}) {fma:.1f} GFLOP/s, int8 {instruction} "
                     f"({int8_isa}) {int8:.1f} GOP/s ({int8 / fma:.2f}x); the step's multiply-adds take "
                     f"{flops / fma / 1e6:.2f} ms at the first and {flops / int8 / 1e6:.2f} ms at the second")
    if report.get("isa", "auto") != "auto":
        notes.append(f"libpnmix_core's kernel forced to {report['isa']} (--isa): the core rows and the register "
                     f"rates ran it")
    for r in report["results"]:
        if "arith" in r and r["impl"] == "core_int8":
            share = f", {r['int8_fraction']:.0%} of the int8 rate" if "int8_fraction" in r else ""
            if "int8_stream_ceiling" in r:
                share += (f"; with its multiply-adds at that rate a step reaches at most "
                          f"{r['int8_stream_ceiling']:.0%} of stream here")
            notes.append(f"core_int8 ran: {r['arith']} on the {r['isa']} kernel{share}")
    ratio = report["dense_fp16_bytes"] / report["packed_bytes"]
    notes.append(f"packed cache {report['packed_bytes'] / mb:.2f} MB vs fp16 {report['dense_fp16_bytes'] / mb:.2f} MB "
                 f"({ratio:.2f}x smaller); core kernel: {report['core_isa'] or '-'}; "
                 f"cache filled in {report['fill_seconds']:.1f} s; load average "
                 f"{', '.join(f'{x:.1f}' for x in machine['load_average'] or [])}")
    return notes + skipped_notes(report["skipped"], "impl")


def print_report(report: dict) -> None:
    title = (f"pnmix bench decode: {report['context']} tokens, batch {report['batch']}, {report['q_heads']} q heads / "
             f"{report['kv_heads']} kv heads, head dim {report['head_dim']}, {report['machine']['threads']} threads")
    print_table(title, DECODE_COLUMNS, map(_row, report["results"]), left=("impl", "device"), notes=_notes(report))


def decode_command(context: int, batch: int, q_heads: int, kv_heads: int, head_dim: int, threads: Optional[int],
                   device: str, impls: Optional[str], repeats: int, config: Optional[Path],
                   json_path: Optional[Path], rounds: int = 1, isa: Optional[str] = None) -> int:
    """The CLI's `pnmix bench decode` (pnmix/cli.py): print the table, write JSON, return 0."""
    from pnmix.manifest import load_manifest

    def run() -> dict:
        cfg = run_config(load_manifest(None), config).config
        return run_decode_bench(context, batch, q_heads, kv_heads, head_dim, threads, _resolve_device(device),
                                impls, repeats, cfg, rounds=rounds, isa=isa)

    run_report(json_path, run, print_report)
    return 0
