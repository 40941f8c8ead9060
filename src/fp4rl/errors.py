"""One exception type for mistakes a user can fix (a config, recipe, format, data row,
model path or device): the command line prints its message as one line and exits 2,
with no traceback. Anything else is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(ValueError):
    """A user's mistake; the message says what is wrong and what to do instead."""


class RecipeError(UserError):
    """A malformed recipe: the message says which field and what is allowed."""


class ConfigError(UserError):
    """An invalid training configuration; the message names each bad field."""


def did_you_mean(name: object, choices: list[str] | tuple[str, ...]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices``, or ``""``."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


__all__ = ["ConfigError", "RecipeError", "UserError", "did_you_mean"]
