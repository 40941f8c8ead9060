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


SHARE_FILES = ROOT / "scripts" / "share_files.py"


def _share(*roots: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SHARE_FILES), *map(str, roots)],
        capture_output=True,
        text=True,
        check=True,
    )


def test_identical_files_across_environments_become_one(tmp_path: Path) -> None:
    """Same bytes and mode in two environments: one inode after; anything else stays apart."""
    big = bytes(range(256)) * 1024  # 256 KiB: above the size worth a hash
    one, two = tmp_path / "env-a" / "lib", tmp_path / "env-b" / "lib"
    one.mkdir(parents=True)
    two.mkdir(parents=True)
    (one / "libx.so").write_bytes(big)
    (two / "libx.so").write_bytes(big)
    (two / "other.so").write_bytes(big[:-1] + b"\x00")  # same size, other bytes
    (two / "tool").write_bytes(big)
    (two / "tool").chmod(0o755)  # same bytes, another mode
    result = _share(tmp_path / "env-a", tmp_path / "env-b", tmp_path / "not-built-yet")
    assert "1 files" in result.stdout
    assert (one / "libx.so").stat().st_ino == (two / "libx.so").stat().st_ino
    assert (two / "libx.so").read_bytes() == big
    assert len({(one / "libx.so").stat().st_ino, (two / "other.so").stat().st_ino,
                (two / "tool").stat().st_ino}) == 3
    assert not list(two.glob(".*"))  # no temporary link left behind


def test_replacing_a_shared_file_leaves_the_other_environment_intact(tmp_path: Path) -> None:
    """pip replaces a file on upgrade (unlink, write): the other environment keeps its bytes."""
    big = b"\x01" * (128 * 1024)
    a, b = tmp_path / "a" / "m.so", tmp_path / "b" / "m.so"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(big)
    _share(tmp_path / "a", tmp_path / "b")
    assert a.stat().st_ino == b.stat().st_ino
    b.unlink()
    b.write_bytes(b"\x02" * 10)
    assert a.read_bytes() == big
