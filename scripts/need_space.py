"""Stop a build with one line when its disk is short: ``python scripts/need_space.py GIB DIR``.

The test environments are large (verl's stack pulls PyPI's CUDA build of torch, several GB
unpacked, beside its download); pip fills the disk halfway through and stops with an
``OSError`` that does not say how much was needed. This says it before the first download."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

GIB = 1024**3


def existing_parent(path: Path) -> Path:
    """The nearest directory of ``path`` that exists: the environment is not made yet."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def main(argv: list[str]) -> int:
    """Exit 1, with what to do, when ``argv[1]`` has under ``argv[0]`` GiB free.

    An environment that exists is being refreshed, which downloads little: no check."""
    if Path(argv[1]).exists():
        return 0
    need_gib, target = float(argv[0]), existing_parent(Path(argv[1]))
    free_gib = shutil.disk_usage(target).free / GIB
    if free_gib >= need_gib:
        return 0
    print(
        f"{argv[1]} needs about {need_gib:.0f} GiB free while it is built and {target} has "
        f"{free_gib:.1f} GiB: free some space (or point the variable naming it at a larger disk) "
        "and run make again",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
