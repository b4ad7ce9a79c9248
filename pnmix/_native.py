"""Find and load pnmix's native libraries with ctypes, by name.

One place decides where native code comes from, for every library of the project
(``pnmix_core`` here, the CUDA kernels and TensorRT libraries of the other components). The
search order:

1. ``PNMIX_LIB_DIR`` (one or more folders, ``os.pathsep``-separated): an explicit choice wins;
2. ``pnmix/lib`` next to this file: where ``pip install .`` (scikit-build-core) installs them;
3. a source checkout's CMake builds: ``<repo>/build/dev`` (``cmake -S plugins -B build/dev``),
   ``<repo>/build`` itself (``cmake -S plugins -B build``), then ``<repo>/build/*/``
   (scikit-build-core's ``build/{wheel_tag}``), newest first; each folder and its direct
   subfolders (``cuda/``, ``trt/``) are searched.

``load_library(name)`` raises ``NativeLibraryError`` (a PnMixError) whose one-line message
says where it looked, so `pnmix doctor` and skipped tests can print the reason.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import PnMixError, one_line

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent

_loaded: Dict[str, ctypes.CDLL] = {}


class NativeLibraryError(PnMixError):
    """A native library is not built, not found, or cannot be loaded."""


def library_filename(name: str) -> str:
    """libNAME.so / libNAME.dylib / NAME.dll for this platform."""
    if sys.platform == "win32":
        return f"{name}.dll"
    if sys.platform == "darwin":
        return f"lib{name}.dylib"
    return f"lib{name}.so"


def search_dirs() -> List[Path]:
    """The folders searched, in order (see the module docstring)."""
    dirs: List[Path] = []
    env = os.environ.get("PNMIX_LIB_DIR")
    if env:
        dirs += [Path(part) for part in env.split(os.pathsep) if part]
    dirs.append(PACKAGE_DIR / "lib")
    build = REPO_DIR / "build"
    dirs += [build / "dev", build]
    if build.is_dir():
        others = [p for p in build.iterdir() if p.is_dir() and p.name != "dev"]
        dirs += sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)
    return dirs


def find_library(name: str) -> Tuple[Optional[Path], str]:
    """(path, "") when found, else (None, a one-line reason)."""
    filename = library_filename(name)
    for folder in search_dirs():
        if not folder.is_dir():
            continue
        candidates = [folder / filename] + sorted(folder.glob(f"*/{filename}"))
        for path in candidates:
            if path.is_file():
                return path, ""
    where = "PNMIX_LIB_DIR, " if os.environ.get("PNMIX_LIB_DIR") else ""
    return None, (
        f"{filename} not found (searched {where}{PACKAGE_DIR / 'lib'}, {REPO_DIR / 'build'}/*); "
        "build it with `cmake -S plugins -B build/dev && cmake --build build/dev` or `pip install .`"
    )


def load_library(name: str) -> ctypes.CDLL:
    """Load (once) and return the named library, or raise NativeLibraryError with the reason."""
    if name in _loaded:
        return _loaded[name]
    path, reason = find_library(name)
    if path is None:
        raise NativeLibraryError(reason)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeLibraryError(f"cannot load {path}: {one_line(exc)}") from None
    _loaded[name] = lib
    return lib


def library_status(name: str) -> Tuple[bool, str]:
    """(available, path or reason): for `pnmix doctor` and test skips."""
    try:
        lib = load_library(name)
    except NativeLibraryError as exc:
        return False, str(exc)
    return True, str(getattr(lib, "_name", name))
