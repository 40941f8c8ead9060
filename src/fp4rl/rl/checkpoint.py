"""Crash-safe training checkpoints: model, optimizer, RNG states, data position.

A checkpoint ``<run>/checkpoints/step-000010/`` is written into a hidden temporary
directory, every file is flushed to disk, and only then is the directory renamed into
place and the ``latest`` pointer replaced (both atomic). A SIGKILL at any moment
leaves either the previous checkpoint or the new one as ``latest``, never a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from fp4rl.paths import fsync_path

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "trainer_state.json"  # written last inside a checkpoint


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        fsync_path(f)
    fsync_path(path)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    keep: int = 2, optimizer_state: dict[str, Any] | None = None) -> Path:
    """Atomically write checkpoint ``step`` and point ``latest`` at it; prune old ones.

    ``optimizer_state`` replaces ``optimizer.state_dict()`` (a sharded optimizer's
    gathered full state)."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(run_dir, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict() if optimizer_state is None else optimizer_state,
               tmp / "optimizer.pt")
    torch.save(state, tmp / "state.pt")
    (tmp / COMPLETE).write_text(json.dumps({"step": step}))
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step after a resume: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_latest(root, final.name)
    _prune(root, keep)
    return final


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name)
    fsync_path(tmp)
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def _complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / "model.safetensors").is_file()


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if _complete(p))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*"):  # temporary directories of killed saves
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = run_dir / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if _complete(candidate):
            return candidate
    done = sorted(p for p in root.glob("step-*") if _complete(p))
    return done[-1] if done else None


def load_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Restore model (and optimizer) in place; return the saved trainer state."""
    load_model(model, str(path / "model.safetensors"))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    return torch.load(path / "state.pt", weights_only=False)
