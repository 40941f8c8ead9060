"""Loading ``Q(W)`` into the fp4rl layers of a vLLM engine (imported only where vLLM is).

A layer holds no FP32 between loads. Its ``weight`` parameter has no storage then: a load
through vLLM's own loader (a checkpoint, or ``load_weights`` from verl or TRL) allocates
it in the dtype the weight arrives in (FP32 masters stay FP32, so ``Q(W)`` is theirs,
exactly as fp4rl's own refit computes it; anything else in the compute dtype), and
:func:`process` (vLLM's ``process_weights_after_loading``) quantizes it once and frees it;
into a built engine the layer is quantized as soon as all its parts arrived, so a sync
stages a layer at a time. What stays is the layer's store (:mod:`.stores`).

A layer can also receive ``Q(W)`` ready-made, never re-quantized: the packed fields of an
fp4rl export (parameters ``weight_<field>``, loaded by vLLM's loader through
:func:`field_loader`), or the grid a trainer computed from its FP32 masters
(:func:`install`, called by the worker extension in :mod:`fp4rl.rollout.vllm.worker`).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, SupportsIndex

import torch

from fp4rl.formats import NumberFormat
from fp4rl.formats.nvfp4 import finite_amax
from fp4rl.gemm import Operand, OperandFormat, PackedOperand, has_tensor_scale
from fp4rl.recovery import RolloutRecovery
from fp4rl.recovery.ops import TracedActivation
from fp4rl.rollout.vllm.compat import (
    WeightLoader,
    declare_reload_weight,
    in_layerwise_reload,
)
from fp4rl.rollout.vllm.errors import VLLMError
from fp4rl.rollout.vllm.sharding import (
    QKV_SHARDS,
    Partition,
    rank_field,
    rank_part,
    whole_amax,
)
from fp4rl.rollout.vllm.stores import Part, WeightStore, release_freed_memory


class WeightLayout(Protocol):
    """How a layer makes and keeps ``Q(W)``: the layer's layout (:mod:`.layouts`, one per
    :class:`~fp4rl.rollout.vllm.config.WeightStorage`) answers, so that nothing here
    branches on the storage; it never calls back into this module."""

    def quantize(self, state: LayerState, shard: torch.Tensor,
                 tensor_scale: torch.Tensor | None) -> Part:
        """``Q(W)`` of one logical layer's loaded weight ``shard``, as the layout keeps it."""

    def accept(self, state: LayerState, parts: list[Part]) -> None:
        """Refuse, in one line, ready-made parts this layout cannot keep."""

    def keep(self, state: LayerState, parts: list[Part]) -> WeightStore:
        """The store holding ``parts``."""


@dataclass
class LayerState:
    """What one fp4rl linear of an engine holds: its parts' rows, format, compute dtype,
    recovery, the store serving its forward, and what arrived since the last processing."""

    shards: list[int]
    in_features: int
    dtype: torch.dtype
    fmt: OperandFormat
    #: the layer's layout, as its weight storage asks
    layout: WeightLayout
    recovery: RolloutRecovery
    #: the recovery's activation as one traceable operator (:mod:`fp4rl.recovery.ops`)
    activation: TracedActivation
    #: whether GEMMs may run on vLLM's prepacked oneDNN weight, rebuilt at every refit:
    #: in eager engines only, as a compiled forward holds on to the tensors it traced
    prepack: bool = True
    store: WeightStore | None = None
    #: packed fields loaded by vLLM's loader, by part index
    incoming: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: parts of ``weight`` vLLM's loader wrote since the last processing
    written: set[int] = field(default_factory=set)
    #: ``Q(W)`` parts handed over ready-made (:func:`install`)
    ready: list[Part] | None = None
    #: how tensor parallelism split the layer; None where it did not
    partition: Partition | None = None
    #: the Hugging Face layers it stands for, in row order (vLLM's
    #: ``packed_modules_mapping``: q/k/v for ``qkv_proj``), by which a refit sends Q(W)
    hf_names: tuple[str, ...] = ()

    def parts_of(self, shard_id: object) -> set[int]:
        """The parts a loader's shard id names: None the whole layer (a checkpoint that
        stores a merged layer fused), "q"/"k"/"v" or an index one part, a tuple several."""
        if shard_id is None:
            return set(range(len(self.shards)))
        if isinstance(shard_id, tuple):
            return set().union(*(self.parts_of(s) for s in shard_id))
        if isinstance(shard_id, str):  # QKVParallelLinear's
            return {QKV_SHARDS.index(shard_id)}
        if isinstance(shard_id, SupportsIndex):  # MergedColumnParallelLinear's
            return {operator.index(shard_id)}
        raise VLLMError(f"a vLLM loader's shard id {shard_id!r} names no part of a layer")


def layer_state(layer: torch.nn.Module) -> LayerState:
    """The :class:`LayerState` fp4rl's linear method (:mod:`.method`) set on ``layer`` in
    ``create_weights``; read through here so that a layer it did not build fails clearly."""
    state = getattr(layer, "fp4rl", None)
    if not isinstance(state, LayerState):
        raise VLLMError(f"{type(layer).__name__} is not an fp4rl layer: it holds no fp4rl "
                        "state (set by the fp4rl linear method's create_weights)")
    return state


def layer_weight(layer: torch.nn.Module) -> torch.Tensor:
    """``layer``'s ``weight``, vLLM's parameter (a Tensor), which the loaders stage and
    :func:`process` frees; torch types a module's attribute as a Tensor or a Module."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise VLLMError(f"the fp4rl layer {type(layer).__name__} has no weight parameter")
    return weight


def weak_loader(loader: WeightLoader) -> Callable[[], WeightLoader]:
    """``loader`` held weakly where it is a layer's bound method. The loader fp4rl wraps
    it in is an attribute of the layer's own parameter, so a strong reference would put
    the layer in a reference cycle, which only the garbage collector frees; vLLM freezes
    the collector's objects (``gc.freeze``) once an engine is built, and every engine
    built in a process would then stay in memory."""
    if hasattr(loader, "__self__"):
        return weakref.WeakMethod(loader)  # type: ignore[return-value]  # a WeakMethod is a Callable[[], ...]
    return lambda: loader


def _staging_dtype(compute: torch.dtype, loaded: torch.Tensor) -> torch.dtype:
    """The dtype a loaded weight waits in until processing: float32 where it arrives in
    float32 (a trainer's masters, as verl and TRL send them), so that ``Q(W)`` is taken of
    the masters themselves, not of their bf16 rounding; else the compute dtype."""
    return torch.float32 if loaded.dtype == torch.float32 else compute


def _shard_id(loaded: torch.Tensor, args: tuple[object, ...], kwargs: dict[str, object]
              ) -> object:
    """The shard id a vLLM loader was called with (positional, keyword, or, as vLLM's
    weights mapper does, an attribute of the loaded tensor)."""
    if args:
        return args[0]
    if "loaded_shard_id" in kwargs:
        return kwargs["loaded_shard_id"]
    return getattr(loaded, "shard_id", None)


def weight_loader_of(layer: torch.nn.Module, loader: Callable[[], WeightLoader]
                     ) -> WeightLoader:
    """The loader of ``layer``'s ``weight``: vLLM's own ``loader`` (held weakly) into a
    weight that gets its storage at the first load, in the dtype it arrives in; into a
    built engine, the layer is processed as soon as all its parts arrived."""
    state = layer_state(layer)
    shape = (sum(state.shards), state.in_features)
    owner = weakref.ref(layer)  # the loader lives on the layer's parameter (see weak_loader)

    def load_weight(param: torch.nn.Parameter, loaded: torch.Tensor, *args: object,
                    **kwargs: object) -> object:
        if param.numel() == 0:
            param.data = torch.empty(shape, dtype=_staging_dtype(state.dtype, loaded),
                                     device=param.device)
        state.written |= state.parts_of(_shard_id(loaded, args, kwargs))
        out = loader()(param, loaded, *args, **kwargs)
        layer = owner()
        if state.store is not None and len(state.written) == len(state.shards) and \
                layer is not None and not in_layerwise_reload(layer):
            # a sync into a built engine: quantize this layer now and free its staged
            # weight, so that a sync in buckets (verl's) stages one bucket's layers, not
            # every layer until vLLM's processing at the end
            process(layer)
        return out

    return load_weight


# ----- packed fields through vLLM's loader -------------------------------------------
_TENSOR_SCALE = "tensor_scale"


def field_names(fmt: NumberFormat, in_features: int) -> list[str]:
    """The packed fields of ``fmt`` (plus NVFP4's per-tensor scale)."""
    names = list(PackedOperand.layout(fmt, in_features).fields)
    return [*names, _TENSOR_SCALE] if has_tensor_scale(fmt) else names


def field_dtype(name: str) -> torch.dtype:
    return torch.float32 if name == _TENSOR_SCALE else torch.uint8


def field_loader(state: LayerState, name: str) -> Callable[..., None]:
    """A loader that keeps a packed field of one part until processing assembles it."""

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *args: object,
             **kwargs: object) -> None:
        parts = state.parts_of(_shard_id(loaded, args, kwargs))
        if len(parts) != 1:
            raise VLLMError(f"packed fp4rl field {name} arrived for parts {sorted(parts)} "
                            "at once; an fp4rl export stores each of q/k/v, gate/up apart")
        index = parts.pop()
        # on the layer's device: vLLM's loader may hand over the checkpoint's CPU tensors
        value = loaded.detach().to(param.device, copy=True)
        if state.partition is not None and name != _TENSOR_SCALE:  # the scale: whole's
            value = rank_field(state.partition, index, value)
        state.incoming.setdefault(index, {})[name] = value

    return load


# ----- after loading ---------------------------------------------------------------------
def install(layer: torch.nn.Module, parts: list[Part]) -> None:
    """Hand ``layer`` its ``Q(W)`` parts ready-made (one per logical layer, in row order);
    the next :func:`process` stores them without re-quantizing."""
    state = layer_state(layer)
    if state.partition is not None and len(parts) == len(state.shards):
        parts = [rank_part(state.partition, i, p) for i, p in enumerate(parts)]
    if [p.values.shape[0] if isinstance(p, Operand) else p.rows for p in parts] != state.shards:
        raise VLLMError(f"a refit sent parts of {len(parts)} layers for an fp4rl layer of "
                        f"parts {state.shards}")
    state.layout.accept(state, parts)
    state.ready = parts


def process(layer: torch.nn.Module) -> bool:
    """Store what arrived since the last call (ready parts, packed fields, or a plain
    weight, quantized here), freeing the weight; False when nothing arrived."""
    state = layer_state(layer)
    parts = state.ready or _from_fields(state) or _from_weight(layer)
    state.ready, state.incoming, state.written = None, {}, set()
    declare_reload_weight(layer, (sum(state.shards), state.in_features))
    weight = layer_weight(layer)
    if weight.numel():
        weight.data = torch.empty(0, state.in_features, dtype=state.dtype,
                                  device=weight.device)
        release_freed_memory()
    if parts is None:
        if state.store is None:  # nothing loaded yet (vLLM's "dummy" load format, which
            # verl starts from before its first sync): zero weights in the layer's own
            # layout until the first load, which then writes into the same tensors
            zeros = torch.zeros(sum(state.shards), state.in_features, dtype=state.dtype,
                                device=weight.device)
            state.store = state.layout.keep(state, _quantized_parts(state, zeros, whole=False))
        return False
    parts = [_on(p, weight.device) for p in parts]
    new = state.layout.keep(state, parts)
    state.store = new if state.store is None else \
        state.store.refilled(new, in_place=not state.prepack)
    return True


def _on(part: Part, device: torch.device) -> Part:
    """``part`` on the layer's device (a refit's payload arrives wherever the wire left it)."""
    if isinstance(part, Operand):
        return Operand(part.values.to(device),
                       None if part.scale is None else part.scale.to(device))
    fields = {k: v.to(device) for k, v in part.packed.fields.items()}
    return PackedOperand(replace(part.packed, fields=fields),
                         None if part.scale is None else part.scale.to(device))


def engine_is_eager() -> bool:
    """Whether the engine being built runs its forward eagerly (no torch.compile, no CUDA
    graphs)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config is None or config.model_config is None or config.model_config.enforce_eager


def _from_fields(state: LayerState) -> list[Part] | None:
    if not state.incoming:
        return None
    if sorted(state.incoming) != list(range(len(state.shards))):
        raise VLLMError(f"packed fp4rl weights arrived for parts {sorted(state.incoming)} of "
                        f"a layer of {len(state.shards)}; a checkpoint must hold every one")
    fmt = state.fmt
    assert isinstance(fmt, NumberFormat)  # only quantized layers register packed fields
    parts: list[Part] = []
    for index, rows in enumerate(state.shards):
        fields = dict(state.incoming[index])
        scale = fields.pop(_TENSOR_SCALE, None)
        scale = None if scale is None else scale.reshape(())  # stored as [1], used as ()
        parts.append(PackedOperand.from_row_fields(fmt, (rows, state.in_features),
                                                   fields, scale))
    return parts


def _from_weight(layer: torch.nn.Module) -> list[Part] | None:
    """``Q(W)`` of every logical layer in the loaded weight (along in_features)."""
    state = layer_state(layer)
    if not state.written:
        return None
    if state.written != set(range(len(state.shards))):
        raise VLLMError(f"vLLM processed a merged fp4rl layer (q/k/v or gate/up) with parts "
                        f"{sorted(state.written)} of {len(state.shards)} loaded: send all of "
                        "its parts before process_weights_after_loading")
    return _quantized_parts(state, layer_weight(layer).detach())


def _quantized_parts(state: LayerState, w: torch.Tensor, whole: bool = True) -> list[Part]:
    """``Q(W)`` of each logical layer of ``w``, as the layer's layout makes it; ``whole``:
    NVFP4's scale over the whole weight (of a rank's share, its ranks agree on it; zeros,
    as a dummy start holds, need no agreement)."""
    parts: list[Part] = []
    start = 0
    with torch.no_grad():
        for rows in state.shards:
            shard = w[start:start + rows]
            parts.append(state.layout.quantize(
                state, shard, _whole_scale(state, shard) if whole else None))
            start += rows
    return parts


def _whole_scale(state: LayerState, shard: torch.Tensor) -> torch.Tensor | None:
    """The per-tensor scale of the whole weight a rank's ``shard`` is part of (NVFP4 under
    tensor parallelism), or None where the shard's own is the whole's or there is none."""
    fmt = state.fmt
    if state.partition is None or not isinstance(fmt, NumberFormat) or \
            not fmt.has_tensor_scale:
        return None
    return fmt.tensor_scale(whole_amax(finite_amax(shard)))


def store_bytes(model: torch.nn.Module) -> int:
    """Bytes the fp4rl layers' stores of an engine's model hold."""
    states = (getattr(m, "fp4rl", None) for m in model.modules())
    return sum(s.store.nbytes(s.in_features) for s in states
               if isinstance(s, LayerState) and s.store is not None)


__all__ = ["LayerState", "engine_is_eager", "field_dtype", "field_loader", "field_names",
           "install", "layer_state", "layer_weight", "process", "store_bytes", "weak_loader",
           "weight_loader_of"]
