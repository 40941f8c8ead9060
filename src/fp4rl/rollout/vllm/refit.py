"""Bringing a running vLLM engine to the trainer's current weights, with no restart.

A refit sends ``Q(W)`` as the trainer computed it from its FP32 masters (the format's
4-bit codes and scales, or their values in bf16) and every other tensor in the engine's
dtype, through vLLM's ``collective_rpc`` to fp4rl's worker extension
(:mod:`fp4rl.rollout.vllm.worker`): it works whether the engine core runs in this
process or in its own, and the engine installs the grid without re-quantizing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from fp4rl.gemm import Operand, PackedOperand, pack_operand


@dataclass(frozen=True)
class RefitStats:
    """What one refit moved and cost."""

    seconds: float
    bytes: int
    tensors: int

    def metrics(self) -> dict[str, float]:
        return {"time/refit": self.seconds, "sync/bytes": float(self.bytes),
                "sync/tensors": float(self.tensors)}


@dataclass(frozen=True)
class RefitPayload:
    """What a refit sends: ``Q(W)`` per fp4rl layer (Hugging Face name, no ``.weight``)
    as the trainer computed it, and every other tensor (Hugging Face parameter names)."""

    grids: dict[str, Operand | PackedOperand]
    tensors: list[tuple[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.grids.values()) + \
            sum(t.numel() * t.element_size() for _, t in self.tensors)

    def to_wire(self, as_bytes: bool = False) -> dict[str, Any]:
        """Plain containers of tensors, strings and numbers; ``as_bytes``: every tensor
        inside one safetensors blob, for an engine core in another process
        (``collective_rpc`` serializes bytes as they are, tensors only where the
        receiver declares them)."""
        grids: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, g in self.grids.items():
            scaled = g.scale is not None  # the scale travels as a tensor: no host sync
            if scaled:
                tensors[f"g/{name}/scale"] = g.scale.reshape(())
            if isinstance(g, PackedOperand):
                grids[name] = {"format": g.packed.format, "shape": list(g.packed.shape),
                               "scale": scaled, "fields": sorted(g.packed.fields)}
                tensors.update({f"g/{name}/{k}": v for k, v in g.row_fields().items()})
            else:
                grids[name] = {"scale": scaled}
                tensors[f"g/{name}/values"] = g.values
        tensors.update({f"t/{n}": t for n, t in self.tensors})
        wire = {"grids": grids, "tensors": [n for n, _ in self.tensors]}
        if as_bytes:
            from safetensors.torch import save

            return {**wire, "blob": save({k: v.contiguous() for k, v in tensors.items()})}
        return {**wire, "data": tensors}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> RefitPayload:
        if "blob" in wire:
            from safetensors.torch import load

            data = load(wire["blob"])
        else:
            data = wire["data"]
        grids: dict[str, Operand | PackedOperand] = {}
        for name, g in wire["grids"].items():
            scale = data[f"g/{name}/scale"] if g["scale"] else None
            if "format" in g:
                fields = {k: data[f"g/{name}/{k}"] for k in g["fields"]}
                grids[name] = PackedOperand.from_row_fields(g["format"], tuple(g["shape"]),
                                                            fields, scale)
            else:
                grids[name] = Operand(data[f"g/{name}/values"], scale)
        return cls(grids, [(n, data[f"t/{n}"]) for n in wire["tensors"]])


def refit_payload(model: torch.nn.Module, dtype: torch.dtype, packed: bool = False
                  ) -> RefitPayload:
    """The payload that brings an engine to ``model``'s current weights: for every fp4rl
    layer whose rollout needs only ``Q(W)``, the ``Q(W)`` its rollout mode uses (bit for
    bit: the cached operand, exact in bf16; ``packed``: the format's 4-bit codes and
    scales instead, a quarter of the bytes, encoded here); every other floating tensor in
    the engine's ``dtype``. A model without fp4rl layers sends plain tensors only."""
    from fp4rl.nn import fp4_layers

    grids: dict[str, Operand | PackedOperand] = {}
    for name, layer in fp4_layers(model).items():
        if not layer.rollout_reads_weight_only():
            continue
        if packed:
            w = layer.recovery.transform_weight(layer.weight.detach())
            grids[name] = pack_operand(w, layer.recipe.rollout.weights)
        else:
            grids[name] = layer.rollout_weight(torch.float32).to(torch.bfloat16)
    skip = {f"{n}.weight" for n in grids}
    tensors = [(n, p.detach().to(dtype) if p.is_floating_point() else p.detach())
               for n, p in model.named_parameters() if n not in skip]
    return RefitPayload(grids, tensors)


def refit(llm: Any, model: torch.nn.Module, packed: bool = False) -> RefitStats:
    """Bring a running engine to ``model``'s current weights (:func:`refit_payload`),
    through vLLM's ``collective_rpc`` and fp4rl's worker extension: the next rollout
    samples from the new policy, with no restart."""
    start = time.perf_counter()
    payload = refit_payload(model, llm.llm_engine.model_config.dtype, packed)
    in_process = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    with torch.no_grad():
        llm.collective_rpc("fp4rl_refit", args=(payload.to_wire(as_bytes=not in_process),))
    llm.reset_prefix_cache()
    return RefitStats(time.perf_counter() - start, payload.nbytes,
                      len(payload.grids) + len(payload.tensors))
