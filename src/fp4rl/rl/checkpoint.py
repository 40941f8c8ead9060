"""Crash-safe training checkpoints: model, optimizer, RNG states, data position.

A checkpoint ``<run>/checkpoints/step-000010/`` is written into a hidden temporary
directory, every file is flushed to disk, and only then is the directory renamed into
place and the ``latest`` pointer replaced (both atomic). A SIGKILL at any moment
leaves either the previous checkpoint or the new one as ``latest``, never a partial one.
``trainer_state.json``, written last, records every file's size and SHA-256, so a
checkpoint damaged afterwards (a truncated copy, a full disk, a torn write on a network
file system) is detected by :func:`verify_checkpoint` rather than loaded.

One process (and DDP, whose ranks hold the same state) writes ``model.safetensors`` (a
Hugging Face checkpoint) and ``optimizer.pt``. Under FSDP2 every rank writes its own
shards of the model and the optimizer through ``torch.distributed.checkpoint`` into
``dcp/`` (no rank gathers the whole state), plus its RNG state; the run's last
checkpoint also gets a consolidated ``model.safetensors``. A sharded checkpoint without
one still loads into a whole model on one process (:func:`restore_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
from numpy.typing import NDArray
from pydantic import JsonValue
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from fp4rl.errors import CheckpointError
from fp4rl.paths import fsync_path

CHECKPOINTS = "checkpoints"
SHARDS = "dcp"  # torch.distributed.checkpoint directory of a sharded checkpoint
LATEST = "latest"
COMPLETE = "trainer_state.json"  # written last inside a checkpoint


class RunState(TypedDict):
    """What a checkpoint keeps of a run beside its weights and optimizer (``state.pt``,
    the trainer's ``state()``): the step, the data cursor (epoch, index), every random
    generator, the rollout recoveries' own state by layer, and the config as run (its
    JSON form, which a resume compares with the config it is given)."""

    step: int
    cursor: tuple[int, int]
    torch_rng: torch.Tensor
    python_rng: tuple[object, ...]
    #: numpy's legacy state: a tuple (its stubs say what it holds, an Any among it)
    numpy_rng: tuple[str, NDArray[np.uint32], int, int, float] | dict[str, Any]
    recovery: dict[str, dict[str, object]]
    config: dict[str, JsonValue]


class Fingerprint(TypedDict):
    """A checkpoint file's size and SHA-256, as ``trainer_state.json`` records it."""

    size: int
    sha256: str


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_dir():
            _fsync_tree(f)
        else:
            fsync_path(f)
    fsync_path(path)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: RunState,
                    keep: int = 2) -> Path:
    """Atomically write checkpoint ``step`` and point ``latest`` at it; prune old ones."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{step_dir(run_dir, step).name}.", dir=root))
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(state, tmp / "state.pt")
    return _publish(tmp, run_dir, step, keep)


def save_sharded_checkpoint(run_dir: Path, step: int, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, state: RunState,
                            rank: int, keep: int = 2,
                            consolidated: torch.nn.Module | None = None) -> Path:
    """Every rank of an FSDP2 run writes its model and optimizer shards and its state;
    rank 0 adds ``consolidated``'s weights as ``model.safetensors`` when given (a whole
    copy of the model, on rank 0) and publishes the directory. Collective: every rank
    calls it, and none returns before the checkpoint is in place."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = run_dir / CHECKPOINTS
    tmp = root / f".{step_dir(run_dir, step).name}.sharded"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp / SHARDS))
    torch.save(state, tmp / _state_file(rank))
    dist.barrier()
    if rank == 0:
        if consolidated is not None:
            save_model(consolidated, str(tmp / "model.safetensors"))
        _publish(tmp, run_dir, step, keep)
    dist.barrier()
    return step_dir(run_dir, step)


def _state_file(rank: int) -> str:
    return "state.pt" if rank == 0 else f"state-rank{rank}.pt"


def _publish(tmp: Path, run_dir: Path, step: int, keep: int) -> Path:
    """Mark ``tmp`` complete, flush it, rename it to step ``step`` and point ``latest``."""
    root, final = run_dir / CHECKPOINTS, step_dir(run_dir, step)
    files = {str(f.relative_to(tmp)): _fingerprint(f) for f in sorted(tmp.rglob("*"))
             if f.is_file()}
    (tmp / COMPLETE).write_text(json.dumps({"step": step, "files": files}))
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step after a resume: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_latest(root, final.name)
    _prune(root, keep)
    return final


def _fingerprint(path: Path) -> Fingerprint:
    """A file's size and SHA-256: what :func:`verify_checkpoint` checks it against."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return Fingerprint(size=path.stat().st_size, sha256=digest.hexdigest())


def verify_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointError` unless every file of checkpoint ``path`` has the
    size and hash recorded when it was written. Checkpoints written before hashes were
    recorded pass (their loaders still report a damaged file)."""
    try:
        files = json.loads((path / COMPLETE).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: unreadable {COMPLETE} ({err})") from None
    for name, expected in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != expected["size"]:
            raise CheckpointError(f"{path}: {name} holds {f.stat().st_size} bytes, "
                                  f"{expected['size']} were written (truncated or torn)")
        if _fingerprint(f)["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{path}: {name} changed since it was written (its "
                                  "SHA-256 differs)")


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name)
    fsync_path(tmp)
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def _complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (
        (path / "model.safetensors").is_file() or has_shards(path))


def has_shards(path: Path) -> bool:
    """Whether checkpoint ``path`` holds FSDP2 shards (``torch.distributed.checkpoint``)."""
    return (path / SHARDS / ".metadata").is_file()


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if _complete(p))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*"):  # temporary directories of killed saves
        shutil.rmtree(stale, ignore_errors=True)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """A run's complete checkpoints, newest first: the one ``latest`` points at, then
    the others by step. Resuming tries them in this order."""
    root = run_dir / CHECKPOINTS
    done = sorted((p for p in root.glob("step-*") if _complete(p)), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in done:
            done.remove(named)
            done.insert(0, named)
    return done


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    done = complete_checkpoints(run_dir)
    return done[0] if done else None


def restore_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> RunState:
    """Restore a whole model (and optimizer) in place; return the saved trainer state.

    A sharded checkpoint without a consolidated ``model.safetensors`` loads its model
    shards into the whole model on this one process (``torch.distributed.checkpoint``
    reassembles them); its optimizer state resumes only under FSDP
    (:func:`restore_sharded_checkpoint`). A damaged checkpoint raises
    :class:`CheckpointError`."""
    verify_checkpoint(path)
    load_weights(path, model)
    if optimizer is not None:
        optimizer.load_state_dict(read_torch(path / "optimizer.pt"))
    state: RunState = read_torch(path / "state.pt")
    return state


def read_torch(path: Path) -> Any:
    """``torch.load`` of a checkpoint file; a truncated or garbled one is a
    :class:`CheckpointError` naming it."""
    try:
        return torch.load(path, weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path}: unreadable ({' '.join(str(err).split())})") from None


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Checkpoint ``path``'s model weights into a whole model on its device: from
    ``model.safetensors``, or from the shards of a sharded checkpoint without one."""
    if (path / "model.safetensors").is_file():
        device = next(model.parameters()).device
        try:
            load_model(model, str(path / "model.safetensors"), device=str(device))
        except SafetensorError as err:
            raise CheckpointError(f"{path / 'model.safetensors'}: unreadable ({err})") from None
        return
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    load(state, checkpoint_id=str(path / SHARDS), no_dist=True)
    set_model_state_dict(model, state["model"])


def restore_sharded_checkpoint(path: Path, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, rank: int) -> RunState:
    """Restore this rank's model and optimizer shards of an FSDP2 run (the same world
    size that wrote them); return this rank's saved trainer state."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    verify_checkpoint(path)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    shards: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    load(shards, checkpoint_id=str(path / SHARDS))
    set_state_dict(model, optimizer, model_state_dict=shards["model"],
                   optim_state_dict=shards["optimizer"])
    rank_state: RunState = read_torch(path / _state_file(rank))
    return rank_state
