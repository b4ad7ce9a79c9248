"""Writing outputs safely: a temporary name in the same folder, then an atomic rename."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import PnMixError


def check_output_path(path: str | Path) -> Path:
    """Fail early (before a long run) when an output could not be written; returns its folder."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise PnMixError(f"output folder does not exist: {folder}")
    if path.is_dir():
        raise PnMixError(f"output path is a directory: {path}")
    return folder


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    tmp = _stage(path, data)
    _commit(tmp, path)
    return path


def write_described_atomic(path: str | Path, data: bytes, description: str | Path, described: Any) -> Path:
    """Write a file and the JSON that describes it (an engine and its sidecar) so that a reader
    never finds a new file beside an old description: both are written to temporary names first
    (a failure there leaves the old pair as it was), the old description is removed, then the file
    and its description are renamed in that order. A failure between the renames leaves a file
    without a description, which readers refuse, never a mismatched pair."""
    path, description = Path(path), Path(description)
    staged_description = _stage(description, _json_bytes(described))
    try:
        staged = _stage(path, data)
    except BaseException:
        Path(staged_description).unlink(missing_ok=True)
        raise
    try:
        description.unlink(missing_ok=True)
    except OSError as exc:
        for tmp in (staged, staged_description):
            Path(tmp).unlink(missing_ok=True)
        raise PnMixError(f"cannot replace {description}: {exc.strerror}") from None
    try:
        _commit(staged, path)
    except BaseException:
        Path(staged_description).unlink(missing_ok=True)
        raise
    _commit(staged_description, description)
    return path


def _stage(path: Path, data: bytes) -> str:
    """data in a temporary file beside path (removed again on any failure); returns its name."""
    folder = check_output_path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise PnMixError(f"cannot write to {folder}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise PnMixError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _commit(tmp: str, path: Path) -> None:
    """The atomic rename of a staged file onto path."""
    try:
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise PnMixError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_bytes_atomic(path, _json_bytes(obj))


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, default=_jsonable) + "\n").encode()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
