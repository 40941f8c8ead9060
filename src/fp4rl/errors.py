"""One exception type for mistakes a user can fix (a config, recipe, format, data row,
model path, device, a file to read or a place to write): the command line prints its
message as one line and exits 2, with no traceback. Anything else is a bug and keeps its
traceback."""

from __future__ import annotations


class UserError(ValueError):
    """A user's mistake; the message says what is wrong and what to do instead."""


class RecipeError(UserError):
    """A malformed recipe: the message says which field and what is allowed."""


class ConfigError(UserError):
    """An invalid training configuration; the message names each bad field."""


class MissingFileError(UserError, FileNotFoundError):
    """A file the user named does not exist (still a ``FileNotFoundError`` for callers
    that catch that)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: torn, truncated or not a checkpoint at all."""


class ResumeError(UserError):
    """``--resume`` asked for something the saved run cannot give: nothing to resume, or
    settings that would change the run's trajectory."""


class OutputError(UserError):
    """A place to write that cannot be used: a file where a directory is expected, a
    read-only directory, an existing run."""


class DirectoryInUse(OutputError):
    """An output directory another process holds (its lock): the directory is theirs, so
    the refused command leaves it exactly as it found it."""


def did_you_mean(name: object, choices: list[str] | tuple[str, ...]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices``, or ``""``."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


__all__ = ["CheckpointError", "ConfigError", "DirectoryInUse", "MissingFileError", "OutputError",
           "RecipeError", "ResumeError", "UserError", "did_you_mean"]
