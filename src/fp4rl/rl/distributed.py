"""One GRPO run on several processes, on torch.distributed.

``torchrun --nproc-per-node N -m fp4rl train ...`` (or ``accelerate launch``) starts N
processes that share the environment variables ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK``; :func:`setup` joins them into one process group. Every rank walks the
same shuffled prompt order and takes its own contiguous share of each step's prompts,
whole groups at a time, so group advantages need no communication; gradients are
averaged by ``DistributedDataParallel``; metrics are reduced here and written by rank 0.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from fp4rl.errors import ConfigError
from fp4rl.precision import resolve_device


@dataclass(frozen=True)
class Dist:
    """This process's place in the run (world size 1: no process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def shards(self) -> bool:
        """Whether :func:`wrap_model` will shard this run's model (FSDP2); once it has,
        :func:`fp4rl.rollout.weight_sync.is_fsdp` tests the model itself."""
        return self.strategy == "fsdp"

    def check_divides(self, n: int, what: str = "grpo.batch_size") -> None:
        """Refuse ``n`` items the ranks cannot share equally (every rank must do as much
        work, or the collectives of the slower ones wait)."""
        if n % self.world_size:
            raise ConfigError(f"{what} ({n}) does not divide by the {self.world_size} "
                              f"processes; choose a multiple of {self.world_size}")


def launched_world_size() -> int:
    """The number of processes a launcher (torchrun, accelerate) started; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank under a launcher; 0 without one."""
    return int(os.environ.get("RANK", "0"))


def setup(strategy: str, backend: str, device: str, timeout_s: float) -> tuple[Dist, torch.device]:
    """Join the launcher's process group and pick this rank's device.

    ``strategy``: auto (ddp on several processes, none on one), none, ddp, fsdp;
    ``backend``: auto (nccl on CUDA, gloo on CPU), gloo, nccl. Collectives time out after
    ``timeout_s`` seconds, so a rank that dies ends the run instead of hanging it.
    """
    world = launched_world_size()
    chosen = ("ddp" if world > 1 else "none") if strategy == "auto" else strategy
    if chosen != "none" and world == 1:
        raise ConfigError(f"distributed.strategy={chosen} needs several processes: launch with "
                          f"'torchrun --nproc-per-node N -m fp4rl train ...' or set "
                          f"distributed.strategy=none")
    if chosen == "none" and world > 1:
        raise ConfigError(f"launched on {world} processes but distributed.strategy=none; "
                          f"use ddp or fsdp, or launch one process")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda" and world > 1:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    chosen_backend = ("nccl" if dev.type == "cuda" else "gloo") if backend == "auto" else backend
    if chosen_backend == "nccl" and dev.type != "cuda":
        raise ConfigError("distributed.backend=nccl needs CUDA devices; on a CPU use gloo "
                          "(or distributed.backend=auto)")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(chosen_backend, timeout=timedelta(seconds=timeout_s))
        _JOINED.append(True)
    return Dist(rank, world, local_rank, chosen), dev


#: whether :func:`setup` created the default process group (a colocated vLLM engine
#: creates its own, which vLLM itself destroys at exit)
_JOINED: list[bool] = []


def teardown() -> None:
    """Leave the process group :func:`setup` joined (every launched process must, or the
    launcher hangs); a group someone else created is theirs to destroy.

    Sharded modules and meshes keep the group alive; collecting them first lets gloo join
    its worker threads now rather than during interpreter shutdown, where they abort."""
    if _JOINED and dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        _JOINED.clear()


_Record = TypeVar("_Record")


def all_gather(obj: _Record, d: Dist) -> list[_Record]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one process). Tensors travel
    through the CPU, so this serves small records (rollouts, log-prob rows), not weights."""
    if not d.active:
        return [obj]
    out: list[object] = [None] * d.world_size
    dist.all_gather_object(out, _to_cpu(obj))
    return cast("list[_Record]", out)  # each rank sent one such record


def _to_cpu(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def reduce_metrics(metrics: dict[str, float], d: Dist) -> dict[str, float]:
    """One metrics line for the whole run from every rank's line.

    Ranks hold equal shares, so a mean over a rank's sequences averages to the mean over
    all of them; ``*max*`` keys take the maximum, ``*min*`` the minimum, times the
    slowest rank, token throughputs the sum, and ``step`` / ``lr`` rank 0's value.
    """
    if not d.active:
        return metrics
    lines: list[dict[str, float]] = [{} for _ in range(d.world_size)]
    dist.all_gather_object(lines, metrics)
    out: dict[str, float] = {}
    for key, value in metrics.items():
        values = [line[key] for line in lines if key in line]
        if key in ("step", "lr") or not isinstance(value, int | float):
            out[key] = value
        elif key.endswith("max") or key.endswith("max_length") or key.startswith("time/"):
            out[key] = max(values)
        elif key.endswith("min"):
            out[key] = min(values)
        elif key.startswith("tokens_per_second/"):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def wrap_model(model: torch.nn.Module, d: Dist, device: torch.device) -> torch.nn.Module:
    """The module the loss's forward runs through: DDP averages gradients over ranks;
    FSDP2 shards every transformer block and the root (in place).

    FSDP2's parameters stay FP32 (no ``param_dtype``): the FP4 layers quantize from the
    FP32 masters, as on one process, and autocast gives the bf16 compute; gradients are
    reduced in FP32."""
    if d.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if d.shards:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (d.world_size,))
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the entries of the first ModuleList of the model."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module):
            return list(module)
    raise ConfigError("distributed.strategy=fsdp found no transformer blocks to shard")


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Accumulate gradients locally (no communication) unless ``sync``; ``model`` is what
    :func:`wrap_model` returned on several processes (DDP's wrapper or an FSDP2 module)."""
    if sync:
        yield
        return
    # here, not at the top: only a run on several processes gets this far
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        raise TypeError(f"gradient_sync(sync=False) needs a DDP or FSDP2 model (wrap_model's "
                        f"on several processes), got {type(model).__name__}")


def full_model_state(model: torch.nn.Module, everywhere: bool) -> dict[str, torch.Tensor]:
    """The sharded model's full state dict, on every rank or (CPU-offloaded) on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # a full state dict holds plain tensors (the stubs' ValueType also allows DTensors)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=not everywhere)))


__all__ = ["Dist", "all_gather", "full_model_state", "gradient_sync", "launched_rank",
           "launched_world_size", "reduce_metrics", "setup", "teardown", "transformer_blocks",
           "wrap_model"]
