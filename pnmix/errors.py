"""The one exception type users see.

Every error that comes from bad input (a config value, a manifest, a file, a shape) is a
``PnMixError`` whose message is one line naming the problem. The CLI prints it and exits 2;
anything else escaping is a bug.
"""


class PnMixError(Exception):
    """A user-facing error: one line, names the problem."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
