"""Crash-safe on-disk cache of converted checkpoints.

An entry is a directory ``<cache_root()>/models/<entry>/`` holding a Hugging Face
checkpoint plus a manifest, ``fp4rl-cache.json``, that records a fingerprint of the source
and the size of every file. An entry is built in a hidden sibling directory
(``.<entry>.<random>.tmp``), the manifest is written last, everything is fsynced, and only
then is the directory renamed into place. Because the rename is atomic, a crash leaves at
worst a hidden temporary directory, never an entry that looks complete; such leftovers are
deleted by a later build once they are an hour old. An entry whose manifest is missing,
unreadable, made from another source, or disagrees with the files on disk is rebuilt.

Two processes that build the same entry at once both do the work; the first rename wins
and the other copy is discarded.
"""

import contextlib
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from fp4rl.paths import cache_root, fsync_path

MANIFEST = "fp4rl-cache.json"
STALE_AFTER_S = 3600.0
"""Age after which a hidden leftover directory is assumed to belong to a dead build."""

Fingerprint = Mapping[str, str | int]

log = logging.getLogger(__name__)


def entry_dir(entry: str) -> Path:
    """Where the cache entry named ``entry`` lives (whether or not it exists yet)."""
    return cache_root() / "models" / entry


def is_complete(directory: Path, fingerprint: Fingerprint) -> bool:
    """Whether ``directory`` is a finished entry built from the source ``fingerprint``."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != dict(fingerprint):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    return all(_size(directory / name) == size for name, size in files.items())


def ensure_entry(entry: str, fingerprint: Fingerprint, build: Callable[[Path], None]) -> Path:
    """Return the directory of a complete entry, first calling ``build(tmp_dir)`` if needed.

    ``build`` writes the checkpoint files into the empty directory it is given. If it raises,
    nothing is published and the error propagates.
    """
    final = entry_dir(entry)
    if is_complete(final, fingerprint):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry}.", suffix=".tmp", dir=final.parent))
    try:
        build(tmp)
        _seal(tmp, fingerprint)
        _publish(tmp, final, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def discard(directory: Path) -> None:
    """Remove an entry so that no reader can see it half deleted.

    It is first renamed to a hidden name (atomic), then deleted; a crash in between leaves
    only a hidden directory for a later sweep.
    """
    trash = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}.trash")
    try:
        directory.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _seal(directory: Path, fingerprint: Fingerprint) -> None:
    """Flush the built files to disk, then write the manifest that marks them complete."""
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
    if not files:
        raise RuntimeError(f"building cache entry {directory.name!r} produced no files")
    for name in files:
        fsync_path(directory / name)
    manifest = {"fingerprint": dict(fingerprint), "files": files, "created": time.time()}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    fsync_path(directory / MANIFEST)
    fsync_path(directory)


def _publish(tmp: Path, final: Path, fingerprint: Fingerprint) -> None:
    """Rename the sealed ``tmp`` into place, replacing a broken entry but not a good one."""
    if is_complete(final, fingerprint):
        return
    if final.exists():
        log.warning("replacing incomplete or outdated cache entry %s", final)
        discard(final)
    try:
        tmp.rename(final)
    except OSError:  # another process published its copy between the check and the rename
        if not is_complete(final, fingerprint):
            raise
    else:
        fsync_path(final.parent)


def _sweep_stale(parent: Path) -> None:
    """Delete hidden build or trash directories old enough to belong to crashed processes."""
    cutoff = time.time() - STALE_AFTER_S
    for path in parent.glob(".*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path)
