"""The Makefile's helper scripts: the disk check that runs before an environment is built."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from _paths import ROOT

NEED_SPACE = ROOT / "scripts" / "need_space.py"


def need_space(gib: float, target: Path) -> subprocess.CompletedProcess[str]:
    """Run the check as the Makefile does."""
    return subprocess.run(
        [sys.executable, str(NEED_SPACE), str(gib), str(target)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_short_disk_stops_with_one_line(tmp_path: Path) -> None:
    free_gib = shutil.disk_usage(tmp_path).free / 1024**3
    result = need_space(free_gib * 2 + 1, tmp_path / "envs" / ".venv-new")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert f"{tmp_path}" in lines[0] and "GiB" in lines[0]


def test_enough_disk_passes(tmp_path: Path) -> None:
    result = need_space(0.001, tmp_path / ".venv-new")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_existing_environment_is_not_checked(tmp_path: Path) -> None:
    """A refresh of a built environment downloads little: it is not held to a new build's need."""
    existing = tmp_path / ".venv-old"
    existing.mkdir()
    assert need_space(1e9, existing).returncode == 0
