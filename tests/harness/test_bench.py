"""`pnmix bench decode`: the report's shape, its byte accounting and its error handling (tiny sizes)."""

import json

import pytest
from typer.testing import CliRunner

from pnmix.bench import decode as bench
from pnmix._native import library_status
from pnmix.cli import app
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError
from pnmix.format import CacheLayout
from pnmix.machine import cpu_flags

SMALL = PnMixConfig(group_size=16, residual_size=32, sink_tokens=4, value_group_size=32)
CORE, CORE_REASON = library_status("pnmix_core")
HAS_AVX2 = {"avx2", "fma", "f16c"} <= cpu_flags()  # the avx2 kernel's needs


@pytest.fixture(scope="module")
def report():
    return bench.run_decode_bench(300, batch=2, q_heads=4, kv_heads=2, head_dim=32, threads=1, device="cpu",
                                  repeats=2, config=SMALL)


def test_every_cpu_impl_is_timed_with_its_bytes(report):
    names = [r["impl"] for r in report["results"]]
    assert names[:5] == ["sdpa_fp32", "sdpa_bf16", "sdpa_fp32_grouped", "sdpa_bf16_grouped", "reference"]
    assert ("core" in names) == CORE
    layout = CacheLayout(SMALL, 2, 2, 32, 300)
    packed = layout.persistent_bytes(300)["persistent_cache_bytes"]
    dense32 = 2 * 2 * 2 * 300 * 32 * 4
    by_name = {r["impl"]: r for r in report["results"]}
    assert by_name["sdpa_fp32"]["cache_bytes"] == by_name["sdpa_fp32"]["bytes_read"] == dense32
    assert by_name["sdpa_bf16"]["cache_bytes"] == by_name["sdpa_bf16_grouped"]["cache_bytes"] == dense32 // 2
    fastest = min((r for r in report["results"] if r["impl"].startswith("sdpa")), key=lambda r: r["median_ms"])
    assert all(r["best_sdpa"] == fastest["impl"] for r in report["results"])
    assert by_name["reference"]["cache_bytes"] == packed
    assert by_name["reference"]["bytes_read"] == packed + 2 * dense32
    for r in report["results"]:
        assert r["median_ms"] > 0 and r["repeats"] == 2
        assert r["gbps"] == pytest.approx(r["bytes_read"] / r["median_ms"] / 1e6)
        assert r["speedup_vs_sdpa_fp32"] == pytest.approx(by_name["sdpa_fp32"]["median_ms"] / r["median_ms"])
    assert report["packed_bytes"] == packed and report["dense_fp16_bytes"] == dense32 // 2
    assert report["machine"]["threads"] == 1 and report["machine"]["cpu_count"] >= 1


def test_grouped_sdpa_equals_gqa_sdpa(report):
    by_name = {r["impl"]: r for r in report["results"]}
    # both dense forms of the same attention: fp32 agree to rounding
    assert by_name["sdpa_fp32_grouped"]["max_abs_diff_vs_sdpa_fp32"] <= 1e-5


def test_bandwidth_fraction_is_each_rate_over_the_measured_stream_bandwidth(report):
    stream = report["machine"]["stream_gbs"]
    assert stream > 0
    for r in report["results"]:
        assert r["gbs"] == r["gbps"]
        assert r["bandwidth_fraction"] == pytest.approx(r["gbs"] / stream)
    fastest = min(report["results"], key=lambda r: r["median_ms"])
    dense = [r for r in report["results"] if r["impl"].startswith("sdpa") or r["impl"] in ("ort_gqa_fp32", "ort_gqa_fp16")]
    best = min(dense, key=lambda r: r["median_ms"])
    assert fastest["speedup_vs_best_dense"] == pytest.approx(best["median_ms"] / fastest["median_ms"])


def test_compute_fraction_is_each_rate_over_the_measured_fp32_rate(report):
    peak = report["machine"]["matmul_gflops"]
    assert peak > 0
    flops = 4 * 2 * 4 * 300 * 32  # a multiply-add for the score and one for the value: [B, Hq, N, D]
    for r in report["results"]:
        assert r["flops"] == flops  # the same arithmetic, however the cache is stored
        assert r["gflops"] == pytest.approx(flops / r["median_ms"] / 1e6)
        assert r["compute_fraction"] == pytest.approx(r["gflops"] / peak)


def test_the_fp32_rate_probe_restores_torch_threads():
    import torch

    before = torch.get_num_threads()
    rate = bench.matmul_gflops(1, n=64, runs=2)
    assert rate > 0 and torch.get_num_threads() == before
    assert bench.decode_flops(1, 32, 32768, 128) == 4 * 32 * 32768 * 128


def test_rounds_time_every_implementation_again_and_report_the_median_round():
    report = bench.run_decode_bench(96, q_heads=4, kv_heads=2, head_dim=32, threads=1, device="cpu", repeats=2,
                                    config=SMALL, impls="sdpa_fp32,sdpa_bf16,reference", rounds=3)
    assert report["rounds"] == 3
    for r in report["results"]:
        rounds = r["round_medians_ms"]
        assert len(rounds) == 3 and r["repeats"] == 3 * 2
        assert r["median_ms"] == pytest.approx(sorted(rounds)[1])
    with pytest.raises(PnMixError, match="--rounds must be 1..100"):
        bench.run_decode_bench(96, q_heads=4, kv_heads=2, head_dim=32, device="cpu", config=SMALL, rounds=0)


def test_onnx_runtime_peers_are_timed_or_skipped_with_their_cache_bytes(report):
    by_name = {r["impl"]: r for r in report["results"]}
    skipped = {s["impl"]: s["reason"] for s in report["skipped"]}
    elements = 2 * 2 * 2 * 300 * 32  # K and V, [B, H, N, D]
    want = {"ort_gqa_fp32": 4 * elements, "ort_gqa_fp16": 2 * elements,
            "ort_gqa_int8": elements + 8 * 2 * 32, "ort_gqa_int4": elements // 2 + 8 * 2 * 32,
            "ort_gqa_int8_tensor": elements + 8, "ort_gqa_int4_tensor": elements // 2 + 8}
    for name, size in want.items():
        assert (name in by_name) != (name in skipped), name
        if name in by_name:
            assert by_name[name]["cache_bytes"] == by_name[name]["bytes_read"] == size
    # the dense caches hold the same K/V as sdpa_fp32's: the same attention to rounding
    if "ort_gqa_fp32" in by_name:
        assert by_name["ort_gqa_fp32"]["max_abs_diff_vs_sdpa_fp32"] <= 1e-5
    if "ort_gqa_fp16" in by_name:
        assert by_name["ort_gqa_fp16"]["max_abs_diff_vs_sdpa_fp32"] <= 1e-2
    for name in ("ort_gqa_int8", "ort_gqa_int4"):  # quantized: close, not equal
        if name in by_name:
            assert by_name[name]["max_abs_diff_vs_sdpa_fp32"] <= 0.5


@pytest.mark.skipif(not CORE, reason=f"libpnmix_core not available: {CORE_REASON}")
def test_core_agrees_with_reference(report):
    core = next(r for r in report["results"] if r["impl"] == "core")
    assert core["cache_bytes"] == core["bytes_read"] == report["packed_bytes"]
    assert core["max_abs_diff_vs_reference"] <= 1e-3
    assert report["core_isa"] in ("scalar", "avx2", "avx512", "avx512vbmi") and core["isa"] == report["core_isa"]
    int8 = next((r for r in report["results"] if r["impl"] == "core_int8"), None)
    if int8 is not None:  # the integer path's own kernel, and the register rate of its instructions
        assert int8["isa"] in ("avx2", "avx512vnni")
        assert report["machine"]["int8_madd_isa"] == int8["isa"] and report["machine"]["int8_madd_gops"] > 0
        # a ceiling only where both halves ran the integer path (not this small layout's)
        assert ("int8_stream_ceiling" in int8) == (int8["arith"] == "int8") and int8["arith"] != "int8"


@pytest.mark.skipif(not CORE, reason=f"libpnmix_core not available: {CORE_REASON}")
def test_the_int8_stream_ceiling_is_reported_and_printed_where_both_halves_run_int8():
    # 16 query heads on one KV head: many products a byte, so the ceiling stays below 1 on most machines
    report = bench.run_decode_bench(1024, q_heads=16, kv_heads=1, head_dim=64, threads=1, device="cpu",
                                    impls="core_int8", repeats=2, config=PnMixConfig())
    (int8,) = report["results"]
    if int8.get("arith") != "int8":
        pytest.skip(f"the integer path does not run both halves here: {int8.get('arith')}")
    # stream time over product time at the int8 rate, from the row's own two shares
    ceiling = min(1.0, int8["bandwidth_fraction"] / int8["int8_fraction"])
    assert 0 < int8["int8_stream_ceiling"] <= 1 and int8["int8_stream_ceiling"] == pytest.approx(ceiling)
    assert any(f"a step reaches at most {ceiling:.0%} of stream here" in note for note in bench._notes(report))


def test_int8_stream_ceiling_is_stream_time_over_product_time():
    # 19.32 MB at 56.3 GB/s is 0.343 ms; 537 M operations at 922.9 GOP/s are 0.582 ms
    assert bench.int8_stream_ceiling(19_320_000, 56.3, 536_870_912, 922.9) == pytest.approx(0.5899, abs=1e-4)
    # bytes that take longer than the products: the stream itself is the limit
    assert bench.int8_stream_ceiling(19_320_000, 5.0, 536_870_912, 922.9) == 1.0


def test_gpu_impls_are_skipped_with_a_reason_on_cpu():
    out = bench.run_decode_bench(64, q_heads=2, kv_heads=1, head_dim=16, device="cpu", impls="sdpa_fp32,triton,cuda",
                                 repeats=1, config=SMALL)
    assert [r["impl"] for r in out["results"]] == ["sdpa_fp32"]
    reasons = {s["impl"]: s["reason"] for s in out["skipped"]}
    assert set(reasons) == {"triton", "cuda"} and all("GPU" in r for r in reasons.values())


def test_factory_import_failure_is_a_skip(monkeypatch):
    monkeypatch.setitem(bench.GPU_FACTORIES, "triton", "pnmix.no_such_module:bench_factory")
    with pytest.raises(bench.Skip, match="no_such_module"):
        bench.make_impl("triton", {"layout": CacheLayout(SMALL, 1, 1, 16, 64), "context": 64, "device": "cuda"})


def test_reference_is_skipped_automatically_on_long_contexts():
    names, skipped = bench._choose_impls(None, "cpu", bench.REFERENCE_AUTO_LIMIT + 1)
    assert "reference" not in names and "reference" in skipped
    names, _ = bench._choose_impls("reference,core", "cpu", bench.REFERENCE_AUTO_LIMIT + 1)
    assert names == ["reference", "core"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(impls="sdpa_fp33"), "unknown implementation 'sdpa_fp33'"),
    (dict(q_heads=3, kv_heads=2), "multiple of --kv-heads"),
    (dict(repeats=0), "--repeats"),
    (dict(threads=0), "--threads"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    args = dict(context=64, q_heads=4, kv_heads=2, head_dim=16, config=SMALL, device="cpu")
    args.update(kwargs)
    with pytest.raises(PnMixError, match=message):
        bench.run_decode_bench(**args)


@pytest.mark.skipif(not CORE, reason=f"libpnmix_core not available: {CORE_REASON}")
def test_isa_forces_the_core_rows_and_the_register_rates_then_lets_go():
    from pnmix.backends.core_ops import CoreOps

    if not HAS_AVX2:
        pytest.skip("this CPU has no AVX2/FMA/F16C for the avx2 kernel to run on")
    best = CoreOps().isa()
    report = bench.run_decode_bench(1024, q_heads=8, kv_heads=2, head_dim=64, threads=1, device="cpu",
                                    impls="core,core_int8", repeats=2, config=PnMixConfig(), isa="avx2")
    assert report["isa"] == "avx2" and report["core_isa"] == "avx2"
    assert {r["impl"]: r["isa"] for r in report["results"]} == {"core": "avx2", "core_int8": "avx2"}
    assert report["machine"]["int8_madd_isa"] == report["machine"]["fp32_fma_isa"] == "avx2"
    diff = {r["impl"]: r["max_abs_diff_vs_reference"] for r in report["results"]}
    assert diff["core"] <= 1e-4 and diff["core_int8"] <= 1e-2  # exact fp32; the integer path's rounding
    assert "forced to avx2 (--isa)" in " ".join(bench._notes(report))
    assert CoreOps().isa() == best  # the CPU's best kernel again after the run


@pytest.mark.skipif(not CORE, reason=f"libpnmix_core not available: {CORE_REASON}")
def test_an_unknown_isa_is_a_one_line_error_before_anything_runs():
    from pnmix.backends.core_ops import CoreOps

    best = CoreOps().isa()
    result = CliRunner().invoke(app, ["bench", "decode", "--context", "64", "--isa", "avx9", "--repeats", "1"])
    assert result.exit_code == 2 and "--isa avx9: " in result.output and "unknown kernel 'avx9'" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert CoreOps().isa() == best


def test_cli_prints_and_writes_json(tmp_path):
    out = tmp_path / "b.json"
    result = CliRunner().invoke(app, ["bench", "decode", "--context", "96", "--q-heads", "4", "--kv-heads", "2",
                                      "--head-dim", "32", "--repeats", "2", "--device", "cpu", "--impls",
                                      "sdpa_fp32,core" if CORE else "sdpa_fp32", "--rounds", "2",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"impl", "median_ms", "cache_bytes", "bytes_read", "gbps", "gbs", "bandwidth_fraction"} <= set(data["results"][0])
    assert data["machine"]["stream_gbs"] > 0 and data["machine"]["matmul_gflops"] > 0
    assert {"flops", "gflops", "compute_fraction"} <= set(data["results"][0])
    assert "fp32 arithmetic rate" in result.output and "of fp32 peak" in result.output
    assert data["rounds"] == 2 and "median of 2 rounds" in result.output
    assert "machine" in data and "pnmix bench decode" in result.output
    bad = CliRunner().invoke(app, ["bench", "decode", "--context", "0"])
    assert bad.exit_code == 2 and "--context" in bad.output


# ---- the shared timer (pnmix.bench.timing) ---------------------------------------------------


@pytest.fixture
def fake_clock(monkeypatch):
    """A clock that moves only when a timed function advances it: the samples are exact."""
    from pnmix.bench import timing

    now = [0.0]
    monkeypatch.setattr(timing, "_wall", lambda: now[0])
    monkeypatch.setattr(timing, "_cpu", lambda: now[0] / 2)  # two threads' worth of waiting
    return now


def _calls_taking(now, seconds):
    """A function whose n-th call takes seconds[n] on the fake clock; .calls counts them."""
    def fn():
        now[0] += seconds[fn.calls]
        fn.calls += 1
        return fn.calls

    fn.calls = 0
    return fn


def test_the_timer_leaves_the_warm_up_calls_out_and_reports_the_median(fake_clock):
    from pnmix.bench.timing import time_calls

    fn = _calls_taking(fake_clock, [100.0, 50.0, 3.0, 1.0, 2.0])
    timing, result = time_calls(fn, repeats=3, warmup=2)
    assert fn.calls == 5 and result == 5  # two warm-up calls, three timed; the last call's result
    assert timing.samples_s == (3.0, 1.0, 2.0) and timing.count == 3
    assert timing.median_s == 2.0 and timing.best_s == 1.0 and timing.total_s == 6.0
    assert timing.cpu_samples_s == (1.5, 0.5, 1.0) and timing.cpu_mean_s == 1.0
    assert timing.percentile_s(0) == 1.0 and timing.percentile_s(50) == 2.0


def test_cpu_time_is_the_mean_of_the_calls_so_a_helper_threads_work_counts():
    from pnmix.bench.timing import Timing

    # another thread's CPU time reaches the process clock at its scheduler ticks: here all in the
    # third call's sample, though each call had a third of it
    timing = Timing(samples_s=(1.0, 1.0, 1.0), cpu_samples_s=(1.0, 1.0, 4.0))
    assert timing.cpu_mean_s == 2.0 and timing.median_s == 1.0


def test_a_slow_first_warm_up_is_the_only_one_and_caps_the_repeats(fake_clock):
    from pnmix.bench.timing import time_calls

    fn = _calls_taking(fake_clock, [5.0] * 10)
    timing, _ = time_calls(fn, repeats=8, warmup=2, slow_s=1.0, slow_repeats=3)
    assert fn.calls == 1 + 3 and timing.samples_s == (5.0, 5.0, 5.0)
    fast = _calls_taking(fake_clock, [0.5] * 10)
    assert time_calls(fast, repeats=8, warmup=2, slow_s=1.0)[0].count == 8 and fast.calls == 10


def test_best_seconds_is_the_fastest_timed_call(fake_clock):
    from pnmix.bench.timing import best_seconds

    assert best_seconds(_calls_taking(fake_clock, [0.1, 9.0, 4.0, 6.0]), runs=3) == 4.0


def test_rounds_take_the_calls_in_turn_after_untimed_warm_up_rounds(fake_clock):
    from pnmix.bench.timing import round_order, time_interleaved

    log = []

    def call(name, seconds):
        def fn():
            log.append(name)
            fake_clock[0] += seconds
        return fn

    timings = time_interleaved([call("a", 1.0), call("b", 2.0)], rounds=3, per_round=2, warmup_rounds=1,
                               before=[lambda: log.append("restore a"), lambda: log.append("restore b")])
    one_round = ["restore a", "a", "restore a", "a", "restore b", "b", "restore b", "b"]
    assert log == one_round * 4  # a warm-up round, then three timed ones
    assert [t.samples_s for t in timings] == [(1.0,) * 6, (2.0,) * 6]
    assert list(round_order(["x", "y", "z"], 3, alternate=True)) == ["x", "y", "z", "z", "y", "x", "x", "y", "z"]
    assert list(round_order(["x", "y"], 2)) == ["x", "y", "x", "y"]


def test_the_bandwidth_probe_outgrows_the_last_level_cache(monkeypatch, tmp_path):
    """The probe's buffer is 4x the largest cache sysfs lists (a 256 MiB buffer half-fitted a 480 MiB
    L3 and read 20% under the memory's rate), within its floor and ceiling."""
    from pnmix import machine

    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")  # not a cache entry: skipped
    assert machine.last_level_cache_bytes(str(tmp_path)) == 480 << 20
    assert machine.last_level_cache_bytes(str(tmp_path / "missing")) is None
    assert [machine.parse_cache_size(t) for t in ("32M", "1G", "512", "x", "")] == [32 << 20, 1 << 30, 512, None, None]
    for cache, probe in ((480 << 20, 1920 << 20), (32 << 20, 256 << 20), (None, 256 << 20), (8 << 30, 4 << 30)):
        monkeypatch.setattr(bench, "last_level_cache_bytes", lambda cache=cache: cache)
        assert bench.stream_probe_bytes() == probe
