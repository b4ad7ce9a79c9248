"""pnmix: a deployable 2-bit packed KV cache (the pn-mix method)."""

from .config import PnMixConfig, RunConfig
from .errors import PnMixError
from .format import CacheLayout
from .cache import PackedKVCache

__version__ = "0.1.0"
__all__ = ["PnMixConfig", "RunConfig", "PnMixError", "CacheLayout", "PackedKVCache", "__version__"]
