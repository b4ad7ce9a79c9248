"""The optional Hugging Face dependencies, with one-line errors when they are missing."""

from __future__ import annotations

from ..errors import PnMixError, describe

def require_transformers():
    """Import transformers 5.x or fail with one line that says how to get it."""
    try:
        import transformers
    except ImportError:
        raise PnMixError("pnmix.hf needs transformers 5.x: pip install 'pnmix[hf]'") from None
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise PnMixError(
            f"pnmix.hf needs transformers 5.x, found {transformers.__version__}: pip install 'transformers>=5.0,<6'"
        )
    return transformers


def quanto_unavailable_reason() -> str | None:
    """None when transformers' QuantizedCache can use the quanto backend here, else why not."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return "optimum-quanto is not installed (pip install 'pnmix[hf]')"
    except Exception as exc:  # a broken install must not take the PnMixCache figures down with it
        return f"optimum-quanto does not import: {describe(exc)}"
    return None
