"""Files from elsewhere and outputs, second round (docs/HARDENING.md sections 1 and 2): special files
where a file is expected, unbounded reads, JSON that defeats the parser or the types, sizes that
cannot fit, signals during a write, long output names, output modes, exit codes and option parsing,
sparse ONNX tensors with external data.

Command-line cases run the real entry point in fresh processes (`python -m pnmix`), each with a
timeout: a command that hangs on a FIFO fails the test in seconds instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pnmix import io
from pnmix.config import PnMixConfig
from pnmix.errors import PnMixError, one_line
from pnmix.manifest import bundled_path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120  # seconds for one fresh process (importing torch on a busy machine included)
SENTINEL = b"an earlier result that a failing run must leave alone\n"
SMALL_RUN = {"prefill_tokens": 40, "decode_tokens": 4, "group_size": 8, "residual_size": 16, "sink_tokens": 4}
SMALL_CONFIG = PnMixConfig(group_size=8, residual_size=16, sink_tokens=4)
ENV = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="80", HF_HUB_OFFLINE="1")


def start(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pnmix", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=kwargs.pop("cwd", REPO), **kwargs)


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError(f"{process.args[3:]} did not finish within {TIMEOUT} s (a hang)") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_all(cases, at_once: int = 3):
    """Run the cases' processes a few at a time (they mostly wait on imports) and collect them."""
    done = []
    for first in range(0, len(cases), at_once):
        running = [start(args) for args, _ in cases[first:first + at_once]]
        done += [finish(process) for process in running]
    return done


def assert_one_error_line(done: subprocess.CompletedProcess, words, code: int = 2) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, (done.args[3:], done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "\x1b[" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert not lines[0].startswith(("error: RecursionError", "error: ValueError", "error: OverflowError")), lines[0]
    for word in words:
        assert word.lower() in lines[0].lower(), (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    """A FIFO, links to /dev/zero and to a FIFO, a folder, a manifest, a plan beside a FIFO sidecar."""
    root = tmp_path_factory.mktemp("special")
    fifo = root / "fifo.json"
    os.mkfifo(fifo)
    (root / "zero.json").symlink_to("/dev/zero")
    (root / "fifo-link.json").symlink_to(fifo)
    (root / "folder").mkdir()
    plan = root / "engine.plan"
    plan.write_bytes(b"not a plan")
    os.mkfifo(root / "engine.plan.json")
    small = root / "small.json"
    small.write_text(json.dumps(SMALL_RUN))
    return {"root": root, "fifo": fifo, "zero": root / "zero.json", "fifo_link": root / "fifo-link.json",
            "folder": root / "folder", "plan": plan, "small": small}


# ---------------------------------------------------------------------------------------
# 1. Special files where a file is expected: refused before they are opened for reading
# ---------------------------------------------------------------------------------------


@pytest.fixture
def alarm():
    """In-process cases: SIGALRM fails the test after 60 s instead of letting a hang stall the suite."""
    def expired(signum, frame):
        raise AssertionError("the command did not finish within 60 s (a hang)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def special_cases(special):
    cases = []
    for kind in ("fifo", "zero", "fifo_link", "folder"):
        path = special[kind]
        words = ["directory"] if kind == "folder" else ["not a regular file"]
        cases += [
            (["reproduce", "--config", path], words),
            (["reproduce", "--manifest", path], words),
            (["verify", "--backend", "torch", "--config", path], words),
            (["export", "-o", special["root"] / "m.onnx", "--config", path], words),
            (["verify", "--onnx", path], words),
            # a folder given as --model names an LLM's Hugging Face folder (export --model's MODEL)
            (["bench", "onnx", "--model", path], ["config.json"] if kind == "folder" else words),
            (["bench", "decode", "--config", path, "--context", "64"], words),
            (["generate", path, "--tokenizer", path, "--prompt", "x"], words),
        ]
    cases += [(["verify", "--engine", special["plan"], "--plugins", special["plan"]], ["engine description", "FIFO"])]
    return cases


def test_special_files_are_refused_by_every_command(special, alarm):
    from pnmix.cli import app

    for args, words in special_cases(special):
        result = CliRunner().invoke(app, list(map(str, args)))
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)
        for word in words:
            assert word in lines[0], (args, lines[0])
    assert not (special["root"] / "m.onnx").exists()


@pytest.mark.slow  # a fresh process per case
def test_special_files_in_fresh_processes_end_within_seconds(special):
    cases = [
        (["reproduce", "--config", special["fifo"]], ["FIFO", "fifo.json"]),
        (["verify", "--backend", "torch", "--manifest", special["zero"]], ["character device", "zero.json"]),
        (["export", "-o", special["root"] / "m.onnx", "--config", special["fifo_link"]], ["FIFO", "fifo-link.json"]),
        (["verify", "--onnx", "/dev/zero"], ["character device"]),
        (["verify", "--engine", special["plan"], "--plugins", special["plan"]], ["engine description", "FIFO"]),
    ]
    for (_args, words), done in zip(cases, run_all(cases)):
        assert_one_error_line(done, words)


def test_the_reader_refuses_special_files_and_names_the_limit(special, tmp_path):
    for kind, words in (("fifo", "a FIFO"), ("zero", "a character device"), ("fifo_link", "a FIFO"),
                        ("folder", "directory")):
        with pytest.raises(PnMixError, match=words):
            io.read_input(special[kind], "config", 1 << 20)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 11)
    with pytest.raises(PnMixError, match="more than the limit of 10 bytes"):
        io.read_input(big, "config", 10)
    assert io.read_input(big, "config", 11) == b" " * 11
    with pytest.raises(PnMixError, match="plugin library path is not a regular file"):
        io.check_input_file(special["fifo"], "plugin library")


@pytest.mark.slow  # a fresh process
def test_a_json_input_beyond_the_size_limit_is_refused_before_it_is_read(tmp_path):
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: no disk space used
        f.truncate(io.JSON_LIMIT + 1)
    done = finish(start(["reproduce", "--config", huge]))
    assert_one_error_line(done, ["huge.json", f"limit of {io.JSON_LIMIT} bytes"])


def test_eval_text_and_model_files_that_are_fifos_are_refused(special, tmp_path):
    from pnmix.dataset import text_or_hamlet
    from pnmix.hf.models import resolve_model

    with pytest.raises(PnMixError, match="text path is not a regular file"):
        text_or_hamlet(special["fifo"])
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    with pytest.raises(PnMixError, match="model path is not a regular file .*config.json"):
        resolve_model(model)
    (model / "config.json").unlink()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(PnMixError, match="model path is not a regular file .*model.safetensors"):
        resolve_model(model)
    with pytest.raises(PnMixError, match="neither a folder nor a regular file"):
        resolve_model(special["fifo_link"])


# ---------------------------------------------------------------------------------------
# 2. JSON that defeats the parser or the types: one line, never the last-resort handler
# ---------------------------------------------------------------------------------------


def _manifest_with(**changes) -> str:
    data = json.loads(bundled_path().read_text())
    data.update(changes)
    return json.dumps(data)


JSON_CASES = [
    ("nested-list", "[" * 100_000 + "]" * 100_000, "config", ["nested more than 100 levels"]),
    ("nested-object", '{"a": ' * 5000 + "1" + "}" * 5000, "config", ["nested more than 100 levels"]),
    ("nested-just-too-deep", '{"group_size": ' + "[" * 100 + "]" * 100 + "}", "config", ["nested"]),
    ("digits-5000", '{"group_size": ' + "9" * 5000 + "}", "config", ["5000 digits"]),
    ("digits-101", '{"sink_tokens": -' + "9" * 101 + "}", "config", ["101 digits"]),
    ("prefill-2^70", json.dumps({"prefill_tokens": 2**70}), "config", ["prefill_tokens"]),
    ("decode-2^64", json.dumps({"decode_tokens": 2**64}), "config", ["decode_tokens"]),
    ("sink-2^70", json.dumps({"sink_tokens": 2**70}), "config", ["sink_tokens"]),
    ("seed-2^70", _manifest_with(seeds=[2**70]), "manifest", ["seed", "outside"]),
    ("seed--2^70", _manifest_with(seeds=[42, -(2**70)]), "manifest", ["seed", "outside"]),
    ("manifest-nested", "[" * 3000 + "]" * 3000, "manifest", ["nested"]),
    ("manifest-digits", _manifest_with(seeds=[int("9" * 200)]), "manifest", ["200 digits"]),
]


@pytest.mark.parametrize("name, text, option, words", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_json_that_defeats_the_parser_or_the_types_is_one_line(tmp_path, name, text, option, words):
    path = tmp_path / f"{name}.json"
    path.write_text(text)
    result = CliRunner().invoke(__import__("pnmix.cli", fromlist=["app"]).app,
                                ["reproduce", f"--{option}", str(path), "--seeds", "42"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert not lines[0].startswith(("error: RecursionError", "error: ValueError", "error: OverflowError"))
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.slow  # a fresh process per case
def test_json_cases_in_fresh_processes(tmp_path):
    """The same refusals through the installed entry point, for the cases that broke it before."""
    cases = []
    for name, text, option, words in (JSON_CASES[0], JSON_CASES[3], JSON_CASES[8]):
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        cases.append((["reproduce", f"--{option}", path], words))
    for (_args, words), done in zip(cases, run_all(cases)):
        assert_one_error_line(done, words)


def test_engine_description_json_goes_through_the_same_parser(tmp_path):
    from pnmix.backends.tensorrt import engine as trt

    plan = tmp_path / "e.plan"
    plan.write_bytes(b"junk")
    for text, words in (("[" * 5000 + "]" * 5000, "nested"), ('{"seed": ' + "1" * 400 + "}", "400 digits")):
        trt.sidecar_path(plan).write_text(text)
        with pytest.raises(PnMixError, match=words):
            trt.read_sidecar(plan)


# ---------------------------------------------------------------------------------------
# 3. Memory before allocation, on every path
# ---------------------------------------------------------------------------------------


def test_protocol_lengths_that_cannot_fit_are_refused_before_the_run(tmp_path, monkeypatch):
    from pnmix import memory
    from pnmix.cli import app
    from pnmix.config import RunConfig
    from pnmix.protocol import protocol_bytes

    need = protocol_bytes(RunConfig(PnMixConfig(), 40_000, 64))
    assert need > 4 * 40_000**2 * 4  # the prefill's scores alone, per query head, are 6.4 GB
    monkeypatch.setattr(memory, "available_bytes", lambda: need - 1)
    config = tmp_path / "long.json"
    config.write_text('{"prefill_tokens": 40000}')
    for command in (["reproduce"], ["verify", "--backend", "torch"]):
        result = CliRunner().invoke(app, [*command, "--config", str(config), "--seeds", "42"])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert "prefill_tokens 40000" in lines[0] and "available" in lines[0], lines[0]


def test_every_cache_allocation_is_checked_first(monkeypatch):
    from pnmix import memory
    from pnmix.cache import PackedKVCache
    from pnmix.format import CacheLayout

    layout = CacheLayout(SMALL_CONFIG, 1, 2, 32, 4096)
    monkeypatch.setattr(memory, "available_bytes", lambda: layout.state_bytes - 1)
    with pytest.raises(PnMixError, match="the cache state .*max_seq_len 4096.* available"):
        PackedKVCache(SMALL_CONFIG, 2, 32, 4096)
    with pytest.raises(PnMixError, match="no allocation|needs about"):
        memory.check_fits(1 << 60, "a size", "hint")  # beyond any address space: refused everywhere


def _with_capacity(data: bytes, capacity: int, path: Path) -> Path:
    """The export, its metadata and state inputs rewritten to claim `capacity` tokens."""
    import onnx

    from pnmix.export.tracing import META_PREFIX
    from pnmix.format import CacheLayout
    from pnmix.model import HEAD_DIM, KV_HEADS

    model = onnx.ModelProto()
    model.ParseFromString(data)
    for prop in model.metadata_props:
        if prop.key == META_PREFIX + "max_seq_len":
            prop.value = str(capacity)
    shapes = CacheLayout(SMALL_CONFIG, 1, KV_HEADS, HEAD_DIM, capacity).state_shapes()
    for value in model.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name]):
                dim.dim_value = size
    path.write_bytes(model.SerializeToString())
    return path


def test_an_onnx_file_asking_for_terabytes_of_state_is_refused_before_onnxruntime(small_onnx_bytes, tmp_path):
    from pnmix.cli import app

    path = _with_capacity(small_onnx_bytes, 1 << 36, tmp_path / "greedy.onnx")
    assert path.stat().st_size < 2 * len(small_onnx_bytes)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(SMALL_RUN))
    for args in (["verify", "--onnx", path, "--config", config, "--seeds", "42"],
                 ["bench", "onnx", "--model", path, "--repeats", "1", "--context", "8"]):
        result = CliRunner().invoke(app, list(map(str, args)))
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert "TB of memory" in lines[0] and "available" in lines[0], lines[0]


def test_onnxruntime_errors_inside_a_run_are_one_line(small_onnx_bytes, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    from pnmix.backends.onnxruntime.backend import OnnxBackend
    from pnmix.dataset import protocol_tokens

    path = tmp_path / "m.onnx"
    path.write_bytes(small_onnx_bytes)
    backend = OnnxBackend(SMALL_CONFIG, 42, 64, model=path)

    class Failing:
        def run(self, *args):
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code\n"
                               "returned while running PnMixAppend node. " + "x" * 2000 + " the reason")

    monkeypatch.setattr(backend, "session", Failing())
    with pytest.raises(PnMixError) as info:
        backend.step(protocol_tokens(4), 0, write=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith("ONNX Runtime failed running")
    assert message.endswith("the reason")  # a long message loses its middle, not its reason
    assert backend.seq_len == 0


def test_the_onnx_backend_loads_states_as_import_state_does(small_onnx_bytes, tmp_path):
    """OnnxBackend.load_state shares import_state's checks (format.checked_state)."""
    pytest.importorskip("onnxruntime")
    import torch

    from pnmix.backends.onnxruntime.backend import OnnxBackend
    from pnmix.cache import PackedKVCache
    from pnmix.model import HEAD_DIM, KV_HEADS
    from pnmix.testing import make_random_kv

    path = tmp_path / "m.onnx"
    path.write_bytes(small_onnx_bytes)
    backend = OnnxBackend(SMALL_CONFIG, 42, 64, model=path)
    cache = PackedKVCache(SMALL_CONFIG, KV_HEADS, HEAD_DIM, 64)
    cache.append(*make_random_kv(1, KV_HEADS, 30, HEAD_DIM))
    good = cache.export_state()
    nan_step = good["key_step"].clone()
    nan_step[0, 0, 0, 0] = float("nan")
    before = {name: array.copy() for name, array in backend._state.items()}
    for tensors, seq_len, words in ((good, 1.5, "integer"), (good, True, "integer"),
                                    ({**good, "sink_k": good["sink_k"].view(torch.bfloat16)}, 30, "bfloat16"),
                                    ({**good, "key_step": nan_step}, 30, "NaN or Inf")):
        with pytest.raises(PnMixError, match=words):
            backend.load_state(tensors, seq_len)
        assert backend.seq_len == 0 and all((backend._state[n] == before[n]).all() for n in before)
    backend.load_state(good, 30)
    assert backend.seq_len == 30


@pytest.mark.slow  # fresh processes that start ONNX Runtime
def test_onnxruntime_writes_no_coloured_log_lines(small_onnx_bytes, tmp_path):
    """A verify through ONNX Runtime in a fresh process: stderr holds no ANSI escapes."""
    pytest.importorskip("onnxruntime")
    path = tmp_path / "m.onnx"
    path.write_bytes(small_onnx_bytes)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(SMALL_RUN))
    done = finish(start(["verify", "--onnx", path, "--config", config, "--seeds", "42"]))
    assert done.returncode == 0, done.stderr
    assert "\x1b[" not in done.stderr and done.stderr.strip() == "", done.stderr


# ---------------------------------------------------------------------------------------
# 4. Signals during a write: no temporary file, no partial output, the old output survives
# ---------------------------------------------------------------------------------------

SIGNAL_DURING_WRITE = textwrap.dedent("""
    import os, signal, sys
    from pnmix import io
    real_write, signum = os.write, getattr(signal, sys.argv[1])
    signal.signal(signum, signal.SIG_DFL)  # as a shell leaves it: ignored (nohup) the test would not test
    output = sys.argv[3] if sys.argv[2] == "api" else next(
        arg for flag, arg in zip(sys.argv, sys.argv[1:]) if flag in ("-o", "--json"))
    folder = os.path.dirname(os.path.abspath(output))
    signalled = []
    def write(fd, data):  # once: half the bytes, then the signal, as if it came mid-write
        if signalled or os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) != folder:
            # after the signal, or not the output (torch writes files of its own while exporting):
            # the real write, so that a signal pnmix failed to act on ends in a finished write
            # (and a failed assertion), never in a loop of signals and half writes
            return real_write(fd, data)
        signalled.append(fd)
        half = max(1, len(data) // 2)
        written = real_write(fd, bytes(data[:half]))
        os.kill(os.getpid(), signum)
        return written
    io.os.write = write
    if sys.argv[2] == "api":
        io.write_bytes_atomic(sys.argv[3], b"new bytes" * 1000)
        print("survived")
    else:
        from pnmix.cli import main_entry
        sys.argv = ["pnmix", *sys.argv[3:]]
        sys.exit(main_entry())
""")


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("via", [pytest.param("cli-export", marks=pytest.mark.slow),  # a fresh CLI process
                                 pytest.param("cli-reproduce", marks=pytest.mark.slow), "api"])
def test_a_signal_during_a_write_leaves_no_temporary_and_the_old_output(tmp_path, signame, via):
    if via == "cli-export":
        pytest.importorskip("pnmix.export.exporter")
    target = tmp_path / ("out.onnx" if via == "cli-export" else "out.json")
    target.write_bytes(SENTINEL)
    target.chmod(0o640)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(SMALL_RUN))
    args = {"api": ["api", target],
            "cli-export": ["cli", "export", "-o", target, "--config", config, "--max-seq-len", "64"],
            "cli-reproduce": ["cli", "reproduce", "--config", config, "--seeds", "42", "--json", target]}[via]
    done = finish(subprocess.Popen([sys.executable, "-c", SIGNAL_DURING_WRITE, signame, *map(str, args)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV))
    signum = getattr(signal, signame)
    if via == "api":  # no handler of pnmix's: the process ends by the signal, after the cleanup
        assert done.returncode == -signum and "survived" not in done.stdout, (done.returncode, done.stderr)
    else:
        assert done.returncode == 128 + signum, (done.returncode, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert lines == [f"error: terminated by {signame}"], done.stderr
    assert target.read_bytes() == SENTINEL and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.json", target.name])


def _catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])  # the run itself takes seconds
def test_a_signal_at_any_point_of_a_command_is_one_line_and_leaves_nothing(tmp_path, delay):
    """SIGTERM as soon as the entry point catches it (while Typer parses, while the command imports
    and runs): `error: terminated by SIGTERM`, exit 143, the old output as it was."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to see when the entry point catches SIGTERM")
    import time

    target = tmp_path / "out.json"
    target.write_bytes(SENTINEL)
    process = start(["reproduce", "--seeds", "42,43,44", "--json", target])
    began = time.monotonic()
    while not _catches_sigterm(process.pid):
        assert process.poll() is None and time.monotonic() - began < TIMEOUT, "the entry point never catches SIGTERM"
        time.sleep(0.005)
    time.sleep(delay)
    process.send_signal(signal.SIGTERM)
    done = finish(process)
    assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stderr)
    assert [line for line in done.stderr.splitlines() if line.strip()] == ["error: terminated by SIGTERM"]
    assert target.read_bytes() == SENTINEL and [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.fixture
def held_signals(monkeypatch):
    """The entry point's signal state, fresh, and SIGALRM ignored: the retry timer is checked, not
    run; both put back afterwards."""
    from pnmix import cli

    monkeypatch.setattr(cli, "_terminated", [])
    monkeypatch.setattr(cli, "_pending", [])
    old = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_a_signal_during_an_import_waits_for_the_import_to_end(monkeypatch, held_signals):
    """SIGTERM inside a module's import is held (an exception raised there was swallowed by
    numpy's import, and the command ran on to exit 0) and delivered by SIGALRM once no import is
    in progress."""
    import types

    from pnmix import cli
    from pnmix.io import Terminated

    spec = types.SimpleNamespace(_initializing=True)
    monkeypatch.setitem(sys.modules, "half_imported", types.SimpleNamespace(__spec__=spec))
    cli._raise_terminated(signal.SIGTERM, None)  # held: no exception
    assert cli._pending == [signal.SIGTERM] and signal.getitimer(signal.ITIMER_REAL)[0] > 0
    cli._deliver_pending(signal.SIGALRM, None)  # still importing: held again
    spec._initializing = False
    with pytest.raises(Terminated):
        cli._deliver_pending(signal.SIGALRM, None)
    assert cli._terminated == [signal.SIGTERM]


def test_a_signal_whose_exception_python_drops_is_raised_again(monkeypatch, held_signals):
    """SIGTERM while a weak reference's callback runs (the import system's module-lock clean-up:
    seen once in CI, where the command then ran on and exited 0): Python prints the exception as
    ignored and drops it; the entry point's unraisable hook holds the signal instead, and SIGALRM
    delivers it. Any other unraisable exception is reported as before."""
    import types
    import weakref

    from pnmix import cli
    from pnmix.io import Terminated

    monkeypatch.setattr(sys, "unraisablehook", cli._redeliver_swallowed)

    class Target:
        pass

    def callback(_ref):
        cli._raise_terminated(signal.SIGTERM, None)

    target = Target()
    ref = weakref.ref(target, callback)
    del target  # the callback runs and its Terminated is dropped, not raised here
    assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    assert ref() is None and cli._pending == [signal.SIGTERM] and not cli._terminated
    with pytest.raises(Terminated):
        cli._deliver_pending(signal.SIGALRM, None)
    assert cli._terminated == [signal.SIGTERM]
    seen = []
    monkeypatch.setattr(sys, "__unraisablehook__", seen.append)
    cli._redeliver_swallowed(types.SimpleNamespace(exc_value=ValueError("other")))
    assert len(seen) == 1 and cli._pending == [signal.SIGTERM]  # passed on; the signal's state untouched


# ---------------------------------------------------------------------------------------
# 5. Names and permissions of outputs
# ---------------------------------------------------------------------------------------


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_outputs_get_the_umask_mode_and_existing_files_keep_theirs(tmp_path, umask_022):
    new = tmp_path / "new.json"
    io.write_json_atomic(new, {"a": 1})
    assert stat.S_IMODE(new.stat().st_mode) == 0o644
    for mode in (0o600, 0o640, 0o664, 0o444):
        old = tmp_path / f"old-{mode:o}.json"
        old.write_text("{}")
        old.chmod(mode)
        io.write_json_atomic(old, {"b": 2})
        assert stat.S_IMODE(old.stat().st_mode) == mode and json.loads(old.read_text()) == {"b": 2}
    os.umask(0o077)
    private = tmp_path / "private.json"
    io.write_bytes_atomic(private, b"x")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    plan, description = tmp_path / "e.plan", tmp_path / "e.plan.json"
    plan.write_bytes(b"old")
    plan.chmod(0o644)
    io.write_described_atomic(plan, b"new", description, {"plan": "new"})
    assert stat.S_IMODE(plan.stat().st_mode) == 0o644 and stat.S_IMODE(description.stat().st_mode) == 0o600


def test_output_names_near_the_name_limit_work(tmp_path):
    for stem_bytes in (200, 240, 250):
        name = "r" * (stem_bytes - len(".json")) + ".json"
        io.write_json_atomic(tmp_path / name, {"n": stem_bytes})
        assert json.loads((tmp_path / name).read_text()) == {"n": stem_bytes}
    multibyte = "é" * 125 + ".json"  # 255 bytes in UTF-8
    io.write_bytes_atomic(tmp_path / multibyte, b"x")
    assert (tmp_path / multibyte).read_bytes() == b"x"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(PnMixError, match="output name is 256 bytes, the folder's limit is 255"):
        io.write_bytes_atomic(tmp_path / ("x" * 256), b"x")


def test_a_long_output_name_works_through_the_cli(special, tmp_path, umask_022):
    from pnmix.cli import app

    out = tmp_path / ("reproduce-result-" + "x" * 230 + ".json")
    assert len(out.name.encode()) == 252
    result = CliRunner().invoke(app, ["reproduce", "--config", str(special["small"]), "--seeds", "42",
                                      "--json", str(out)])
    assert result.exit_code in (0, 1), result.output
    assert json.loads(out.read_text())["seeds"] == [42] and stat.S_IMODE(out.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_an_output_through_a_link_updates_the_file_and_special_outputs_are_refused(tmp_path, special):
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    io.write_json_atomic(link, {"c": 3})
    assert link.is_symlink() and json.loads(real.read_text()) == {"c": 3}
    for path in (special["fifo"], Path("/dev/null")):
        with pytest.raises(PnMixError, match="not a regular file"):
            io.check_output_path(path)
    assert stat.S_ISFIFO(os.stat(special["fifo"]).st_mode)


# ---------------------------------------------------------------------------------------
# 7. Exit codes and option parsing, as a user runs them
# ---------------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh process per command
def test_a_closed_stdout_does_not_change_the_exit_code(special, tmp_path):
    """`pnmix reproduce | head -1`: the reader leaves after one line; the run still passes (exit 0)
    and writes its --json."""
    out = tmp_path / "r.json"
    process = subprocess.Popen([sys.executable, "-m", "pnmix", "reproduce", "--config", str(special["small"]),
                                "--seeds", "42", "--json", str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=ENV, cwd=REPO)
    process.stdout.close()  # closed before the first line: every write meets a broken pipe
    try:
        _, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    passed = json.loads(out.read_text())["passed"]
    assert process.returncode == (0 if passed else 1), stderr
    assert stderr.strip() == b"", stderr
    error = subprocess.Popen([sys.executable, "-m", "pnmix", "reproduce", "--seeds", "x"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=ENV, cwd=REPO)
    error.stdout.close()
    error.stderr.close()  # nobody reads the error line: the exit code still says what happened
    assert error.wait(timeout=TIMEOUT) == 2
    shell = subprocess.run(f"{sys.executable} -m pnmix reproduce --config {special['small']} --seeds 42 | head -1; "
                           "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                           text=True, env=ENV, cwd=REPO, timeout=TIMEOUT)
    assert shell.returncode == (0 if passed else 1) and len(shell.stdout.splitlines()) == 1, shell.stderr


USAGE_CASES = [
    (["bench", "decode", "--impls", ","], ["--impls", "names nothing"]),
    (["bench", "decode", "--impls", ""], ["--impls", "names nothing"]),
    (["reproduce", "--seeds", " , "], ["--seeds", "names nothing"]),
    (["bench", "decode", "--context", "many"], ["--context", "integer"]),
    (["export", "-o", "x.onnx", "--batch", "1.5"], ["--batch"]),
    (["reproduce", "--bogus"], ["No such option", "--bogus"]),
    (["bench", "decode", "--contxt", "64"], ["--contxt"]),
    (["nonsense"], ["nonsense"]),
    (["export"], ["--output"]),
    (["reproduce", "--seeds"], ["--seeds", "requires an argument"]),
]


@pytest.mark.slow  # a fresh process per case
def test_usage_errors_are_one_error_line_with_exit_2():
    for (_args, words), done in zip(USAGE_CASES, run_all(USAGE_CASES)):
        assert_one_error_line(done, words)
        assert done.stdout.strip() == "", done.stdout


def test_help_still_works():
    done = finish(start(["--help"]))
    assert done.returncode == 0 and "reproduce" in done.stdout


# ---------------------------------------------------------------------------------------
# 8. ONNX external data in sparse tensors, and messages that keep their reason
# ---------------------------------------------------------------------------------------


def _sparse_model(folder: Path, location: str, where: str, name: str = "sparse") -> Path:
    from onnx import TensorProto, external_data_helper, helper

    values = helper.make_tensor(name, TensorProto.FLOAT, [2], struct.pack("<2f", 1.0, 2.0), raw=True)
    indices = helper.make_tensor(name + "_indices", TensorProto.INT64, [2], [0, 3])
    external_data_helper.set_external_data(values, location=location, offset=0, length=8)
    values.data_location = TensorProto.EXTERNAL
    values.ClearField("raw_data")
    sparse = helper.make_sparse_tensor(values, indices, [4])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    if where == "initializer":
        graph = helper.make_graph([helper.make_node("Identity", [name], ["y"])], "g", [], [out],
                                  sparse_initializer=[sparse])
    else:
        graph = helper.make_graph([helper.make_node("Constant", [], ["y"], sparse_value=sparse)], "g", [], [out])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sparse.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    return path


@pytest.mark.parametrize("where", ["initializer", "attribute"])
@pytest.mark.parametrize("location", ["../secret.bin", "/etc/hostname", "a/../../secret.bin", "..\\secret.bin"])
def test_sparse_tensor_external_data_escaping_the_folder_is_refused(tmp_path, where, location):
    modelfile = pytest.importorskip("pnmix.export.modelfile")
    (tmp_path / "secret.bin").write_bytes(b"\0" * 8)
    path = _sparse_model(tmp_path / "models", location, where)
    with pytest.raises(PnMixError) as info:
        modelfile.load_checked(path)
    assert "external data" in str(info.value) and "only relative paths" in str(info.value), str(info.value)


def test_sparse_tensor_external_data_through_a_link_or_a_fifo_is_refused(tmp_path):
    modelfile = pytest.importorskip("pnmix.export.modelfile")
    (tmp_path / "secret.bin").write_bytes(b"\0" * 8)
    folder = tmp_path / "models"
    path = _sparse_model(folder, "link.bin", "initializer")
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(PnMixError, match="resolves outside the model's folder"):
        modelfile.load_checked(path)
    (folder / "link.bin").unlink()
    os.mkfifo(folder / "link.bin")
    with pytest.raises(PnMixError, match="not a regular file"):
        modelfile.load_checked(path)


def test_a_long_message_keeps_its_reason(tmp_path):
    modelfile = pytest.importorskip("pnmix.export.modelfile")
    long_name = "t" * 3000
    path = _sparse_model(tmp_path / "models", "../secret.bin", "initializer", name=long_name)
    with pytest.raises(PnMixError) as info:
        modelfile.load_checked(path)
    assert str(info.value).endswith("only relative paths inside the model's folder are allowed")
    text = "start " + "x" * 5000 + " the reason at the end"
    cut = one_line(text)
    assert len(cut) <= 1000 and cut.startswith("start ") and cut.endswith("the reason at the end")
    assert one_line("short\nmessage") == "short message"
