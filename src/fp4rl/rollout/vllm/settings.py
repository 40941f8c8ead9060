"""``rollout.vllm``: the vLLM engine's own settings in a training config, one typed and
documented field each. The trainer validates them with the config, the run's plan settles
each ``auto`` for the run's device (:meth:`VLLMSettings.settled`), and the engine reads
them, defaults included, from here alone: :class:`~fp4rl.rollout.vllm.engine.EngineSpec`
and :class:`~fp4rl.rollout.vllm.engine.VLLMEngine` take their defaults from
:data:`DEFAULTS`."""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from fp4rl.rollout.vllm.config import WEIGHT_STORAGES, RefitWire, WeightStorage
from fp4rl.rollout.vllm.refit import PIECE_BYTES


def _field(default: Any, must: str, description: str, **constraints: Any) -> Any:
    """A field whose ``must`` (what a value has to be) words its one-line refusal."""
    return Field(default, description=description, json_schema_extra={"must": must},
                 **constraints)


class VLLMSettings(BaseModel):
    """How the vLLM engine keeps and receives ``Q(W)``, and what it may take of the
    machine (``rollout.engine=vllm``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight_storage: WeightStorage = _field(
        WeightStorage.DEQUANTIZED, " or ".join(WEIGHT_STORAGES),
        "how the engine keeps Q(W): its values in the compute dtype (vLLM's own GEMM), or "
        "the format's 4-bit codes and scales, decoded at each forward (less memory, more "
        "work a forward)")
    refit_wire: RefitWire = _field(
        RefitWire.PACKED, " or ".join(RefitWire),
        "how Q(W) travels to the engine at each refit: the format's 4-bit codes and "
        "scales, or their values in bf16; weight_storage=packed needs packed")
    refit_piece_bytes: StrictInt = _field(
        PIECE_BYTES, "a positive integer (bytes)",
        "the most bytes one refit message carries; a refit goes in pieces of whole "
        "layers (or one tensor) within it", ge=1)
    kv_cache_bytes: StrictInt | None = _field(
        None, "a positive integer (bytes)",
        "each engine's KV cache; default: 1 GiB on a CPU, shared by the engines of a "
        "launched run, and vLLM's share of the GPU (gpu_memory_utilization) on GPUs",
        ge=1)
    gpu_memory_utilization: StrictFloat | StrictInt = _field(
        0.3, "a share of the GPU's memory in (0, 1]",
        "the share of the GPU's memory the engine may take, weights and KV cache (a "
        "colocated engine shares the GPU with the trainer)", gt=0, le=1)
    enforce_eager: Literal["auto"] | StrictBool = _field(
        "auto", "auto, true or false",
        "no CUDA graphs or torch.compile; auto: eager on a CPU, compiled on GPUs")

    @model_validator(mode="after")
    def _storage_gets_its_wire(self) -> VLLMSettings:
        if self.weight_storage is WeightStorage.PACKED and \
                self.refit_wire is not RefitWire.PACKED:
            raise ValueError("rollout.vllm.weight_storage=packed keeps the 4-bit codes it is "
                             "sent: set rollout.vllm.refit_wire=packed")
        return self

    def settled(self, device: torch.device) -> VLLMSettings:
        """These settings with each ``auto`` made what it is on ``device`` (the run's, as
        the plan resolved it; settling twice changes nothing): ``enforce_eager`` eager on
        a CPU (vLLM's compiled mode gains nothing there and costs about a minute of
        start-up), compiled on GPUs; ``kv_cache_bytes`` as
        :func:`default_kv_cache_bytes` sizes it where none is given."""
        eager = device.type != "cuda" if self.enforce_eager == "auto" else self.enforce_eager
        kv = self.kv_cache_bytes if self.kv_cache_bytes is not None else \
            default_kv_cache_bytes(device)
        return self.model_copy(update={"enforce_eager": eager, "kv_cache_bytes": kv})


def default_kv_cache_bytes(device: torch.device) -> int | None:
    """The KV cache of one engine on a CPU: 1 GiB, split between the engines of a launched
    run that share this machine's memory (``LOCAL_WORLD_SIZE``). None on a GPU: each
    rank's engine has its own device, and vLLM sizes the cache from its share of that
    device's memory (``gpu_memory_utilization``)."""
    if device.type == "cuda":
        return None
    return (1 << 30) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


#: every setting's default: the one declaration the engine's other entry points
#: (:class:`~fp4rl.rollout.vllm.engine.EngineSpec`, ``VLLMEngine``'s constructors) read
DEFAULTS = VLLMSettings()


__all__ = ["DEFAULTS", "VLLMSettings", "default_kv_cache_bytes"]
