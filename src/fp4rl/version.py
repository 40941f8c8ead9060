"""fp4rl's version, read from the installed distribution's metadata, so that
``pyproject.toml`` is the one place that states it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fp4rl")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
