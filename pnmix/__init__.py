"""pnmix: a deployable 2-bit packed KV cache (the pn-mix method).

Importing pnmix imports nothing heavy: the names below load their module (and torch) on first
use, so `pnmix --help` and the CLI's error paths start fast.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

# name -> the module that defines it (PEP 562 lazy attributes)
_LAZY = {
    "PnMixConfig": "pnmix.config",
    "RunConfig": "pnmix.config",
    "PnMixError": "pnmix.errors",
    "CacheLayout": "pnmix.format",
    "PackedKVCache": "pnmix.cache",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pnmix' has no attribute {name!r}")


class _SourceExportFinder(importlib.abc.MetaPathFinder):
    """In a source checkout (PYTHONPATH=repo), serve the repository's top-level export/ as
    pnmix.export, as the installed wheel does (pyproject maps export/ to pnmix/export). Only that
    one folder: no other top-level folder becomes part of the package."""

    NAME = "pnmix.export"

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)])


def _serve_source_export() -> None:
    here = Path(__file__).resolve().parent
    source = here.parent / "export"
    if not (here / "export").exists() and (source / "__init__.py").exists():
        if not any(isinstance(f, _SourceExportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _SourceExportFinder(source))


_serve_source_export()

# scikit-build-core's editable install lists the repository root among the package's folders (it
# holds export/), which made every top-level folder (tests/, tools/) importable as a subpackage.
__path__[:] = [folder for folder in __path__ if Path(folder).name == "pnmix"]
