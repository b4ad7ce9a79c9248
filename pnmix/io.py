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
    folder = check_output_path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise PnMixError(f"cannot write to {folder}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise PnMixError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_bytes_atomic(path, (json.dumps(obj, indent=2, default=_jsonable) + "\n").encode())


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
