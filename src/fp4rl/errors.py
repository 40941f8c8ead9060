"""One exception type for mistakes a user can fix (a config, recipe, format, data row,
model path or device): the command line prints its message as one line and exits 2,
with no traceback. Anything else is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(ValueError):
    """A user's mistake; the message says what is wrong and what to do instead."""


__all__ = ["UserError"]
