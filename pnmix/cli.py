"""The `pnmix` command line. One function per command; errors are one line and exit 2."""

from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, List, Optional

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
# reproduce
# ---------------------------------------------------------------------------------------


@app.command()
@one_line_errors
def reproduce(
    manifest: Optional[Path] = typer.Option(None, help="Manifest JSON (default: the bundled one)."),
    config: Optional[Path] = typer.Option(None, help="JSON of config fields laid over the manifest's."),
    seeds: Optional[str] = typer.Option(None, help="Comma-separated seeds (default: the manifest's)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
) -> None:
    """Run the diagnostic protocol with the PyTorch reference and compare with the manifest."""
    from .config import run_config
    from .manifest import compare, load_manifest
    from .protocol import aggregate, run_record
    from .verify import run_seeds

    if json_path is not None:
        from .io import check_output_path

        check_output_path(json_path)
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
    if json_path is not None:
        from .io import write_json_atomic

        write_json_atomic(json_path, {
            "method": "pn-mix",
            "passed": passed,
            "seeds": seed_list,
            "metrics": ours,
            "runs": records,
            "comparison": [{"metric": r.metric, "verdict": r.verdict} for r in rows],
        })
    console.print("[green]PASS[/]" if passed else "[bold red]FAIL[/]: see MISMATCH rows")
    raise typer.Exit(code=0 if passed else FAIL_EXIT)


# ---------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------


@app.command()
@one_line_errors
def verify(
    backend: Optional[str] = typer.Option(None, help="torch, core, triton or cuda."),
    onnx: Optional[Path] = typer.Option(None, help="Verify this ONNX file with ONNX Runtime."),
    engine: Optional[Path] = typer.Option(None, help="Verify this TensorRT engine (plan)."),
    plugins: Optional[Path] = typer.Option(None, help="The TensorRT plugin library, with --engine."),
    manifest: Optional[Path] = typer.Option(None, help="Manifest JSON (default: the bundled one)."),
    config: Optional[Path] = typer.Option(None, help="JSON of config fields laid over the manifest's."),
    seeds: Optional[str] = typer.Option(None, help="Comma-separated seeds (default: the manifest's)."),
    device: str = typer.Option("cpu", help="cpu or cuda (triton on cuda, engine always cuda)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
    model: Optional[str] = typer.Option(None, help="With --onnx or --engine: the LLM the file was exported from (HF folder, .gguf, packaged name)."),
    text: Optional[Path] = typer.Option(None, help="With --model: the text whose tokens are fed (default: the bundled one)."),
    prompt_tokens: int = typer.Option(32, help="With --model: prompt tokens (one prefill)."),
    decode_tokens: int = typer.Option(8, help="With --model: greedy decode steps checked."),
) -> None:
    """Run the protocol through one backend and compare it with the PyTorch reference."""
    from .config import run_config
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
        _call("pnmix.verify.llm", "verify_llm_command", onnx_path=onnx, model=model, text=text,
              prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, json_path=json_path, engine=engine,
              plugins=plugins)
    chosen = [name for name, given in (("backend", backend), ("onnx", onnx), ("engine", engine)) if given]
    if len(chosen) != 1:
        raise PnMixError("give exactly one of --backend NAME, --onnx MODEL or --engine PLAN")
    options: dict = {}
    if onnx is not None:
        name, options = "onnx", {"model": onnx}
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
    if json_path is not None:
        from .io import check_output_path

        check_output_path(json_path)
    data = load_manifest(manifest)
    run = run_config(data, config)
    report = run_verify(name, run, data, parse_seeds(seeds, data["seeds"]), device, **options)
    _print_verify(report)
    if json_path is not None:
        from .io import write_json_atomic

        write_json_atomic(json_path, report)
    raise typer.Exit(code=0 if report["passed"] else FAIL_EXIT)


def _print_verify(report: dict) -> None:
    table = Table(title=f"pnmix verify: backend {report['backend']} (tolerance {report['tolerance']:g})")
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


def _call(module: str, function: str, **kwargs: Any) -> None:
    """Import module lazily and run its command function; it returns the exit code."""
    import importlib

    code = getattr(importlib.import_module(module), function)(**kwargs)
    raise typer.Exit(code=int(code or 0))


@app.command()
@one_line_errors
def export(
    output: Path = typer.Option(..., "-o", "--output", help="The ONNX file to write."),
    config: Optional[Path] = typer.Option(None, help="JSON of config fields laid over the manifest's."),
    manifest: Optional[Path] = typer.Option(None, help="Manifest JSON (default: the bundled one)."),
    max_seq_len: int = typer.Option(defaults.EXPORT_MAX_SEQ_LEN, help="Cache capacity in tokens."),
    batch: int = typer.Option(defaults.EXPORT_BATCH, help="Batch size of the cache state."),
    opset: int = typer.Option(defaults.EXPORT_OPSET, help="ONNX default-domain opset."),
    seed: int = typer.Option(defaults.MODEL_SEED, help="Seed of the diagnostic model's weights."),
    model: Optional[str] = typer.Option(None, help="A Llama-family LLM (HF folder, .gguf file, packaged name) instead of the diagnostic model."),
    dtype: str = typer.Option("fp32", help="With --model: fp32 or fp16 weights."),
) -> None:
    """Export the diagnostic model, or with --model a whole LLM, with pn-mix custom ops to ONE ONNX file."""
    if model is not None:
        if (batch, opset, seed, manifest) != (defaults.EXPORT_BATCH, defaults.EXPORT_OPSET, defaults.MODEL_SEED, None):
            raise PnMixError("--batch, --opset, --seed and --manifest are options of the diagnostic model; "
                             "an LLM file (--model) has batch 1, opset 18 and the model's weights")
        _call("pnmix.export.llm", "export_llm_command", model=model, output=output,
              max_seq_len=max_seq_len, config=config, dtype=dtype)
    _call("pnmix.export.exporter", "export_command", output=output, config=config, manifest=manifest,
          max_seq_len=max_seq_len, batch=batch, opset=opset, seed=seed)


@app.command()
@one_line_errors
def generate(
    model: Path = typer.Argument(..., help="An LLM file from `pnmix export --model`."),
    tokenizer: str = typer.Option(..., help="The model whose tokenizer to use (HF folder, .gguf, packaged name)."),
    prompt: Optional[str] = typer.Option(None, help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="A UTF-8 file holding the prompt."),
    max_new_tokens: int = typer.Option(32, help="Tokens to generate (greedy)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: ONNX Runtime's)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the text and figures here."),
) -> None:
    """Greedy generation from an exported LLM file in ONNX Runtime with the packed cache."""
    _call("pnmix.generate", "generate_command", model=model, tokenizer=tokenizer, prompt=prompt,
          prompt_file=prompt_file, max_new_tokens=max_new_tokens, json_path=json_path, threads=threads)


@bench_app.command("decode")
@one_line_errors
def bench_decode(
    context: int = typer.Option(defaults.DECODE_CONTEXT, help="Tokens in the cache."),
    batch: int = typer.Option(defaults.DECODE_BATCH, help="Batch size."),
    q_heads: int = typer.Option(defaults.DECODE_Q_HEADS, help="Query heads."),
    kv_heads: int = typer.Option(defaults.DECODE_KV_HEADS, help="KV heads."),
    head_dim: int = typer.Option(defaults.DECODE_HEAD_DIM, help="Head dimension."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: all cores)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    impls: Optional[str] = typer.Option(None, help="Comma-separated implementations (default: all available)."),
    repeats: int = typer.Option(defaults.BENCH_REPEATS, help="Timed repetitions per implementation."),
    config: Optional[Path] = typer.Option(None, help="JSON of config fields laid over the manifest's."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    rounds: int = typer.Option(1, help="Time every implementation this many times, in alternating order "
                                       "(a shared machine's load bursts then fall on several); the median round counts."),
) -> None:
    """Median time per decode-attention step, cache bytes and bytes read, per implementation."""
    _call("pnmix.bench.decode", "decode_command", context=context, batch=batch, q_heads=q_heads,
          kv_heads=kv_heads, head_dim=head_dim, threads=threads, device=device, impls=impls,
          repeats=repeats, config=config, json_path=json_path, rounds=rounds)


@bench_app.command("generate")
@one_line_errors
def bench_generate(
    model: str = typer.Option("smollm2-135m", help="A Hugging Face folder, a .gguf file or a packaged model name."),
    contexts: str = typer.Option("1024,4096,8192", help="Comma-separated prompt lengths in tokens."),
    new_tokens: int = typer.Option(64, help="Timed decode steps per cache and context."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
) -> None:
    """Decode tokens/s and cache memory: DynamicCache, QuantizedCache (quanto 4-bit), PnMixCache."""
    _call("pnmix.bench.generate", "generate_command", model=model, contexts=contexts, new_tokens=new_tokens,
          threads=threads, json_path=json_path)


@bench_app.command("onnx")
@one_line_errors
def bench_onnx(
    max_seq_len: int = typer.Option(defaults.EXPORT_MAX_SEQ_LEN, help="Cache capacity of the exported model."),
    context: Optional[int] = typer.Option(None, help="Tokens in the cache when timing (default: max_seq_len - 1)."),
    repeats: int = typer.Option(defaults.BENCH_REPEATS, help="Timed decode steps."),
    model: Optional[str] = typer.Option(None, help="An exported diagnostic .onnx file (default: export one), or an LLM (HF folder, .gguf, packaged name)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    contexts: str = typer.Option("512,2048,4096", help="With an LLM: contexts to time at."),
    peer: str = typer.Option("auto", help="With an LLM: auto (build with onnxruntime-genai), none, or a builder output folder."),
    onnx: Optional[Path] = typer.Option(None, help="With an LLM: its file from `pnmix export --model` (default: export one)."),
) -> None:
    """Export time, file size and ONNX Runtime CPU time per decode step vs the PyTorch reference."""
    from .bench.onnx_llm import names_an_llm

    if model is not None and names_an_llm(model):
        _call("pnmix.bench.onnx_llm", "bench_llm_command", model=model, contexts=contexts, repeats=repeats,
              onnx_path=onnx, peer=peer, json_path=json_path)
    model = Path(model) if model is not None else None
    _call("pnmix.bench.onnx", "bench_command", max_seq_len=max_seq_len, context=context,
          repeats=repeats, model=model, json_path=json_path)


@app.command()
@one_line_errors
def doctor(json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report here.")) -> None:
    """List each backend as available or not, with the reason, and self-check the available ones."""
    _call("pnmix.doctor", "doctor_command", json_path=json_path)


@app.command("build-engine")
@one_line_errors
def build_engine(
    model: Path = typer.Argument(..., help="The exported ONNX file."),
    plugins: Path = typer.Option(..., help="libpnmix_trt_plugins.so"),
    output: Path = typer.Option(..., "-o", "--output", help="The engine (plan) to write."),
    max_seq_len: Optional[int] = typer.Option(None, help="Largest prefill in the optimization profile (default: the model's capacity)."),
) -> None:
    """Build a TensorRT engine from the exported ONNX file with the pn-mix plugins (strongly typed:
    the file's fp16 K/V and cache, INT8 codes, fp32 attention)."""
    _call("pnmix.backends.tensorrt.engine", "build_engine_command", model=model, plugins=plugins, output=output,
          max_seq_len=max_seq_len)


@app.command("eval")
@one_line_errors
def eval_model(
    model: Optional[str] = typer.Argument(None, help="A Hugging Face folder, a .gguf file, or smollm2-135m."),
    methods: Optional[str] = typer.Option(None, help="Comma list of methods (default: all); 'list' prints them."),
    config: Optional[Path] = typer.Option(None, help="JSON of pn-mix config fields: one more method, 'config'."),
    task: str = typer.Option("kl", help="kl, passkey, or kl,passkey."),
    contexts: str = typer.Option("1024", help="Comma list of prefill lengths P (task kl)."),
    decode_tokens: int = typer.Option(256, help="Teacher-forced decode steps D after each prefill (task kl)."),
    text: Optional[Path] = typer.Option(None, help="A UTF-8 text file (default: the bundled Hamlet)."),
    lengths: str = typer.Option("1024,2048,4096,8192", help="Comma list of passkey sequence lengths in tokens."),
    depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="Comma list of passkey depths in [0, 1]."),
    trials: int = typer.Option(5, help="Seeded pass keys per (length, depth) cell."),
    seed: int = typer.Option(0, help="Seed of the pass keys."),
    dtype: str = typer.Option("fp32", help="fp32, fp16 or bf16 model weights."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    plot: Optional[Path] = typer.Option(None, help="Draw the figures into this PNG (needs matplotlib)."),
) -> None:
    """KV-cache methods (pn-mix, KIVI, uniform, quanto) on a real model vs full precision: KL, perplexity, passkey."""
    _call("pnmix.hf.evaluate", "eval_command", model=model, methods=methods, config=config, task=task,
          contexts=contexts, decode_tokens=decode_tokens, text=text, lengths=lengths, depths=depths,
          trials=trials, seed=seed, dtype=dtype, json_path=json_path, plot=plot)


def main_entry() -> int:
    """The console-script entry point: the app without click's standalone handling, so that a
    usage error (unknown option, a value that is not an integer) is one `error:` line with exit 2
    instead of a usage box, a closed stdout (`pnmix reproduce | head -1`) does not change the
    exit code, and SIGTERM/SIGHUP end a command through its cleanup (no temporary files)."""
    import typer.core

    click = getattr(typer.core, "_click", None) or typer.core.click  # newer Typer vendors click
    for signum in ENDING_SIGNALS:
        signal.signal(signum, _raise_terminated)
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
    sys.stdout.flush()
    sys.stderr.flush()
    code = code if isinstance(code, int) else 0
    if code - SIGNAL_EXIT in ENDING_SIGNALS:
        # Cleaned up already; the interpreter's own teardown may meet a C extension that the
        # signal interrupted mid-import, so it is skipped, as the signal itself would have.
        os._exit(code)
    return code


def _raise_terminated(signum: int, frame: Any) -> None:
    if not _terminated:  # once: a second signal must not interrupt the clean-up of the first
        _terminated.append(signum)
        raise Terminated(signum)


_terminated: List[int] = []


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
