"""Where fp4rl keeps files between runs, and how it makes them durable."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The user cache directory: ``$FP4RL_CACHE`` if set, else ``~/.cache/fp4rl``."""
    configured = os.environ.get("FP4RL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fp4rl"


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk (the step before an atomic rename)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
