"""The verl install lines of docs/integrations.md resolve as written, with pip's own resolver
against the package index: from the checkout and from a wheel built there. Only the
resolution runs (``--dry-run``): the GPU packages it picks do not install on this machine."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from _paths import ROOT

DOCS = ROOT / "docs" / "integrations.md"
#: what verl 0.9.1 pins, which the lines must resolve to beside fp4rl's own ranges
PINNED = {"verl": "0.9.1", "torch": "2.11.0", "vllm": "0.24.0"}


def _index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _index_reachable(), reason="the package index is not "
                                "reachable from here")


def verl_section() -> str:
    return DOCS.read_text().split("\n## verl\n", 1)[1].split("\n## ", 1)[0]


def documented(pattern: str) -> list[str]:
    """The arguments of the one documented ``pip install`` line matching ``pattern``."""
    lines = [m.group(1) for m in re.finditer(r"`?(pip install [^`\n#]*)", verl_section())
             if re.search(pattern, m.group(1))]
    assert len(lines) >= 1, pattern
    return shlex.split(lines[0].strip())[2:]


def resolve(args: list[str], cwd: Path, tmp_path: Path) -> dict[str, str]:
    """What ``pip install ARGS`` would install into an empty environment: name -> version."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q",
                           "--ignore-installed", "--report", str(report), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]}


def test_the_checkout_line_resolves_beside_verl(tmp_path):
    picked = resolve(documented(r'"\./\[vllm\]"'), ROOT, tmp_path)
    assert {k: picked.get(k) for k in PINNED} == PINNED
    assert picked["fp4rl"] == "0.1.0"


def test_the_wheel_line_resolves_beside_verl(tmp_path):
    """The wheel is built as the docs say, then installed by the docs' line."""
    build = re.search(r"`(pip wheel [^`]*)`", verl_section())
    assert build is not None, "the docs give no wheel build line"
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(checkout)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", *shlex.split(build.group(1))], cwd=checkout,
                   check=True, timeout=300, capture_output=True)
    picked = resolve(documented(r"\.whl"), checkout, tmp_path)
    assert {k: picked.get(k) for k in PINNED} == PINNED
    assert picked["fp4rl"] == "0.1.0"
