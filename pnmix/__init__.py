"""pnmix: a deployable 2-bit packed KV cache (the pn-mix method)."""

from .config import PnMixConfig, RunConfig
from .errors import PnMixError
from .format import CacheLayout
from .cache import PackedKVCache

__version__ = "0.1.0"


def _source_checkout_export() -> None:
    """In a source checkout (PYTHONPATH=repo), serve the top-level export/ as pnmix.export,
    as the installed wheel does (pyproject maps export/ to pnmix/export)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if not (here / "export").exists() and (here.parent / "export" / "__init__.py").exists():
        __path__.append(str(here.parent))  # noqa: F821 - the package's own __path__


_source_checkout_export()
__all__ = ["PnMixConfig", "RunConfig", "PnMixError", "CacheLayout", "PackedKVCache", "__version__"]
