"""Writing a training run's checkpoints, and loading the latest one that loads.

What one checkpoint holds on disk is :mod:`fp4rl.rl.checkpoint`'s; which settings may
change on ``--resume`` is :mod:`fp4rl.rl.rundir`'s. This module knows how the
trainer's model is laid out across processes: under one process or DDP the model is
whole on every rank and rank 0 writes it; under FSDP each rank holds shards, writes its
own, and the unsharded rollout copy is refreshed from them after a load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4rl.errors import CheckpointError, ConfigError
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.distributed import Dist, full_model_state
from fp4rl.rollout.weight_sync import is_fsdp


@dataclass
class Checkpointer:
    """The checkpoints of the run in ``out`` for one trainer's model and optimizer."""

    out: Path
    #: the training model (FSDP-sharded layers under FSDP)
    model: torch.nn.Module
    #: the rollout policy: ``model`` itself, or under FSDP its unsharded copy
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dist: Dist
    #: how many complete checkpoints to keep (older ones are pruned)
    keep: int
    log: Callable[[str], None] = print

    @property
    def sharded(self) -> bool:
        return is_fsdp(self.model)

    def save(self, step: int, state: ckpt.RunState, consolidate: bool = False
             ) -> Path | None:
        """Write step ``step``'s checkpoint with the trainer ``state``; the path on rank 0.
        Whole models are written by rank 0 (``model.safetensors``, a Hugging Face
        checkpoint, and the optimizer); sharded ones by every rank through
        ``torch.distributed.checkpoint``, ``consolidate`` adding the whole model as
        ``model.safetensors`` (gathered to rank 0)."""
        if not self.sharded:
            if not self.dist.is_main:
                return None
            return ckpt.save_checkpoint(self.out, step, self.model, self.optimizer, state,
                                        keep=self.keep)
        whole = None
        if consolidate:
            full = full_model_state(self.model, everywhere=False)  # collective
            if self.dist.is_main:
                self.policy.load_state_dict(full)
                whole = self.policy
        path = ckpt.save_sharded_checkpoint(self.out, step, self.model, self.optimizer,
                                            state, self.dist.rank, keep=self.keep,
                                            consolidated=whole)
        return path if self.dist.is_main else None

    def load_latest(self) -> tuple[Path, ckpt.RunState] | None:
        """Load the latest checkpoint that loads into the model and optimizer; its path
        and trainer state, or None when the run has none. A damaged checkpoint is reported
        and the previous complete one tried."""
        candidates = ckpt.complete_checkpoints(self.out)
        for path in candidates:
            try:
                return path, self._load(path)
            except CheckpointError as err:
                self.log(f"warning: skipping a damaged checkpoint: {err}")
        if candidates:
            raise CheckpointError(f"none of the {len(candidates)} checkpoints of {self.out} "
                                  "loads (see the warnings above)")
        return None

    def _load(self, path: Path) -> ckpt.RunState:
        if not self.sharded:
            return ckpt.restore_checkpoint(path, self.model, self.optimizer)
        if not ckpt.has_shards(path):
            raise ConfigError(f"{path} was not written under distributed.strategy=fsdp; "
                              "resume it with the strategy that wrote it")
        state = ckpt.restore_sharded_checkpoint(path, self.model, self.optimizer, self.dist.rank)
        self.policy.load_state_dict(full_model_state(self.model, everywhere=True))
        return state


__all__ = ["Checkpointer"]
