"""The one exception type users see.

Every error that comes from bad input (a config value, a manifest, a file, a shape) is a
``PnMixError`` whose message is one line naming the problem. The CLI prints it and exits 2;
anything else escaping is a bug.
"""


class PnMixError(Exception):
    """A user-facing error: one line, names the problem."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# The Cache API's callers (transformers' generate, beam search) catch the built-in types; these
# are PnMixErrors (one line, exit 2 in the CLI) that are also what such a caller expects.
class PnMixIndexError(PnMixError, IndexError):
    """An index out of range (a batch row that is not there, a negative one)."""


class PnMixValueError(PnMixError, ValueError):
    """A value of the wrong kind or range (a float index, a 2-D index, repeats 0)."""


def one_line(what: object, limit: int = 1000) -> str:
    """Any message (or exception) folded onto one line; an exception with no text reads as its
    type's name. A message longer than `limit` characters loses its middle, not its end: the
    reason often comes last, after long paths and tensor names."""
    text = " ".join(str(what).split())
    if not text and isinstance(what, BaseException):
        text = type(what).__name__
    if len(text) <= limit:
        return text
    head = (limit - 5) * 2 // 3
    return f"{text[:head]} ... {text[len(text) - (limit - 5 - head):]}"


def describe(exc: BaseException, limit: int = 1000) -> str:
    """'TypeName: message' on one line: for exceptions that are not already ours."""
    return one_line(exc, limit) if isinstance(exc, PnMixError) else f"{type(exc).__name__}: {one_line(exc, limit)}"


def parse_list(text: str, option: str) -> list:
    """The items of a comma-separated option; naming nothing (``--impls ,``) is an error."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise PnMixError(f"{option} names nothing, got {text!r}")
    return items


def parse_positive_ints(text: str, option: str) -> list:
    """The positive integers of a comma-separated option (``--contexts 1024,4096``)."""
    try:
        values = [int(part) for part in parse_list(text, option)]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise PnMixError(f"{option} must be a comma list of positive integers, got {text!r}")
    return values
