"""Bringing a running vLLM engine to the trainer's current weights, with no restart.

A refit sends ``Q(W)`` as the trainer computed it from its FP32 masters (the format's
4-bit codes and scales, or their values in bf16) and every other tensor in the engine's
dtype, through vLLM's ``collective_rpc`` to fp4rl's worker extension
(:mod:`fp4rl.rollout.vllm.worker`): it works whether the engine core runs in this
process or in its own, and the engine installs the grid without re-quantizing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NotRequired, TypedDict

import torch

from fp4rl.formats import get_format
from fp4rl.gemm import Operand, PackedOperand

if TYPE_CHECKING:
    from vllm import LLM

    from fp4rl.nn import FP4Linear


@dataclass(frozen=True)
class RefitStats:
    """What one refit moved and cost."""

    seconds: float
    bytes: int
    tensors: int

    def metrics(self) -> dict[str, float]:
        return {"time/refit": self.seconds, "sync/bytes": float(self.bytes),
                "sync/tensors": float(self.tensors)}


class GridWire(TypedDict):
    """One layer's ``Q(W)`` on the wire: whether its FP32 scale travels (as ``s/<name>``),
    and for the format's codes and scales, the format, the whole shape and the fields."""

    scale: bool
    format: NotRequired[str]
    shape: NotRequired[list[int]]
    fields: NotRequired[list[str]]


class PayloadWire(TypedDict):
    """A :class:`RefitPayload` as ``collective_rpc`` carries it: plain containers, the
    tensors by key in ``data`` (one process) or in one safetensors ``blob`` (another);
    ``last`` marks the piece after which the worker runs vLLM's post-load processing."""

    grids: dict[str, GridWire]
    tensors: list[str]
    data: NotRequired[dict[str, torch.Tensor]]
    blob: NotRequired[bytes]
    last: NotRequired[bool]


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

    def to_wire(self, as_bytes: bool = False) -> PayloadWire:
        """Plain containers of tensors, strings and numbers; ``as_bytes``: every tensor
        inside one safetensors blob, for an engine core in another process
        (``collective_rpc`` serializes bytes as they are, tensors only where the
        receiver declares them)."""
        grids: dict[str, GridWire] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, g in self.grids.items():
            scaled = g.scale is not None  # the scale travels as a tensor: no host sync
            if scaled:
                assert g.scale is not None  # what ``scaled`` says
                tensors[f"s/{name}"] = g.scale.reshape(())
            if isinstance(g, PackedOperand):
                grids[name] = GridWire(format=g.packed.format, shape=list(g.packed.shape),
                                       scale=scaled, fields=sorted(g.packed.fields))
                tensors.update({f"g/{name}/{k}": v for k, v in g.row_fields().items()})
            else:
                grids[name] = GridWire(scale=scaled)
                tensors[f"g/{name}/values"] = g.values
        tensors.update({f"t/{n}": t for n, t in self.tensors})
        wire = PayloadWire(grids=grids, tensors=[n for n, _ in self.tensors])
        if as_bytes:
            from safetensors.torch import save

            wire["blob"] = save({k: v.contiguous() for k, v in tensors.items()})
        else:
            wire["data"] = tensors
        return wire

    @classmethod
    def from_wire(cls, wire: PayloadWire) -> RefitPayload:
        if "blob" in wire:
            from safetensors.torch import load

            data = load(wire["blob"])
        else:
            data = wire["data"]
        grids: dict[str, Operand | PackedOperand] = {}
        for name, g in wire["grids"].items():
            scale = data[f"s/{name}"] if g["scale"] else None
            if "format" in g:
                fields = {k: data[f"g/{name}/{k}"] for k in g["fields"]}
                rows, cols = g["shape"]  # a weight's: the wire carries it as a list
                grids[name] = PackedOperand.from_row_fields(get_format(g["format"]),
                                                            (rows, cols), fields, scale)
            else:
                grids[name] = Operand(data[f"g/{name}/values"], scale)
        return cls(grids, [(n, data[f"t/{n}"]) for n in wire["tensors"]])


#: the default bound on the bytes of one refit piece (``rollout.vllm.refit_piece_bytes``)
PIECE_BYTES = 256 << 20


def refit_payload(model: torch.nn.Module, dtype: torch.dtype, packed: bool = False
                  ) -> RefitPayload:
    """The payload that brings an engine to ``model``'s current weights, whole (the pieces
    of :func:`refit_pieces` joined): for every fp4rl layer whose rollout needs only
    ``Q(W)``, the ``Q(W)`` its rollout mode uses (bit for bit: the cached operand, exact
    in bf16; ``packed``: the format's 4-bit codes and scales instead, a quarter of the
    bytes, encoded here); every other floating tensor in the engine's ``dtype``. A model
    without fp4rl layers sends plain tensors only."""
    grids: dict[str, Operand | PackedOperand] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for piece in refit_pieces(model, dtype, packed, max_bytes=None):
        grids.update(piece.grids)
        tensors.extend(piece.tensors)
    return RefitPayload(grids, tensors)


def refit_pieces(model: torch.nn.Module, dtype: torch.dtype, packed: bool = False,
                 max_bytes: int | None = PIECE_BYTES) -> Iterator[RefitPayload]:
    """:func:`refit_payload` in pieces of at most ``max_bytes`` each (None: one piece),
    built as they are taken, so the sender holds one piece at a time. The ``Q(W)`` of the
    linears of one module (an attention block's q/k/v/o, an MLP's gate/up/down) travel in
    the same piece, as vLLM merges some of them into one layer; a piece exceeds the bound
    only where one such group does."""
    from fp4rl.nn import fp4_layers

    layers = {n: la for n, la in fp4_layers(model).items() if la.rollout_reads_weight_only()}
    grids: dict[str, Operand | PackedOperand] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    size = 0
    for unit in _units(model, layers):
        unit_grids = {n: _grid(layers[n], packed) for n in unit if n in layers}
        unit_tensors = [] if unit_grids else [_plain(n, p, dtype) for n, p in unit.items()]
        unit_size = RefitPayload(unit_grids, unit_tensors).nbytes
        if max_bytes is not None and size and size + unit_size > max_bytes:
            yield RefitPayload(grids, tensors)
            grids, tensors, size = {}, [], 0
        grids.update(unit_grids)
        tensors.extend(unit_tensors)
        size += unit_size
    if grids or tensors:
        yield RefitPayload(grids, tensors)


def _units(model: torch.nn.Module, layers: Mapping[str, torch.nn.Linear]
           ) -> Iterator[dict[str, torch.Tensor]]:
    """What travels together, in the model's parameter order: the grid layers of one
    parent module (by layer name), or one other parameter (by parameter name)."""
    by_parent: dict[str, list[str]] = {}
    for name in layers:
        by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    done: set[str] = set()
    for name, p in model.named_parameters():
        layer, _, leaf = name.rpartition(".")
        if layer in layers and leaf == "weight":
            parent = layer.rpartition(".")[0]
            if parent not in done:
                done.add(parent)
                yield {n: layers[n].weight for n in by_parent[parent]}
        else:
            yield {name: p}


def _grid(layer: FP4Linear, packed: bool) -> Operand | PackedOperand:
    if packed:
        return layer.recovery.weight_operand(layer.weight.detach(), packed=True)
    return layer.rollout_weight(torch.float32).to(torch.bfloat16)


def _plain(name: str, p: torch.Tensor, dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    return name, p.detach().to(dtype) if p.is_floating_point() else p.detach()


def workers_in_this_process(llm: LLM) -> bool:
    """Whether every worker of ``llm`` runs in this process, so a refit may hand it
    tensors as they are: the engine core in this process, and one worker (or vLLM's
    external launcher, one engine a rank). Otherwise tensors travel as bytes: through
    vLLM's shared-memory queue to several workers a CUDA tensor would be rebuilt on
    cuda:0 in every one of them."""
    if type(llm.llm_engine.engine_core).__name__ != "InprocClient":
        return False
    parallel = llm.llm_engine.vllm_config.parallel_config
    return bool(parallel.world_size == 1 or
                parallel.distributed_executor_backend == "external_launcher")


def refit(llm: LLM, model: torch.nn.Module, packed: bool = False,
          max_bytes: int | None = PIECE_BYTES) -> RefitStats:
    """Bring a running engine to ``model``'s current weights (:func:`refit_payload`),
    through vLLM's ``collective_rpc`` and fp4rl's worker extension, one piece of at most
    ``max_bytes`` per call (:func:`refit_pieces`): the engine installs each as it arrives,
    and no message holds the model (vLLM's msgpack caps one at 4 GiB). The next rollout
    samples from the new policy, with no restart."""
    start = time.perf_counter()
    in_process = workers_in_this_process(llm)
    nbytes = count = 0
    with torch.no_grad():
        for piece in refit_pieces(model, llm.llm_engine.model_config.dtype, packed,
                                  max_bytes):
            wire = piece.to_wire(as_bytes=not in_process)
            llm.collective_rpc("fp4rl_refit", args=({**wire, "last": False},))
            nbytes += piece.nbytes
            count += len(piece.grids) + len(piece.tensors)
        empty = RefitPayload({}, []).to_wire(as_bytes=not in_process)
        llm.collective_rpc("fp4rl_refit", args=({**empty, "last": True},))
    llm.reset_prefix_cache()
    return RefitStats(time.perf_counter() - start, nbytes, count)
