"""The rollout copy's weights under FSDP2: gathered once per RL step, in 4 bits.

A real FP4 rollout engine receives the quantized weights, not the trainer's FP32
masters. Once per step each rank encodes its shard of every patched layer's rollout
weight in the rollout format (FSDP2 shards rows, i.e. out_features, so every block along
in_features stays whole on one rank), the ranks all-gather the packed codes and scales,
and each rank decodes them into the rollout copy (:meth:`FP4Linear.receive_rollout_weight`).
Formats with a per-tensor scale (NVFP4) first agree on the whole tensor's amax with one
all-reduce, so every shard is scaled as the whole tensor would be: the decoded weight is
bit for bit what one process quantizes.

Layers whose recovery method needs the high-precision weight at rollout
(``reads_weight``: SmoothQuant, RHT, OCC), layers whose rollout weights are not quantized,
and every other parameter (embeddings, norms, lm_head) travel at full precision.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from fp4rl.formats.base import NumberFormat
from fp4rl.formats.nvfp4 import finite_amax
from fp4rl.formats.packing import PackedTensor
from fp4rl.gemm import Operand, PackedOperand
from fp4rl.nn import FP4Linear, fp4_layers


@dataclass
class SyncBytes:
    """Bytes one rank received in one sync, and what the packed layers would cost in bf16."""

    packed: int = 0  # 4-bit codes and scales
    full: int = 0  # parameters sent at full precision
    packed_as_bf16: int = 0  # the packed layers' weights, had they travelled in bf16

    def metrics(self) -> dict[str, float]:
        return {"sync/rollout_weight_bytes_4bit": float(self.packed),
                "sync/rollout_weight_bytes_full": float(self.full),
                "sync/rollout_weight_bytes_as_bf16": float(self.packed_as_bf16)}


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2: the one test of "is this FSDP" that the
    engines, the trainer and the checkpointer share (a sharded model's rollout runs on
    its unsharded copy, refreshed by :func:`refresh_rollout_copy`)."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def refresh_rollout_copy(model: torch.nn.Module, policy: torch.nn.Module,
                         world_size: int) -> dict[str, float]:
    """:func:`sync_rollout_weights`, as a step's metrics: bytes received and seconds."""
    start = time.perf_counter()
    sent = sync_rollout_weights(model, policy, world_size)
    return {**sent.metrics(), "time/weight_sync": time.perf_counter() - start}


def packable(layer: FP4Linear) -> bool:
    """Whether the 4-bit rollout weight is all this layer's rollout needs."""
    return layer.rollout_reads_weight_only()


def sync_rollout_weights(model: torch.nn.Module, policy: torch.nn.Module,
                         world_size: int) -> SyncBytes:
    """Refresh ``policy`` (an unsharded copy of ``model``) from the FSDP2-sharded
    ``model``: packable layers' rollout weights in their 4-bit format, the rest in full."""
    sent = SyncBytes()
    targets = fp4_layers(policy)
    packed_params = set()
    for name, layer in fp4_layers(model).items():
        if packable(layer):
            qw, nbytes = _gather_packed(layer, world_size)
            targets[name].receive_rollout_weight(qw)
            sent.packed += nbytes
            sent.packed_as_bf16 += _received(layer.weight.numel() * 2, world_size)
            packed_params.add(f"{name}.weight")
    destination = dict(policy.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in packed_params:
                continue
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            destination[name].copy_(full)
            sent.full += _received(full.numel() * full.element_size(), world_size)
    return sent


def _received(nbytes: int, world_size: int) -> int:
    """What one rank receives of an all-gather of ``nbytes`` in all."""
    return nbytes * (world_size - 1) // world_size


def _gather_packed(layer: FP4Linear, world_size: int) -> tuple[Operand, int]:
    """The whole weight's rollout operand, from every rank's packed shard; and the bytes
    this rank received."""
    fmt = layer.recipe.rollout.weights
    assert isinstance(fmt, NumberFormat)  # packable layers quantize their weight
    local = layer.weight.to_local().detach().float()  # type: ignore[attr-defined]  # FSDP2 DTensor
    rows = layer.weight.shape[0]
    per_rank = -(-rows // world_size)  # FSDP2 shards rows in chunks of this size
    padded = torch.nn.functional.pad(local, (0, 0, 0, per_rank - local.shape[0]))
    mine = layer.recovery.weight_operand(padded, packed=True,
                                         tensor_scale=_tensor_scale(fmt, local))
    assert isinstance(mine, PackedOperand)
    packed = mine.packed
    names = sorted(packed.fields)
    gathered = {name: _gather_fields(packed, name, world_size) for name in names}
    decoded = [fmt.decode(replace(packed, fields={n: gathered[n][r] for n in names}))
               for r in range(world_size)]
    values = torch.cat(decoded)[:rows]
    return Operand(values, mine.scale), _received(packed.nbytes * world_size, world_size)


def _gather_fields(packed: PackedTensor, name: str, world_size: int) -> list[torch.Tensor]:
    mine = packed.fields[name].contiguous()
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return out


def _tensor_scale(fmt: NumberFormat, local: torch.Tensor) -> torch.Tensor | None:
    """The format's per-tensor scale of the whole weight (None for formats without one):
    the scale depends on the tensor's amax alone, which the ranks agree on here."""
    amax = finite_amax(local)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return fmt.tensor_scale(amax.reshape(1))


__all__ = ["SyncBytes", "is_fsdp", "packable", "refresh_rollout_copy", "sync_rollout_weights"]
