"""Every file pnmix reads or writes goes through here (docs/HARDENING.md sections 1 and 2).

Reading: ``read_input`` takes regular files only (after resolving links: a FIFO, a device such as
/dev/zero, or a folder is refused before it is opened) and reads at most a stated number of bytes;
``read_json`` adds one-line errors for JSON that defeats the parser (deep nesting, integers of
thousands of digits). Writing: a temporary name in the same folder, then an atomic rename; signals
that end the process (SIGTERM, SIGHUP, SIGINT) remove the temporary file first.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import stat
import threading
from pathlib import Path
from typing import Any, Iterator

from .errors import PnMixError, one_line

# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------

# The most bytes each kind of input may have: far above any real file, far below what would
# exhaust a machine's memory when read whole.
JSON_LIMIT = 64 << 20  # config, manifest, engine description
# Text that goes to a tokenizer (a prompt, a --prompt-file, an eval or verify --text): 16 MiB,
# about 4 million tokens, far beyond any context; a 100 MB text aborts the Rust tokenizer (SIGABRT).
TEXT_LIMIT = 16 << 20
MODEL_LIMIT = 2 << 30  # an ONNX model: protobuf's 2 GiB (larger weights go to external data)
PLAN_LIMIT = 16 << 30  # a TensorRT engine
DUMP_LIMIT = 1 << 40  # a .pnkv dump (its reader checks the sizes it describes)
# JSON that no pnmix file needs and that defeats the parser or the types behind it.
MAX_JSON_DEPTH = 100
MAX_JSON_INT_DIGITS = 100
_READ_CHUNK = 1 << 24


def read_input(path: str | Path, what: str, limit: int) -> bytes:
    """The bytes of an input file, with one-line errors: missing, a folder, not a regular file
    (links are resolved first), unreadable, or larger than ``limit`` bytes."""
    path = Path(path)
    fd = _open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise PnMixError(f"{what} file {path} has {size} bytes, more than the limit of {limit} bytes")
        from .memory import check_fits

        check_fits(size, f"reading {what} file {path}", "free memory or use a smaller file")
        chunks, total = [], 0
        while True:  # bounded even if the file grows while it is read
            chunk = os.read(fd, min(_READ_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise PnMixError(f"{what} file {path} has more than the limit of {limit} bytes")
    except OSError as exc:
        raise PnMixError(f"cannot read {what} file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def check_input_file(path: str | Path, what: str) -> Path:
    """The same checks as read_input (a regular file that opens), for files others read."""
    os.close(_open_regular(Path(path), what))
    return Path(path)


def _open_regular(path: Path, what: str) -> int:
    """A read-only descriptor of path, which must be a regular file after resolving links.
    O_NONBLOCK: a FIFO put in its place after the check cannot make the open wait for a writer."""
    try:
        info = os.stat(path)  # follows links: /dev/zero behind a link is a device
    except FileNotFoundError:
        raise PnMixError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise PnMixError(f"cannot read {what} file {path}: {exc.strerror}") from None
    _check_regular(info, path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise PnMixError(f"cannot read {what} file {path}: {exc.strerror}") from None
    try:
        _check_regular(os.fstat(fd), path, what)  # the file opened is the file checked
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(info: os.stat_result, path: Path, what: str) -> None:
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        raise PnMixError(f"{what} path is a directory, not a file: {path}")
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise PnMixError(f"{what} path is not a regular file ({kind}): {path}")


def read_text(path: str | Path, what: str, limit: int = TEXT_LIMIT) -> str:
    data = read_input(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PnMixError(f"cannot read {what} file {path} as UTF-8: {exc}") from None


def check_text(text: str, what: str, limit: int = TEXT_LIMIT) -> str:
    """Text given as a value (a --prompt) held to what read_text holds a file to: UTF-8 (a command
    line's undecodable bytes arrive as lone surrogates, which a tokenizer cannot take) and at most
    ``limit`` bytes."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise PnMixError(f"{what} is not UTF-8 text: {exc.reason} at character {exc.start}") from None
    if size > limit:
        raise PnMixError(f"{what} has {size} bytes, more than the limit of {limit} bytes")
    return text


def read_json(path: str | Path, what: str, limit: int = JSON_LIMIT) -> Any:
    """A JSON file read through read_input and parsed by parse_json."""
    return parse_json(read_text(path, what, limit), f"{what} file {path}")


class _JsonTooBig(ValueError):
    pass


def _json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise _JsonTooBig(f"an integer of {len(digits.lstrip('-'))} digits (at most {MAX_JSON_INT_DIGITS})")
    return int(digits)


def parse_json(text: str, where: str) -> Any:
    """json.loads with one-line errors, also for what defeats the parser or the types behind it:
    nesting deeper than MAX_JSON_DEPTH, integers of more than MAX_JSON_INT_DIGITS digits."""
    try:
        value = json.loads(text, parse_int=_json_int)
    except json.JSONDecodeError as exc:
        raise PnMixError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise PnMixError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except _JsonTooBig as exc:
        raise PnMixError(f"{where} holds {exc}") from None
    except ValueError as exc:  # Python's own limit on integer digits, and the like
        raise PnMixError(f"{where} is not usable JSON: {one_line(exc)}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise PnMixError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a deep document must not overflow here)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            if level > MAX_JSON_DEPTH:
                return level
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


def check_output_path(path: str | Path) -> Path:
    """Fail early (before a long run) when an output could not be written; returns its folder.
    The folder must exist and take a new file (a read-only folder or file system is found now,
    by creating and removing a temporary file, not after minutes of work)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise PnMixError(f"output folder does not exist: {folder}")
    _check_writable(folder)
    most = _name_max(folder)
    if len(os.fsencode(path.name)) > most:
        raise PnMixError(f"output name is {len(os.fsencode(path.name))} bytes, the folder's limit is {most}: {path}")
    if path.is_dir():
        raise PnMixError(f"output path is a directory: {path}")
    try:
        info = os.stat(path)
    except OSError:
        return folder  # a new file (or a dangling link, written through)
    if not stat.S_ISREG(info.st_mode):  # a device or a FIFO must not be replaced by a file
        raise PnMixError(f"output path is not a regular file: {path}")
    return folder


def _check_writable(folder: Path) -> None:
    """A file can be created in folder (where the atomic write stages its output)."""
    name = folder / f".pnmix-write-check.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise PnMixError(f"cannot write to output folder {folder}: {exc.strerror}") from None
    os.close(fd)
    try:
        os.unlink(name)
    except OSError:
        pass


def check_distinct_outputs(**outputs: str | Path | None) -> None:
    """Two outputs of one command (``--json X --plot X``) must not be one file: the second write
    would replace the first. Keyword: the option's name (underscores for dashes)."""
    seen: dict = {}
    for option, path in outputs.items():
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise PnMixError(f"--{seen[key]} and --{option.replace('_', '-')} name the same file {path}: "
                             "give each output its own path")
        seen[key] = option.replace("_", "-")


class Terminated(BaseException):
    """A signal that ends the process (SIGTERM, SIGHUP) arrived while pnmix was writing or running."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def _writing() -> Iterator[list]:
    """The scope of one write. It yields the list of staged (temporary) files, and removes those
    that are still there when anything escapes: an error, Ctrl-C, or a signal. While it runs on
    the main thread, SIGTERM and SIGHUP raise Terminated, so that removal runs; then the signal is
    delivered again under the handler that was there before (the default one ends the process as
    the signal would have). Signals can only be caught on the main thread; elsewhere the write
    still cleans up after errors."""
    staged: list = []
    caught: list = []

    def handler(signum, frame):
        if not caught:  # once: a second signal must not interrupt the cleanup itself
            caught.append(signum)
            raise Terminated(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in ENDING_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, handler)

    def restore() -> None:
        for signum, old in previous.items():
            signal.signal(signum, old)

    try:
        yield staged
    except BaseException as exc:
        for tmp in staged:
            Path(tmp).unlink(missing_ok=True)
        restore()
        if isinstance(exc, Terminated):
            signal.raise_signal(exc.signum)  # ends the process under the default handler
        raise
    finally:
        restore()


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    with _writing() as staged:
        _commit(_stage(path, data, staged), _target(path))
    return path


def write_described_atomic(path: str | Path, data: bytes, description: str | Path, described: Any) -> Path:
    """Write a file and the JSON that describes it (an engine and its sidecar) so that a reader
    never finds a new file beside an old description: both are written to temporary names first
    (a failure there leaves the old pair as it was), the old description is removed, then the file
    and its description are renamed in that order. A failure between the renames leaves a file
    without a description, which readers refuse, never a mismatched pair."""
    path, description = Path(path), Path(description)
    with _writing() as staged:  # removes what is staged when anything fails
        staged_description = _stage(description, _json_bytes(described), staged)
        staged_file = _stage(path, data, staged)
        try:
            _target(description).unlink(missing_ok=True)
        except OSError as exc:
            raise PnMixError(f"cannot replace {description}: {exc.strerror}") from None
        _commit(staged_file, _target(path))
        _commit(staged_description, _target(description))
    return path


def _target(path: Path) -> Path:
    """Where the bytes go: through a link to the file it names (the link stays a link)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _temp_name(target: Path) -> str:
    """A hidden name beside target that fits the folder's name limit (NAME_MAX bytes) even when
    target's own name is near it: the target's name is shortened, the random tag kept."""
    tag = f".{secrets.token_hex(6)}.tmp"
    room = max(0, _name_max(target.parent) - 1 - len(tag))
    stem = os.fsencode(target.name)[:room].decode("utf-8", errors="ignore")
    while len(os.fsencode(stem)) > room:  # names that are not UTF-8
        stem = stem[:-1]
    return str(target.with_name("." + stem + tag))


def _name_max(folder: Path) -> int:
    """The longest file name (in bytes) the folder's file system takes."""
    try:
        return os.pathconf(folder if str(folder) else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _create_mode(target: Path) -> tuple:
    """(mode for os.open, mode to set after): an existing file keeps its permission bits; a new
    one gets 0o666 less the umask, as any normal file creation (the kernel applies the umask)."""
    try:
        return 0o600, stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666, None


def _stage(path: Path, data: bytes, staged: list) -> str:
    """data in a temporary file beside path, its name added to staged (removed by _writing on
    any failure); returns the name."""
    folder = check_output_path(path)
    target = _target(path)
    create, keep = _create_mode(target)
    for _ in range(8):
        tmp = _temp_name(target)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), create)
            staged.append(tmp)
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise PnMixError(f"cannot write to {folder}: {exc.strerror}") from None
    else:  # pragma: no cover - eight random names taken
        raise PnMixError(f"cannot write to {folder}: no free temporary name")
    try:
        if keep is not None:
            os.fchmod(fd, keep)
        view = memoryview(data)
        for at in range(0, len(view), _READ_CHUNK):  # chunks: a signal is handled promptly
            chunk = view[at:at + _READ_CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
    except OSError as exc:
        raise PnMixError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return tmp


def _commit(tmp: str, path: Path) -> None:
    """The atomic rename of a staged file onto path."""
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise PnMixError(f"cannot write {path}: {exc.strerror}") from None


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_bytes_atomic(path, _json_bytes(obj))


class JsonReport:
    """A command's ``--json`` report. Created before the work, it checks the path then, so that a
    path that could not be written fails at once and not after a long run; ``write`` writes the
    report atomically at the end. Without a path (no ``--json``) both do nothing."""

    def __init__(self, path: str | Path | None):
        self.path = None if path is None else Path(path)
        if self.path is not None:
            check_output_path(self.path)

    def write(self, report: Any) -> None:
        if self.path is not None:
            write_json_atomic(self.path, report)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, default=_jsonable) + "\n").encode()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
