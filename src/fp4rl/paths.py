"""Where fp4rl keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The user cache directory: ``$FP4RL_CACHE`` if set, else ``~/.cache/fp4rl``."""
    configured = os.environ.get("FP4RL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fp4rl"
