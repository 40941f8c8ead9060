"""Keep one copy on disk of the files the test environments have in common:
``python scripts/share_files.py DIR [DIR ...]``.

The three environments ``make test`` builds hold the same wheels several times over (torch's
CPU build in two, pyarrow, sympy, pandas and vLLM's requirements in all three): 3.4 GiB of
13.5. Identical files (same bytes, same mode) become hard links to one file, as uv's
installer does with its cache. pip never writes into an installed file (it replaces or
removes it), so environments stay independent: upgrading a package in one leaves the others'
files as they were. Folders that do not exist yet are skipped, as are links across disks."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import sys
from collections import defaultdict
from pathlib import Path

#: Smaller files are not worth a hash: the bulk of the bytes is in shared libraries and data.
MIN_BYTES = 64 * 1024
GIB = 1024**3


Entry = tuple[Path, os.stat_result]


def _files(roots: list[Path]) -> dict[tuple[int, int], list[Entry]]:
    """Regular files of at least ``MIN_BYTES`` grouped by (size, mode): the only candidates."""
    groups: dict[tuple[int, int], list[Entry]] = defaultdict(list)
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder, name)
                info = path.lstat()
                if stat.S_ISREG(info.st_mode) and info.st_size >= MIN_BYTES:
                    groups[(info.st_size, info.st_mode)].append((path, info))
    return groups


def _digest(path: Path) -> bytes:
    hasher = hashlib.blake2b(digest_size=20)
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
    return hasher.digest()


def _link(keep: Path, replace: Path) -> bool:
    """Make ``replace`` a hard link to ``keep``, atomically; False across disks."""
    temporary = replace.with_name(f".{replace.name}.shared")
    try:
        os.link(keep, temporary)
    except OSError as error:
        if error.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            return False
        raise
    os.replace(temporary, replace)
    return True


def share(roots: list[Path]) -> int:
    """Hard-link identical files under ``roots`` to one copy; the number of files linked."""
    linked = 0
    for members in _files(roots).values():
        if len({(info.st_dev, info.st_ino) for _, info in members}) < 2:
            continue
        by_content: dict[bytes, list[Entry]] = defaultdict(list)
        for path, info in members:
            by_content[_digest(path)].append((path, info))
        for same in by_content.values():
            (keep, kept), *others = same
            for path, info in others:
                if (info.st_dev, info.st_ino) != (kept.st_dev, kept.st_ino) and _link(keep, path):
                    linked += 1
    return linked


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv if Path(arg).is_dir()]
    if not roots:
        return 0
    free_before = shutil.disk_usage(roots[0]).free
    linked = share(roots)
    freed = shutil.disk_usage(roots[0]).free - free_before
    names = " ".join(str(root) for root in roots)
    print(f"share_files: {linked} files in {names} now share a copy; "
          f"{max(freed, 0) / GIB:.1f} GiB freed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
