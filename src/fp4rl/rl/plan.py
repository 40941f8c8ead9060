"""A training config resolved once, at the edge: the :class:`RunPlan` the trainer runs.

A :class:`~fp4rl.rl.config.TrainConfig` holds what a user wrote (``device: auto``,
``mixed_precision: auto``, ``rollout.engine: auto``, names). :func:`plan_run` turns it,
once per process, into the objects those words stand for on this machine: the process
group joined and the device picked, the compute ``torch.dtype``, the :class:`Recipe` with
its format objects, the rollout engine's class with its own typed settings (vLLM's
storage and wire as enums, each ``auto`` in them settled for the device), each engine
refusal made. Everything below takes the plan's
objects; nothing re-reads a name or re-checks what the plan settled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel

from fp4rl.nn.invariant import check_batch_invariant
from fp4rl.nn.recipe import Recipe
from fp4rl.precision import compute_dtype, resolve_mixed_precision
from fp4rl.rl.config import TrainConfig
from fp4rl.rl.distributed import Dist, setup
from fp4rl.rollout import RolloutEngine, get_engine, resolve_engine


@dataclass(frozen=True)
class RunPlan:
    """What a run is, resolved: see the module docstring.

    ``config`` is the config as run, with the device, ``mixed_precision`` and distributed
    strategy written back as resolved, so that the saved ``config.yaml`` reproduces the
    run; ``engine_settings`` is the engine's ``rollout.<engine>`` section as its own model,
    each ``auto`` in it settled for ``device`` (None for an engine that takes none)."""

    config: TrainConfig
    dist: Dist
    device: torch.device
    mixed_precision: Literal["no", "bf16"]
    compute_dtype: torch.dtype
    recipe: Recipe
    engine: type[RolloutEngine]
    engine_settings: BaseModel | None
    #: on-policy to the bit (``batch_invariant``): checked to run here, and the engine is
    #: fp4rl's own; the trainer's layers and engine take it from here
    batch_invariant: bool = False
    #: whether the FP4 layers keep Q(W) between weight updates (``weight_cache``): off
    #: where the run shards its weights, whose unsharded copies live for one GEMM
    weight_cache: bool = True


def plan_run(config: TrainConfig) -> RunPlan:
    """``config`` resolved on this process (joins the launcher's process group, once).

    Refuses in one line, before anything loads: a batch that the processes cannot share,
    a rollout engine that cannot serve the run here (``batch_invariant`` runs fp4rl's
    own engine; ``auto`` picks one for the device), and ``batch_invariant`` where its
    kernels cannot run on the device."""
    d = config.distributed
    dist, device = setup(d.strategy, d.backend, config.device, d.timeout_s)
    dist.check_divides(config.grpo.batch_size)  # every rank samples as many prompts
    mixed = resolve_mixed_precision(config.mixed_precision, device)
    recipe = config.recipe()
    if config.batch_invariant:  # its kernels must run here: never on in name only
        check_batch_invariant(device)
    name = resolve_engine(config.rollout.engine, device, recipe, config.batch_invariant)
    engine = get_engine(name)
    engine.check(recipe, device, dist.world_size)
    as_run = config.model_copy(update={
        "device": str(device), "mixed_precision": mixed,
        "distributed": d.model_copy(update={"strategy": dist.strategy})})
    return RunPlan(config=as_run, dist=dist, device=device, mixed_precision=mixed,
                   compute_dtype=compute_dtype(mixed), recipe=recipe, engine=engine,
                   engine_settings=engine.settle(config.rollout.settings_of(name), device),
                   batch_invariant=config.batch_invariant,
                   weight_cache=config.weight_cache and not dist.shards)


__all__ = ["RunPlan", "plan_run"]
