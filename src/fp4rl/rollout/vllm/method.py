"""The vLLM classes of the ``fp4rl`` quantization method (imported only where vLLM is).

:class:`FP4RLConfig` decides per layer: a linear inside a transformer block that the
recipe does not ignore gets :class:`FP4RLLinearMethod` with the recipe; other linears get
it with the unquantized recipe (a plain GEMM, and a weight a refit can still load, where
vLLM's own CPU method repacks it away); embeddings and the LM head are left to vLLM.

A layer holds no FP32 between loads. Its ``weight`` parameter has no storage then: a load
through vLLM's own loader (a checkpoint, or ``load_weights`` from verl or TRL) allocates
it in the dtype the weight arrives in (FP32 masters stay FP32, so ``Q(W)`` is theirs,
exactly as fp4rl's own refit computes it; anything else in the compute dtype), and
``process_weights_after_loading`` quantizes it once and frees it; into a built engine the
layer is quantized as soon as all its parts arrived, so a sync stages a layer at a time.
What stays is the layer's :class:`WeightStore`:

- ``dequantized`` (the default): ``Q(W)`` once, in the compute dtype (FP4 values are exact
  in bf16); on a CPU with oneDNN that one copy is vLLM's prepacked GEMM weight, as in a
  plain bf16 engine, so the engine takes no more memory than bf16.
- ``packed``: the format's own 4-bit codes and scales, decoded per forward (the memory an
  FP4 GEMM's operand takes; on hardware without FP4 GEMMs the decode costs time).

A layer can also receive ``Q(W)`` ready-made, never re-quantized: the packed fields of an
fp4rl export (parameters ``weight_<field>``, loaded by vLLM's loader), or the grid a
trainer computed from its FP32 masters (:func:`install`, called by the worker extension
in :mod:`fp4rl.rollout.vllm.worker`).
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, QKVParallelLinear
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from fp4rl.formats import get_format
from fp4rl.formats.nvfp4 import finite_amax
from fp4rl.gemm import (
    UNQUANTIZED,
    Operand,
    PackedOperand,
    has_tensor_scale,
    mm,
)
from fp4rl.nn.patch import BLOCK_PREFIX
from fp4rl.nn.recipe import Recipe
from fp4rl.recovery import RolloutRecovery, make_recovery
from fp4rl.recovery.ops import TracedActivation
from fp4rl.rollout.vllm.compat import declare_reload_weight, in_layerwise_reload
from fp4rl.rollout.vllm.config import (
    QUANT_METHOD,
    VLLMError,
    hf_layer_names,
    recipe_from_config,
    storage_from_config,
)
from fp4rl.rollout.vllm.sharding import (
    QKV_SHARDS,
    Partition,
    check_partition,
    rank_field,
    rank_part,
    whole_amax,
)

#: a ``Q(W)`` part of a layer as it arrives: a dense operand or the format's packed fields
Part = Operand | PackedOperand
#: a GEMM the store runs: rows, ``Q(W)`` (values may be empty where a prepacked kernel
#: holds them), and the kernel ``(rows, bias) -> product`` or None
Gemm = tuple[int, Operand, "Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None"]


class FP4RLConfig(QuantizationConfig):
    """fp4rl's rollout recipe as a vLLM quantization config."""

    def __init__(self, recipe: Recipe, weight_storage: str = "dequantized") -> None:
        super().__init__()
        self.recipe = recipe
        self.weight_storage = weight_storage
        self._layers = 0  # a per-layer seed, as fp4rl's patching numbers its layers

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # simulated formats run on any device, CPUs included

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FP4RLConfig:
        return cls(recipe_from_config(config), storage_from_config(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if not isinstance(layer, LinearBase):
            return None
        names = hf_layer_names(prefix)
        ignored = [self.recipe.ignores(n) for n in names]
        self._layers += 1
        if BLOCK_PREFIX.search(prefix) is None or all(ignored):
            # unquantized, but through this method: vLLM's own CPU method repacks the
            # weight and drops it, which a refit could not load into
            return FP4RLLinearMethod(Recipe(), self._layers - 1, self.weight_storage)
        if any(ignored):
            raise VLLMError(f"ignore leaves part of vLLM's merged linear {prefix} "
                            f"({', '.join(n for n, i in zip(names, ignored, strict=True) if i)})"
                            " unquantized; vLLM runs it as one layer: ignore all of "
                            f"{', '.join(names)} or none")
        return FP4RLLinearMethod(self.recipe, self._layers - 1, self.weight_storage)


@dataclass
class LayerState:
    """What one fp4rl linear of an engine holds: its parts' rows, format, compute dtype,
    recovery, the store serving its forward, and what arrived since the last processing."""

    shards: list[int]
    in_features: int
    dtype: torch.dtype
    fmt: str
    storage: str
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

    def parts_of(self, shard_id: Any) -> set[int]:
        """The parts a loader's shard id names: None the whole layer (a checkpoint that
        stores a merged layer fused), "q"/"k"/"v" or an index one part, a tuple several."""
        if shard_id is None:
            return set(range(len(self.shards)))
        if isinstance(shard_id, tuple):
            return set().union(*(self.parts_of(s) for s in shard_id))
        if isinstance(shard_id, str):  # QKVParallelLinear's
            return {QKV_SHARDS.index(shard_id)}
        return {int(shard_id)}


def _weak(loader: Callable[..., Any]) -> Callable[[], Callable[..., Any]]:
    """``loader`` held weakly where it is a layer's bound method. The loader fp4rl wraps
    it in is an attribute of the layer's own parameter, so a strong reference would put
    the layer in a reference cycle, which only the garbage collector frees; vLLM freezes
    the collector's objects (``gc.freeze``) once an engine is built, and every engine
    built in a process would then stay in memory."""
    if hasattr(loader, "__self__"):
        return weakref.WeakMethod(loader)  # type: ignore[return-value]
    return lambda: loader


def _staging_dtype(compute: torch.dtype, loaded: torch.Tensor) -> torch.dtype:
    """The dtype a loaded weight waits in until processing: float32 where it arrives in
    float32 (a trainer's masters, as verl and TRL send them), so that ``Q(W)`` is taken of
    the masters themselves, not of their bf16 rounding; else the compute dtype."""
    return torch.float32 if loaded.dtype == torch.float32 else compute


def _shard_id(loaded: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The shard id a vLLM loader was called with (positional, keyword, or, as vLLM's
    weights mapper does, an attribute of the loaded tensor)."""
    if args:
        return args[0]
    if "loaded_shard_id" in kwargs:
        return kwargs["loaded_shard_id"]
    return getattr(loaded, "shard_id", None)


class FP4RLLinearMethod(LinearMethodBase):
    """fp4rl's rollout-mode forward for one vLLM linear (merged or not)."""

    def __init__(self, recipe: Recipe, seed: int, storage: str = "dequantized") -> None:
        self.recipe = recipe
        self.seed = seed
        self.storage = storage

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        """A ``weight`` without storage until something is loaded into it, and, for a
        quantized layer, one empty parameter per packed field of its format."""
        weight_loader = _weak(extra_weight_attrs.pop("weight_loader"))
        r = self.recipe.rollout
        recovery = make_recovery(r.recovery, r.activations, input_size_per_partition,
                                 self.seed, weight_format=r.weights)
        partition = Partition(input_size, input_size_per_partition, output_size,
                              tuple(output_partition_sizes), weight_loader,
                              qkv=isinstance(layer, QKVParallelLinear))
        check_partition(partition, self.recipe)
        state = LayerState(list(output_partition_sizes), input_size_per_partition,
                           params_dtype, r.weights, self.storage, recovery,
                           TracedActivation(recovery), prepack=_engine_is_eager(),
                           partition=partition if partition.split else None)
        layer.fp4rl = state
        shape = (sum(state.shards), input_size_per_partition)
        owner = weakref.ref(layer)  # the loader lives on the layer's parameter (see _weak)

        def load_weight(param: torch.nn.Parameter, loaded: torch.Tensor, *args: Any,
                        **kwargs: Any) -> Any:
            if param.numel() == 0:
                param.data = torch.empty(shape, dtype=_staging_dtype(params_dtype, loaded),
                                         device=param.device)
            state.written |= state.parts_of(_shard_id(loaded, args, kwargs))
            out = weight_loader()(param, loaded, *args, **kwargs)
            layer = owner()
            if state.store is not None and len(state.written) == len(state.shards) and \
                    layer is not None and not in_layerwise_reload(layer):
                # a sync into a built engine: quantize this layer now and free its staged
                # weight, so that a sync in buckets (verl's) stages one bucket's layers, not
                # every layer until vLLM's processing at the end
                process(layer)
            return out

        weight = ModelWeightParameter(data=torch.empty(0, input_size_per_partition,
                                                       dtype=params_dtype),
                                      input_dim=1, output_dim=0, weight_loader=load_weight)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        if state.fmt == UNQUANTIZED:
            return
        for name in _field_names(state.fmt, input_size_per_partition):
            param = torch.nn.Parameter(torch.empty(0, dtype=_field_dtype(name)),
                                       requires_grad=False)
            set_weight_attrs(param, {"weight_loader": _field_loader(state, name)})
            layer.register_parameter(f"weight_{name}", param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        process(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """fp4rl's rollout forward as ``RolloutRecovery.forward`` computes it for the
        methods the plug-in runs (none, resq): the recovery's activation operands times
        ``Q(W)`` through :func:`fp4rl.gemm.mm`, the GEMM on vLLM's prepacked kernel where
        there is one. Capturable: it reads what processing fixed and changes nothing, and
        the quantizers run as one custom operator, so ``torch.compile`` and CUDA graphs
        trace it whole (``enforce_eager=False``)."""
        state: LayerState = layer.fp4rl
        if state.store is None:
            raise VLLMError(f"an fp4rl layer of {x.shape[-1]} inputs ran before vLLM "
                            "processed its weights")
        x2 = x.reshape(-1, x.shape[-1])
        # the plug-in's methods (none, resq) quantize bf16 rows as they are, in one kernel
        # pass (widening to float32 is exact, so the operands are the same)
        acts = state.activation(x2 if x.dtype == torch.bfloat16 else x2.float(), x.dtype)
        ys, start = [], 0
        for rows, qw, kernel in state.store.gemms():
            # several parts: per-shard scales (NVFP4), one GEMM per logical layer
            b = None if bias is None else bias[start:start + rows]
            ys.append(mm(acts, qw.t(), x.dtype, b, matmul=kernel))
            start += rows
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])


# ----- packed fields through vLLM's loader -------------------------------------------
_TENSOR_SCALE = "tensor_scale"


def _field_names(fmt: str, in_features: int) -> list[str]:
    """The packed fields of ``fmt`` (plus NVFP4's per-tensor scale)."""
    names = list(PackedOperand.layout(fmt, in_features).fields)
    return [*names, _TENSOR_SCALE] if has_tensor_scale(fmt) else names


def _field_dtype(name: str) -> torch.dtype:
    return torch.float32 if name == _TENSOR_SCALE else torch.uint8


def _field_loader(state: LayerState, name: str) -> Callable[..., None]:
    """A loader that keeps a packed field of one part until processing assembles it."""

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *args: Any,
             **kwargs: Any) -> None:
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
    state: LayerState = layer.fp4rl
    if state.partition is not None and len(parts) == len(state.shards):
        parts = [rank_part(state.partition, i, p) for i, p in enumerate(parts)]
    if [p.values.shape[0] if isinstance(p, Operand) else p.rows for p in parts] != state.shards:
        raise VLLMError(f"a refit sent parts of {len(parts)} layers for an fp4rl layer of "
                        f"parts {state.shards}")
    if state.storage == "packed" and state.fmt != UNQUANTIZED and \
            any(isinstance(p, Operand) for p in parts):
        raise VLLMError("an engine with weight_storage=packed keeps the 4-bit codes it is "
                        "sent: refit it with the packed wire (refit(..., packed=True), "
                        "rollout.vllm.refit_wire=packed)")
    state.ready = parts


def process(layer: torch.nn.Module) -> bool:
    """Store what arrived since the last call (ready parts, packed fields, or a plain
    weight, quantized here), freeing the weight; False when nothing arrived."""
    state: LayerState = layer.fp4rl
    parts = state.ready or _from_fields(state) or _from_weight(layer)
    state.ready, state.incoming, state.written = None, {}, set()
    declare_reload_weight(layer, (sum(state.shards), state.in_features))
    if layer.weight.numel():
        layer.weight.data = torch.empty(0, state.in_features, dtype=state.dtype,
                                        device=layer.weight.device)
        release_freed_memory()
    if parts is None:
        if state.store is None:  # nothing loaded yet (vLLM's "dummy" load format, which
            # verl starts from before its first sync): zero weights in the layer's own
            # layout until the first load, which then writes into the same tensors
            zeros = torch.zeros(sum(state.shards), state.in_features, dtype=state.dtype,
                                device=layer.weight.device)
            state.store = WeightStore.build(_quantized_parts(state, zeros, whole=False),
                                            state.storage, state.dtype, state.prepack)
        return False
    parts = [_on(p, layer.weight.device) for p in parts]
    new = WeightStore.build(parts, state.storage, state.dtype, state.prepack)
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


def _engine_is_eager() -> bool:
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
    parts = []
    for index, rows in enumerate(state.shards):
        fields = dict(state.incoming[index])
        scale = fields.pop(_TENSOR_SCALE, None)
        scale = None if scale is None else scale.reshape(())  # stored as [1], used as ()
        parts.append(PackedOperand.from_row_fields(state.fmt, (rows, state.in_features),
                                                   fields, scale))
    return parts


def _from_weight(layer: torch.nn.Module) -> list[Part] | None:
    """``Q(W)`` of every logical layer in the loaded weight (along in_features)."""
    state: LayerState = layer.fp4rl
    if not state.written:
        return None
    if state.written != set(range(len(state.shards))):
        raise VLLMError(f"vLLM processed a merged fp4rl layer (q/k/v or gate/up) with parts "
                        f"{sorted(state.written)} of {len(state.shards)} loaded: send all of "
                        "its parts before process_weights_after_loading")
    return _quantized_parts(state, layer.weight.detach())


def _quantized_parts(state: LayerState, w: torch.Tensor, whole: bool = True) -> list[Part]:
    """``Q(W)`` of each logical layer of ``w``, packed where the layer stores 4-bit codes;
    ``whole``: NVFP4's scale over the whole weight (of a rank's share, its ranks agree on
    it; zeros, as a dummy start holds, need no agreement)."""
    parts: list[Part] = []
    start = 0
    with torch.no_grad():
        for rows in state.shards:
            shard = w[start:start + rows]
            parts.append(state.recovery.weight_operand(
                shard, packed=state.storage == "packed",
                tensor_scale=_whole_scale(state, shard) if whole else None))
            start += rows
    return parts


def _whole_scale(state: LayerState, shard: torch.Tensor) -> torch.Tensor | None:
    """The per-tensor scale of the whole weight a rank's ``shard`` is part of (NVFP4 under
    tensor parallelism), or None where the shard's own is the whole's or there is none."""
    if state.partition is None or not has_tensor_scale(state.fmt):
        return None
    return get_format(state.fmt).tensor_scale(whole_amax(finite_amax(shard)))


def release_freed_memory() -> None:
    """Hand the load-time weights this process freed back to the system (glibc keeps freed
    blocks for reuse otherwise, and the engine would look as large as at its peak)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ----- the stores ----------------------------------------------------------------------
@dataclass
class WeightStore:
    """``Q(W)`` of one layer as the engine keeps it between weight versions."""

    storage: str
    dtype: torch.dtype
    parts: list[Part]
    #: dequantized: the GEMMs, ready (values dropped where a prepacked kernel holds them)
    ready: list[Gemm] | None = None

    @classmethod
    def build(cls, parts: list[Part], storage: str, dtype: torch.dtype,
              prepack: bool = True) -> WeightStore:
        dense = [p for p in parts if isinstance(p, Operand)]
        if storage == "packed" and not dense:
            return cls(storage, dtype, parts)
        operands = [p.to(dtype) if isinstance(p, Operand) else p.decode(dtype) for p in parts]
        return cls("dequantized", dtype, [], _gemms(operands, prepack))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a forward reads, in a fixed order."""
        if self.ready is None:
            return [t for p in self.parts for t in _part_tensors(p)]
        return [t for _, op, _ in self.ready for t in _part_tensors(op)]

    def refilled(self, new: WeightStore, in_place: bool = False) -> WeightStore:
        """This store holding ``new``'s weights, written into its own tensors where the
        layouts (shape, dtype, device of every tensor) agree, else ``new``. ``in_place``
        (a compiled engine: its forward, and the CUDA graphs captured from it, read the
        tensors they traced, at their addresses) refuses a layout change: swapping in
        new tensors would leave the graph reading the old weights, with no error."""
        mine, theirs = self.tensors(), new.tensors()
        prepacked = self.ready is not None and any(k is not None for _, _, k in self.ready)
        changed = self.storage != new.storage or len(mine) != len(theirs) or \
            any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                for a, b in zip(mine, theirs, strict=True))
        if changed and in_place:
            raise VLLMError("a refit changed the layout of a compiled engine's weights "
                            f"({_layout(mine)} -> {_layout(theirs)}); its captured forward "
                            "would keep reading the old ones: send Q(W) in the layout the "
                            "engine was built with, or build it with enforce_eager=True")
        if prepacked or changed:
            return new
        with torch.no_grad():
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b)
        return self

    def gemms(self) -> list[Gemm]:
        if self.ready is not None:
            return self.ready
        return [(rows, op, None) for rows, op in _joined([p.decode(self.dtype)
                                                          for p in self.parts])]


def _layout(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} {t.device}"
                     for t in tensors)


def _joined(operands: list[Operand]) -> list[tuple[int, Operand]]:
    """Parts without a per-tensor scale joined into one operand (one GEMM)."""
    if all(op.scale is None for op in operands):
        return [(sum(op.values.shape[0] for op in operands),
                 Operand(torch.cat([op.values for op in operands])))]
    return [(op.values.shape[0], op) for op in operands]


def _part_tensors(part: Part) -> list[torch.Tensor]:
    fields = [] if isinstance(part, Operand) else [part.packed.fields[n]
                                                   for n in sorted(part.packed.fields)]
    values = [part.values] if isinstance(part, Operand) else []
    return [*values, *fields, *([] if part.scale is None else [part.scale])]


def _gemms(operands: list[Operand], prepack: bool = True) -> list[Gemm]:
    """The dequantized GEMMs: with ``prepack``, each operand's values become vLLM's
    prepacked oneDNN weight where there is one (the values themselves are then dropped),
    else stay as they are."""
    out: list[Gemm] = []
    for rows, op in _joined(operands):
        kernel = _packed_matmul(op.values) if prepack else None
        if kernel is not None:
            op = Operand(op.values.new_empty(0, op.values.shape[1]), op.scale)
        out.append((rows, op, kernel))
    return out


def _packed_matmul(values: torch.Tensor
                   ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """``(rows, bias) -> rows @ values.T + bias`` on vLLM's oneDNN kernel with the weight
    prepacked once (the kernel vLLM's own bf16 linears use on CPU; the same bits as
    ``torch.addmm``, about twice as fast at decode sizes), or None where it does not
    apply."""
    if values.device.type != "cpu" or values.dtype != torch.bfloat16:
        return None
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        return None
    try:
        handle = ops.create_onednn_mm(values.t(), 32)
    except RuntimeError:  # a CPU oneDNN has no bf16 matmul for (avx2 only): torch's GEMM,
        return None       # as vLLM's own linears fall back to
    return lambda rows, bias: ops.onednn_mm(handle, rows, bias)


def store_bytes(model: torch.nn.Module) -> int:
    """Bytes the fp4rl layers' stores of an engine's model hold."""
    total = 0
    for m in model.modules():
        state = getattr(m, "fp4rl", None)
        if isinstance(state, LayerState) and state.store is not None:
            s = state.store
            if s.ready is None:
                total += sum(p.nbytes for p in s.parts)  # type: ignore[union-attr]
            else:
                total += sum(rows * state.in_features * s.dtype.itemsize
                             for rows, _, _ in s.ready)
    return total
