"""Where fp4rl keeps files between runs, and how it makes them durable."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from fp4rl.errors import OutputError


def cache_root() -> Path:
    """The user cache directory: ``$FP4RL_CACHE`` if set, else ``~/.cache/fp4rl``."""
    configured = os.environ.get("FP4RL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fp4rl"


#: a JSON list of numbers as ``json.dumps(indent=2)`` writes it, one number per line
_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def write_json(path: str | Path, payload: object, inline_numbers: bool = False) -> Path:
    """Write ``payload`` as indented JSON, creating the parent directories; atomic (a
    reader, or a rerun after a kill, sees the old file or the whole new one).
    ``inline_numbers`` puts each list of numbers on one line, which keeps files with long
    per-prompt or per-step lists a fraction of the size."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2)
    if inline_numbers:
        text = _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m[1]) + "]", text)
    return write_text_atomic(target, text)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` atomically: a reader, or a rerun after a kill, sees
    the old file or the whole new one, never a part."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    return target


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk (the step before an atomic rename)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def check_writable(path: str | Path, option: str, directory: bool = False) -> None:
    """Refuse, before any work, a place a command could not write its result: a file
    where a directory is meant (or the reverse), or a parent where no file can be made.
    Creates nothing: it makes (and removes) a temporary file in the nearest existing
    ancestor, the only test that holds for root and read-only file systems alike."""
    target = Path(path)
    if target.exists() and target.is_dir() != directory:
        want, kind = ("directory", "file") if directory else ("file", "directory")
        raise OutputError(f"{option} {target} is a {kind}; give a {want} path")
    ancestor = target if target.is_dir() else target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{option} {target}: {ancestor} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as err:
        raise OutputError(f"{option} {target}: cannot write in {ancestor} "
                          f"({err.strerror or err})") from None
