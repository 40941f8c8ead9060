"""The vLLM linear method of the ``fp4rl`` quantization method (imported only where vLLM
is), as vLLM's own quantization methods are built: the config (:mod:`.quant_config`)
picks a method per layer, and the method hands each of vLLM's three calls
(``create_weights``, ``process_weights_after_loading``, ``apply``) to one scheme object,
:class:`FP4RLScheme`: the parameters a layer registers, the rollout-mode forward. What
differs between weight storages (how ``Q(W)`` is made from a loaded weight, what a refit
may send, which store keeps it) is the layer's layout (:mod:`.layouts`). The calls run one
way: the scheme hands processing to :mod:`.loading`, which asks the layout, and neither
calls the scheme back; :mod:`.stores` keeps ``Q(W)``."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, QKVParallelLinear
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from fp4rl.formats import NumberFormat
from fp4rl.nn.recipe import Recipe
from fp4rl.recovery import make_recovery
from fp4rl.recovery.ops import TracedActivation
from fp4rl.rollout.vllm.compat import WeightLoader
from fp4rl.rollout.vllm.config import WeightStorage
from fp4rl.rollout.vllm.errors import VLLMError
from fp4rl.rollout.vllm.layouts import LAYOUTS
from fp4rl.rollout.vllm.loading import (
    LayerState,
    engine_is_eager,
    field_dtype,
    field_loader,
    field_names,
    layer_state,
    process,
    weak_loader,
    weight_loader_of,
)
from fp4rl.rollout.vllm.sharding import Partition, check_partition


class FP4RLScheme:
    """The fp4rl method for one vLLM linear (merged or not), in one weight storage: vLLM's
    three calls."""

    def __init__(self, recipe: Recipe, seed: int, hf_names: tuple[str, ...] = (),
                 storage: WeightStorage = WeightStorage.DEQUANTIZED) -> None:
        """``hf_names``: the Hugging Face layers the linear stands for, in row order (a
        refit sends ``Q(W)`` by those names); ``storage``: how its layers keep ``Q(W)``."""
        self.recipe = recipe
        self.seed = seed
        self.hf_names = hf_names
        self.layout = LAYOUTS[storage]

    # ----- vLLM's calls ----------------------------------------------------------------
    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader,
                       extra_weight_attrs: dict[str, object]) -> None:
        """A ``weight`` without storage until something is loaded into it, and, for a
        quantized layer, one empty parameter per packed field of its format (an fp4rl
        export's fields, in either layout)."""
        loader = weak_loader(weight_loader)
        r = self.recipe.rollout
        recovery = make_recovery(r.recovery, r.activations, input_size_per_partition,
                                 self.seed, weight_format=r.weights)
        partition = Partition(input_size, input_size_per_partition, output_size,
                              tuple(output_partition_sizes), loader,
                              qkv=isinstance(layer, QKVParallelLinear))
        check_partition(partition, self.recipe)
        state = LayerState(list(output_partition_sizes), input_size_per_partition,
                           params_dtype, r.weights, self.layout, recovery,
                           TracedActivation(recovery),
                           # a prepacked kernel returns rounded products: one unscaled
                           # activation operand only (not ResQ's two terms in bf16)
                           prepack=engine_is_eager() and
                           recovery.activation_scales(params_dtype) == (False,),
                           partition=partition if partition.split else None,
                           hf_names=self.hf_names)
        layer.fp4rl = state  # type: ignore[assignment]  # fp4rl's state on vLLM's layer
        weight = ModelWeightParameter(data=torch.empty(0, input_size_per_partition,
                                                       dtype=params_dtype),
                                      input_dim=1, output_dim=0,
                                      weight_loader=weight_loader_of(layer, loader))
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        if not isinstance(state.fmt, NumberFormat):  # a W16 rollout: the weight is all
            return
        for name in field_names(state.fmt, input_size_per_partition):
            param = torch.nn.Parameter(torch.empty(0, dtype=field_dtype(name)),
                                       requires_grad=False)
            set_weight_attrs(param, {"weight_loader": field_loader(state, name)})
            layer.register_parameter(f"weight_{name}", param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        process(layer)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """fp4rl's rollout forward as ``RolloutRecovery.forward`` computes it for the
        methods the plug-in runs (none, resq): the recovery's activation operands times
        ``Q(W)`` as the layer's store multiplies them (``WeightStore.apply``: the GEMM on
        vLLM's prepacked kernel where there is one; packed codes decoded in registers at
        decode sizes on a GPU). Capturable: it reads what processing fixed and changes
        nothing, and the quantizers and the packed GEMM run as custom operators, so
        ``torch.compile`` and CUDA graphs trace it whole (``enforce_eager=False``)."""
        state = layer_state(layer)
        if state.store is None:
            raise VLLMError(f"an fp4rl layer of {x.shape[-1]} inputs ran before vLLM "
                            "processed its weights")
        x2 = x.reshape(-1, x.shape[-1])
        # the plug-in's methods (none, resq) quantize bf16 rows as they are, in one kernel
        # pass (widening to float32 is exact, so the operands are the same)
        acts = state.activation(x2 if x.dtype == torch.bfloat16 else x2.float(), x.dtype,
                                packed=state.store.takes_nm())
        y = state.store.apply(acts, x.dtype, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

class FP4RLLinearMethod(LinearMethodBase):
    """fp4rl's rollout-mode linear method: vLLM's calls handed to the scheme of the
    layer's weight storage (``scheme``)."""

    def __init__(self, recipe: Recipe, seed: int,
                 storage: WeightStorage = WeightStorage.DEQUANTIZED,
                 hf_names: tuple[str, ...] = ()) -> None:
        self.scheme = FP4RLScheme(recipe, seed, hf_names, storage)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, *, weight_loader: WeightLoader,
                       **extra_weight_attrs: object) -> None:
        self.scheme.create_weights(layer, input_size_per_partition, output_partition_sizes,
                                   input_size, output_size, params_dtype, weight_loader,
                                   extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.scheme.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.apply_weights(layer, x, bias)


__all__ = ["FP4RLLinearMethod", "FP4RLScheme"]
