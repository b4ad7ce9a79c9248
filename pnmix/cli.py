"""The `pnmix` command line. One function per command; errors are one line and exit 2."""

from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Callable, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import defaults
from .errors import PnMixError, describe, parse_list
from .io import ENDING_SIGNALS, Terminated

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="pnmix: the pn-mix 2-bit packed KV cache on every backend.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")

# Piped output (CI logs, files) gets a width that fits the metric names instead of rich's 80.
console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
_debug = {"on": False}

ERROR_EXIT = 2
FAIL_EXIT = 1
SIGNAL_EXIT = 128  # + the signal's number, the shell's convention (SIGTERM: 143)


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show a traceback on errors.")) -> None:
    _debug["on"] = debug


def one_line_errors(fn: Callable) -> Callable:
    """Turn PnMixError (and any unexpected exception) into a one-line message and exit 2; a
    signal that ends the process (SIGTERM, SIGHUP: see main_entry) exits 128 + its number."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except PnMixError as exc:
            _fail(str(exc))
        except KeyboardInterrupt:
            _fail("interrupted")
        except Terminated as exc:
            _fail(f"terminated by {exc}", SIGNAL_EXIT + exc.signum)
        except Exception as exc:  # a bug or an environment problem: still one line
            _fail(describe(exc))

    return wrapper


def _fail(message: str, code: int = ERROR_EXIT) -> None:
    if _debug["on"]:
        traceback.print_exc()
    _print_error(message)
    raise typer.Exit(code=code)


def _print_error(message: str) -> None:
    from rich.markup import escape

    # escape: a message may hold brackets ("shape [batch=1, ...]") that rich would take as markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def parse_seeds(text: Optional[str], default: List[int]) -> List[int]:
    if text is None:
        return list(default)
    try:
        seeds = [int(part) for part in parse_list(text, "--seeds")]
    except ValueError:
        raise PnMixError(f"--seeds must be comma-separated integers, got {text!r}") from None
    from .model import SEED_RANGE

    bad = [seed for seed in seeds if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]]
    if bad:
        raise PnMixError(f"--seeds: {bad[0]} is outside {SEED_RANGE[0]}..{SEED_RANGE[1]} (a torch seed)")
    return seeds


def check_device(device: str) -> str:
    from .machine import resolve_device

    return resolve_device(device)


def _fmt(entry: Optional[dict]) -> str:
    if not entry:
        return "-"
    mean, std = entry["mean"], entry.get("std", 0.0)
    if isinstance(mean, int) or float(mean).is_integer() and abs(mean) > 1:
        return f"{mean:g}" if not std else f"{mean:g} ± {std:.3g}"
    return f"{mean:.6g} ± {std:.2g}"


def print_rows(rows, title: str) -> None:
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for column in ("manifest mean ± std", "ours mean ± std", "verdict"):
        table.add_column(column)
    styles = {"MISMATCH": "bold red", "better": "green", "exact": "green", "ok": "green"}
    for row in rows:
        style = styles.get(row.verdict, "")
        table.add_row(row.metric, _fmt(row.manifest), _fmt(row.ours),
                      f"[{style}]{row.verdict}[/]" if style else row.verdict)
    console.print(table)


# ---------------------------------------------------------------------------------------
# The options several commands share: one name, one type and one help text each
# ---------------------------------------------------------------------------------------

# What a MODEL may name, in every option that takes one (pnmix.hf.models.resolve_model).
MODEL_KINDS = "a Hugging Face folder, a .gguf file or a packaged name such as smollm2-135m"
JSON_HELP = "Write the results here, as JSON."

JsonOut = Annotated[Optional[Path], typer.Option("--json", help=JSON_HELP)]
ConfigFile = Annotated[Optional[Path], typer.Option("--config", help="JSON of config fields laid over the manifest's.")]
ManifestFile = Annotated[Optional[Path], typer.Option("--manifest", help="Manifest JSON (default: the bundled one).")]
Seeds = Annotated[Optional[str], typer.Option("--seeds", help="Comma-separated seeds (default: the manifest's).")]
Threads = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: the runtime's own choice).")]
MaxSeqLen = Annotated[int, typer.Option("--max-seq-len", help="Cache capacity of the exported model, in tokens.")]
Repeats = Annotated[int, typer.Option("--repeats", help="Timed repetitions (decode steps) per implementation.")]
Ops = Annotated[str, typer.Option("--ops", help="The pn-mix ops in ONNX Runtime: native (libpnmix_ort's kernels), "
                                                "functions (the file's standard-op bodies) or auto (native where the "
                                                "library loads).")]


def command(group: typer.Typer, name: Optional[str] = None) -> Callable[[Callable[..., int]], Callable[..., None]]:
    """Register a command of group. Every command has one shape: it imports the module that does
    its work inside the function (`pnmix --help` imports no torch), and returns the exit code;
    errors become one line (one_line_errors)."""

    def register(fn: Callable[..., int]) -> Callable[..., None]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> None:
            raise typer.Exit(code=int(fn(*args, **kwargs) or 0))

        return group.command(name)(one_line_errors(run))

    return register


# ---------------------------------------------------------------------------------------
# reproduce
# ---------------------------------------------------------------------------------------


@command(app)
def reproduce(
    manifest: ManifestFile = None,
    config: ConfigFile = None,
    seeds: Seeds = None,
    device: str = typer.Option("cpu", help="cpu or cuda."),
    json_path: JsonOut = None,
) -> int:
    """Run the diagnostic protocol with the PyTorch reference and compare with the manifest."""
    from .config import run_config
    from .io import JsonReport
    from .manifest import compare, load_manifest
    from .protocol import aggregate, run_record
    from .verify import run_seeds

    report_file = JsonReport(json_path)
    data = load_manifest(manifest)
    run = run_config(data, config)
    seed_list = parse_seeds(seeds, data["seeds"])
    results = run_seeds("torch", run, seed_list, check_device(device))
    ours = aggregate(results)
    records = [run_record(r, run) for r in results]
    rows = compare(data, run, ours, records)
    print_rows(rows, f"pn-mix reproduce: seeds {','.join(map(str, seed_list))}, device {device}")
    for r in results:
        console.print(f"seed {r.seed}: {r.runtime['elapsed_seconds']:.3f} s on {r.runtime['accelerator_model']}")
    passed = not any(row.failed for row in rows)
    report_file.write({
        "method": "pn-mix",
        "passed": passed,
        "seeds": seed_list,
        "metrics": ours,
        "runs": records,
        "comparison": [{"metric": r.metric, "verdict": r.verdict} for r in rows],
    })
    console.print("[green]PASS[/]" if passed else "[bold red]FAIL[/]: see MISMATCH rows")
    return 0 if passed else FAIL_EXIT


# ---------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------


@command(app)
def verify(
    backend: Optional[str] = typer.Option(None, help="torch, core, triton or cuda."),
    onnx: Optional[Path] = typer.Option(None, help="Verify this ONNX file with ONNX Runtime."),
    engine: Optional[Path] = typer.Option(None, help="Verify this TensorRT engine (plan)."),
    plugins: Optional[Path] = typer.Option(None, help="The TensorRT plugin library, with --engine."),
    manifest: ManifestFile = None,
    config: ConfigFile = None,
    seeds: Seeds = None,
    device: str = typer.Option("cpu", help="cpu or cuda (triton on cuda, engine always cuda)."),
    json_path: JsonOut = None,
    model: Optional[str] = typer.Option(None, help=f"With --onnx or --engine: the LLM the file was exported from ({MODEL_KINDS})."),
    text: Optional[Path] = typer.Option(None, help="With --model: the text whose tokens are fed (default: the bundled one)."),
    prompt_tokens: int = typer.Option(defaults.VERIFY_LLM_PROMPT_TOKENS, help="With --model: prompt tokens (one prefill)."),
    decode_tokens: int = typer.Option(defaults.VERIFY_LLM_DECODE_TOKENS, help="With --model: greedy decode steps checked."),
    ops: Ops = "auto",
) -> int:
    """Run the protocol through one backend and compare it with the PyTorch reference."""
    from .config import run_config
    from .io import JsonReport
    from .manifest import load_manifest
    from .verify import verify as run_verify

    if model is None and onnx is not None:
        from .export.llm_file import is_llm_file

        if is_llm_file(onnx):
            raise PnMixError(f"{onnx} is an LLM file (pnmix export --model): verify it with --model MODEL")
    if model is not None:
        if (onnx is None) == (engine is None) or backend:
            raise PnMixError("--model verifies an exported LLM file or its engine: give it with --onnx FILE or "
                             "--engine PLAN, not both")
        from .verify.llm import verify_llm_command

        return verify_llm_command(onnx_path=onnx, model=model, text=text, prompt_tokens=prompt_tokens,
                                  decode_tokens=decode_tokens, json_path=json_path, engine=engine, plugins=plugins,
                                  ops=ops)
    chosen = [name for name, given in (("backend", backend), ("onnx", onnx), ("engine", engine)) if given]
    if len(chosen) != 1:
        raise PnMixError("give exactly one of --backend NAME, --onnx MODEL or --engine PLAN")
    options: dict = {}
    if onnx is not None:
        from .backends.onnxruntime.session import resolve_ops

        name, options = "onnx", {"model": onnx, "ops": resolve_ops(ops)}
    elif engine is not None:
        name, options = "engine", {"plan": engine, "plugins": plugins}
        device = "cuda"
    else:
        name = backend or ""
        from .backends import OPS_BACKENDS

        if name not in OPS_BACKENDS:
            raise PnMixError(f"--backend must be one of {', '.join(OPS_BACKENDS)}, got {name!r}")
        if name == "cuda" and device == "cpu":
            device = "cuda"  # the CUDA kernels run on the GPU only
    if name != "engine":
        check_device(device)
    report_file = JsonReport(json_path)
    data = load_manifest(manifest)
    run = run_config(data, config)
    report = run_verify(name, run, data, parse_seeds(seeds, data["seeds"]), device, **options)
    _print_verify(report)
    report_file.write(report)
    return 0 if report["passed"] else FAIL_EXIT


def _print_verify(report: dict) -> None:
    ops = f", {report['ops']} pn-mix ops" if report.get("ops") else ""
    ops += f", {report['attend_arith']} attention" if report.get("attend_arith") else ""
    table = Table(title=f"pnmix verify: backend {report['backend']}{ops} (tolerance {report['tolerance']:g})")
    for column in ("seed", "max |diff| online", "max |diff| final", "packed bytes", "result"):
        table.add_column(column)
    for r in report["runs"]:
        table.add_row(str(r["seed"]), f"{r['max_abs_diff_online']:.3g}", f"{r['max_abs_diff_final']:.3g}",
                      "identical" if r["packed_bytes_identical"] else "[red]DIFFER[/]",
                      "[green]pass[/]" if r["passed"] else "[bold red]FAIL[/]")
    console.print(table)
    bad = [row for row in report["manifest"]["rows"] if row["verdict"] == "MISMATCH"]
    for row in bad:
        console.print(f"[bold red]manifest MISMATCH[/]: {row['metric']}")
    console.print("[green]PASS[/]" if report["passed"] else "[bold red]FAIL[/]")


# ---------------------------------------------------------------------------------------
# Commands whose work lives in their own modules (each module owns its command's body)
# ---------------------------------------------------------------------------------------


@command(app)
def export(
    output: Path = typer.Option(..., "-o", "--output", help="The ONNX file to write."),
    config: ConfigFile = None,
    manifest: ManifestFile = None,
    max_seq_len: MaxSeqLen = defaults.EXPORT_MAX_SEQ_LEN,
    batch: int = typer.Option(defaults.EXPORT_BATCH, help="Batch size of the cache state."),
    opset: Optional[int] = typer.Option(
        None, help=f"ONNX default-domain opset (default {defaults.EXPORT_OPSET}; with --model "
                   f"{defaults.LLM_EXPORT_OPSET}, where a prefill's attention is ONNX's Attention op)."),
    seed: int = typer.Option(defaults.MODEL_SEED, help="Seed of the diagnostic model's weights."),
    model: Optional[str] = typer.Option(None, help=f"A Llama-family LLM ({MODEL_KINDS}) instead of the diagnostic model."),
    dtype: str = typer.Option(defaults.LLM_EXPORT_DTYPE, help="With --model: fp32 or fp16 weights."),
) -> int:
    """Export the diagnostic model, or with --model a whole LLM, with pn-mix custom ops to ONE ONNX file."""
    if model is not None:
        if (batch, seed, manifest) != (defaults.EXPORT_BATCH, defaults.MODEL_SEED, None):
            raise PnMixError("--batch, --seed and --manifest are options of the diagnostic model; "
                             "an LLM file (--model) has batch 1 and the model's weights")
        from .export.llm import export_llm_command

        return export_llm_command(model=model, output=output, max_seq_len=max_seq_len, config=config, dtype=dtype,
                                  opset=defaults.LLM_EXPORT_OPSET if opset is None else opset)
    from .export.exporter import export_command

    return export_command(output=output, config=config, manifest=manifest, max_seq_len=max_seq_len, batch=batch,
                          opset=defaults.EXPORT_OPSET if opset is None else opset, seed=seed)


@command(app)
def generate(
    model: Path = typer.Argument(..., help="An LLM file from `pnmix export --model`."),
    tokenizer: str = typer.Option(..., help=f"The model whose tokenizer to use ({MODEL_KINDS})."),
    prompt: Optional[str] = typer.Option(None, help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="A UTF-8 file holding the prompt."),
    max_new_tokens: int = typer.Option(32, help="Tokens to generate (greedy)."),
    threads: Threads = None,
    json_path: JsonOut = None,
    ops: Ops = "auto",
) -> int:
    """Greedy generation from an exported LLM file in ONNX Runtime with the packed cache."""
    from .generate import generate_command

    return generate_command(model=model, tokenizer=tokenizer, prompt=prompt, prompt_file=prompt_file,
                            max_new_tokens=max_new_tokens, json_path=json_path, threads=threads, ops=ops)


@command(bench_app, "decode")
def bench_decode(
    context: int = typer.Option(defaults.DECODE_CONTEXT, help="Tokens in the cache."),
    batch: int = typer.Option(defaults.DECODE_BATCH, help="Batch size."),
    q_heads: int = typer.Option(defaults.DECODE_Q_HEADS, help="Query heads."),
    kv_heads: int = typer.Option(defaults.DECODE_KV_HEADS, help="KV heads."),
    head_dim: int = typer.Option(defaults.DECODE_HEAD_DIM, help="Head dimension."),
    threads: Threads = None,
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    impls: Optional[str] = typer.Option(None, help="Comma-separated implementations (default: all available)."),
    repeats: Repeats = defaults.BENCH_REPEATS,
    config: ConfigFile = None,
    json_path: JsonOut = None,
    rounds: int = typer.Option(1, help="Time every implementation this many times, in alternating order "
                                       "(a shared machine's load bursts then fall on several); the median round counts."),
    isa: Optional[str] = typer.Option(None, help="libpnmix_core's kernel for the core rows and the register rates: "
                                                 "auto, scalar, avx2, avx512, avx512vbmi or avx512vnni (default: the "
                                                 "CPU's best; avx2 on an AVX-512 CPU times what AVX2-only CPUs run)."),
) -> int:
    """Median time per decode-attention step, cache bytes and bytes read, per implementation."""
    from .bench.decode import decode_command

    return decode_command(context=context, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                          threads=threads, device=device, impls=impls, repeats=repeats, config=config,
                          json_path=json_path, rounds=rounds, isa=isa)


@command(bench_app, "generate")
def bench_generate(
    model: str = typer.Option("smollm2-135m", help=f"The LLM ({MODEL_KINDS})."),
    contexts: str = typer.Option("1024,4096,8192", help="Comma-separated prompt lengths in tokens."),
    new_tokens: int = typer.Option(64, help="Timed decode steps per cache and context."),
    threads: Threads = None,
    json_path: JsonOut = None,
) -> int:
    """Decode tokens/s and cache memory: DynamicCache, QuantizedCache (quanto 4-bit), PnMixCache."""
    from .bench.generate import generate_command as bench_generate_command

    return bench_generate_command(model=model, contexts=contexts, new_tokens=new_tokens, threads=threads,
                                  json_path=json_path)


@command(bench_app, "batch")
def bench_batch(
    model: str = typer.Option("smollm2-135m", help=f"The LLM ({MODEL_KINDS})."),
    lengths: str = typer.Option(",".join(map(str, defaults.BENCH_BATCH_LENGTHS)), help="Comma-separated prompt lengths: one row each."),
    new_tokens: int = typer.Option(32, help="Greedy tokens per row."),
    caches: str = typer.Option("dynamic,pnmix", help="Comma list of caches: dynamic (the control), pnmix."),
    threads: Threads = None,
    json_path: JsonOut = None,
) -> int:
    """A left-padded batch through generate: each row vs its prompt alone, batch vs batch-1 tokens/s."""
    from .bench.batch import batch_command

    return batch_command(model=model, lengths=lengths, new_tokens=new_tokens, caches=caches, threads=threads,
                         json_path=json_path)


@command(bench_app, "onnx")
def bench_onnx(
    max_seq_len: MaxSeqLen = defaults.EXPORT_MAX_SEQ_LEN,
    context: Optional[int] = typer.Option(None, help="Tokens in the cache when timing (default: max_seq_len - 1)."),
    repeats: Repeats = defaults.BENCH_REPEATS,
    model: Optional[str] = typer.Option(None, help=f"An exported diagnostic .onnx file (default: export one), or an LLM ({MODEL_KINDS})."),
    json_path: JsonOut = None,
    contexts: str = typer.Option(",".join(map(str, defaults.BENCH_LLM_CONTEXTS)), help="With an LLM: contexts to time at."),
    peer: str = typer.Option("auto", help="With an LLM: auto (build with onnxruntime-genai), none, or a builder output folder."),
    onnx: Optional[Path] = typer.Option(None, help="With an LLM: its file from `pnmix export --model` (default: export one)."),
    ops: Ops = "auto",
) -> int:
    """Export time, file size and ONNX Runtime CPU time per decode step vs the PyTorch reference."""
    from .bench.onnx_llm import names_an_llm

    if model is not None and names_an_llm(model):
        from .bench.onnx_llm import bench_llm_command

        return bench_llm_command(model=model, contexts=contexts, repeats=repeats, onnx_path=onnx, peer=peer,
                                 json_path=json_path, ops=ops)
    from .bench.onnx import bench_command

    return bench_command(max_seq_len=max_seq_len, context=context, repeats=repeats,
                         model=Path(model) if model is not None else None, json_path=json_path, ops=ops)


@command(app)
def doctor(json_path: JsonOut = None) -> int:
    """List each backend as available or not, with the reason, and self-check the available ones."""
    from .doctor import doctor_command

    return doctor_command(json_path=json_path)


@command(app, "build-engine")
def build_engine(
    model: Path = typer.Argument(..., help="The exported ONNX file."),
    plugins: Path = typer.Option(..., help="libpnmix_trt_plugins.so"),
    output: Path = typer.Option(..., "-o", "--output", help="The engine (plan) to write."),
    max_seq_len: Optional[int] = typer.Option(None, help="Largest prefill in the optimization profile (default: the model's capacity)."),
) -> int:
    """Build a TensorRT engine from the exported ONNX file with the pn-mix plugins (strongly typed:
    the file's fp16 K/V and cache, INT8 codes, fp32 attention)."""
    from .backends.tensorrt.engine import build_engine_command

    return build_engine_command(model=model, plugins=plugins, output=output, max_seq_len=max_seq_len)


@command(app, "eval")
def eval_model(
    model: Optional[str] = typer.Argument(None, help=f"The LLM ({MODEL_KINDS})."),
    methods: Optional[str] = typer.Option(None, help="Comma list of methods (default: all); 'list' prints them."),
    config: Optional[Path] = typer.Option(None, help="JSON of pn-mix config fields: one more method, 'config'."),
    task: str = typer.Option(defaults.EVAL_TASK, help="Comma list of kl, passkey, passkey-long (20-digit keys)."),
    contexts: str = typer.Option(",".join(map(str, defaults.EVAL_CONTEXTS)), help="Comma list of prefill lengths P (task kl)."),
    decode_tokens: int = typer.Option(defaults.EVAL_DECODE_TOKENS, help="Teacher-forced decode steps D after each prefill (task kl)."),
    text: Optional[Path] = typer.Option(None, help="A UTF-8 text file (default: the bundled Hamlet): task kl's text and the text haystack."),
    haystack: str = typer.Option(defaults.EVAL_HAYSTACK, help="The passkey haystack: classic (a filler sentence repeated) or text (--text or Hamlet)."),
    lengths: str = typer.Option(",".join(map(str, defaults.EVAL_LENGTHS)), help="Comma list of passkey sequence lengths in tokens."),
    depths: str = typer.Option(",".join(f"{d:g}" for d in defaults.EVAL_DEPTHS), help="Comma list of passkey depths in [0, 1]."),
    trials: int = typer.Option(defaults.EVAL_TRIALS, help="Seeded pass keys per (length, depth) cell."),
    seed: int = typer.Option(0, help="Seed of the pass keys."),
    dtype: str = typer.Option("fp32", help="fp32, fp16 or bf16 model weights."),
    json_path: JsonOut = None,
    plot: Optional[Path] = typer.Option(None, help="Draw the figures into this PNG (needs matplotlib)."),
    resume: Optional[Path] = typer.Option(None, help="An earlier --json report (it may be the --json file): "
                                                     "the pass keys it asked are not asked again."),
) -> int:
    """KV-cache methods (pn-mix, KIVI, uniform, quanto) on a real model vs full precision: KL, perplexity, passkey."""
    from .io import check_distinct_outputs

    check_distinct_outputs(json=json_path, plot=plot)  # one file for both: the PNG would replace the JSON
    from .hf.evaluate.command import eval_command

    return eval_command(model=model, methods=methods, config=config, task=task, contexts=contexts,
                        decode_tokens=decode_tokens, text=text, lengths=lengths, depths=depths, trials=trials,
                        seed=seed, dtype=dtype, json_path=json_path, plot=plot, haystack_name=haystack,
                        resume=resume)


@command(app)
def tune(
    model: str = typer.Argument(..., help=f"The LLM ({MODEL_KINDS})."),
    bits: float = typer.Option(..., help="The budget: bits per K/V element the cache may hold (measured bytes)."),
    context: int = typer.Option(defaults.TUNE_CONTEXT, help="Calibration prefill length P in tokens."),
    decode_tokens: int = typer.Option(defaults.TUNE_DECODE_TOKENS, help="Teacher-forced decode steps D after the prefill."),
    text: Optional[Path] = typer.Option(None, help="The calibration text, UTF-8 (default: the bundled Hamlet)."),
    budget_evals: int = typer.Option(defaults.TUNE_BUDGET_EVALS, help="Search budget: full candidate evaluations' "
                                                                       "worth of decode steps (presets besides)."),
    dtype: str = typer.Option(defaults.EVAL_DTYPE, help="fp32, fp16 or bf16 model weights."),
    json_path: JsonOut = None,
    config_out: Optional[Path] = typer.Option(None, help="Write the winning config here (the file `pnmix eval --config` takes)."),
    plot: Optional[Path] = typer.Option(None, help="Draw the Pareto front with the presets into this PNG (needs matplotlib)."),
) -> int:
    """The pn-mix config with the lowest KL vs full precision within a bits-per-element budget, on your model."""
    from .io import check_distinct_outputs

    check_distinct_outputs(json=json_path, config_out=config_out, plot=plot)
    from .hf.evaluate.tune import tune_command

    return tune_command(model=model, bits=bits, context=context, decode_tokens=decode_tokens, text=text,
                        budget_evals=budget_evals, dtype=dtype, json_path=json_path, config_out=config_out, plot=plot)


def main_entry() -> int:
    """The console-script entry point: the app without click's standalone handling, so that a
    usage error (unknown option, a value that is not an integer) is one `error:` line with exit 2
    instead of a usage box, a closed stdout (`pnmix reproduce | head -1`) does not change the
    exit code, and SIGTERM/SIGHUP end a command through its cleanup (no temporary files)."""
    import typer.core

    click: Any = getattr(typer.core, "_click", None)  # newer Typer vendors click
    if click is None:
        import click as installed_click

        click = installed_click
    for signum in ENDING_SIGNALS:
        signal.signal(signum, _raise_terminated)
    alarm = signal.signal(signal.SIGALRM, _deliver_pending) if hasattr(signal, "setitimer") else None
    unraisable_hook, sys.unraisablehook = sys.unraisablehook, _redeliver_swallowed
    sys.stdout, sys.stderr = PipeSafeStream(sys.stdout), PipeSafeStream(sys.stderr)
    try:
        code = app(standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
        code = ERROR_EXIT
    except click.exceptions.UsageError as exc:  # BadParameter, NoSuchOption, MissingParameter, ...
        where = f" (see: {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        _print_error(f"{exc.format_message()}{where}")
        code = exc.exit_code
    except typer.Abort:
        _print_error("aborted")
        code = ERROR_EXIT
    except Terminated as exc:  # outside a command (while parsing, importing)
        _print_error(f"terminated by {exc}")
        code = SIGNAL_EXIT + exc.signum
    except KeyboardInterrupt:
        _print_error("interrupted")
        code = ERROR_EXIT
    for signum in ENDING_SIGNALS:  # the work is done: a late signal ends the process as usual
        signal.signal(signum, signal.SIG_DFL)
    sys.unraisablehook = unraisable_hook
    if alarm is not None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
    if _pending and not _terminated:  # it came in the last import, after the command's own work
        _print_error(f"terminated by {signal.Signals(_pending[0]).name}")
        code = SIGNAL_EXIT + _pending[0]
    sys.stdout.flush()
    sys.stderr.flush()
    code = code if isinstance(code, int) else 0
    if code - SIGNAL_EXIT in ENDING_SIGNALS:
        # Cleaned up already; the interpreter's own teardown may meet a C extension that the
        # signal interrupted mid-import, so it is skipped, as the signal itself would have.
        os._exit(code)
    return code


def _raise_terminated(signum: int, frame: Any) -> None:
    if _terminated:  # once: a second signal must not interrupt the clean-up of the first
        return
    if _importing() and hasattr(signal, "setitimer"):
        # Raised inside a module's import, the exception can be swallowed by it (numpy's: the
        # command then ran on and exited 0) or leave it half made (the next import fails with an
        # unrelated error); raised inside a C extension's call back into Python, it can abort the
        # process. So it waits for the import to end: SIGALRM brings it back every 20 ms.
        _hold(signum)
        return
    _terminated.append(signum)
    raise Terminated(signum)


def _redeliver_swallowed(unraisable: Any) -> None:
    """sys.unraisablehook while a command runs. The signal's exception, raised where Python can only
    print and drop it (a weak reference's callback, such as the import system's module-lock clean-up,
    or a __del__), would let the command run on and exit 0: it is held and raised again by SIGALRM,
    as one that came during an import. Anything else goes to Python's own hook."""
    if isinstance(unraisable.exc_value, Terminated) and hasattr(signal, "setitimer"):
        _terminated.clear()
        _hold(unraisable.exc_value.signum)
        return
    sys.__unraisablehook__(unraisable)


def _hold(signum: int) -> None:
    """Keep the signal for _deliver_pending, which SIGALRM runs in 20 ms."""
    _pending[:] = [signum]
    signal.setitimer(signal.ITIMER_REAL, 0.02)


def _deliver_pending(_signum: int, frame: Any) -> None:
    if _pending:
        _raise_terminated(_pending[0], frame)


def _importing() -> bool:
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for module in list(sys.modules.values()))


_terminated: List[int] = []
_pending: List[int] = []


class PipeSafeStream:
    """stdout (or stderr) that a reader may close early (`| head -1`): the first broken-pipe write
    sends the rest of the output to /dev/null, and the command finishes (its --json, its exit
    code) as if the output had been read."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # the buffered rest goes there too, silently
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


if __name__ == "__main__":
    sys.exit(main_entry())
