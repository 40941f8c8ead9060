"""The vLLM classes of the ``fp4rl`` quantization method (imported only where vLLM is).

:class:`FP4RLConfig` decides per layer: a linear inside a transformer block that the
recipe does not ignore gets :class:`FP4RLLinearMethod` with the recipe; other linears get
it with the unquantized recipe (a plain GEMM, and a weight a refit can still load, where
vLLM's own CPU method repacks it away); embeddings and the LM head are left to vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from fp4rl.gemm import Operand, mm, quantize_operand
from fp4rl.integrations.vllm import QUANT_METHOD, VLLMError, hf_layer_names, recipe_from_config
from fp4rl.nn.patch import BLOCK_PREFIX
from fp4rl.nn.recipe import Recipe
from fp4rl.recovery import RolloutRecovery, make_recovery


class FP4RLConfig(QuantizationConfig):
    """fp4rl's rollout recipe as a vLLM quantization config."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.recipe = recipe
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
        return cls(recipe_from_config(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if not isinstance(layer, LinearBase):
            return None
        names = hf_layer_names(prefix)
        ignored = [self.recipe.ignores(n) for n in names]
        self._layers += 1
        if BLOCK_PREFIX.search(prefix) is None or all(ignored):
            # unquantized, but through this method: vLLM's own CPU method repacks the
            # weight and drops it, which a refit could not load into
            return FP4RLLinearMethod(Recipe(), seed=self._layers - 1)
        if any(ignored):
            raise VLLMError(f"ignore leaves part of vLLM's merged linear {prefix} "
                            f"({', '.join(n for n, i in zip(names, ignored, strict=True) if i)})"
                            " unquantized; vLLM runs it as one layer: ignore all of "
                            f"{', '.join(names)} or none")
        return FP4RLLinearMethod(self.recipe, seed=self._layers - 1)


class FP4RLLinearMethod(LinearMethodBase):
    """fp4rl's rollout-mode forward for one vLLM linear (merged or not)."""

    def __init__(self, recipe: Recipe, seed: int) -> None:
        self.recipe = recipe
        self.seed = seed

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        """An unquantized weight, but in float32 (the trainer's master precision)."""
        weight_loader = extra_weight_attrs.pop("weight_loader")
        data = torch.empty(sum(output_partition_sizes), input_size_per_partition,
                           dtype=torch.float32)
        weight = ModelWeightParameter(data=data, input_dim=1, output_dim=0,
                                      weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        r = self.recipe.rollout
        layer.fp4rl_shards = list(output_partition_sizes)
        layer.fp4rl_recovery = make_recovery(r.recovery, r.activations,
                                             input_size_per_partition, self.seed,
                                             weight_format=r.weights)
        layer.fp4rl_weight = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        requantize(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """fp4rl's rollout forward as ``RolloutRecovery.forward`` computes it for the
        methods the plug-in runs (none, resq): the recovery's activation operands times
        ``Q(W)`` through :func:`fp4rl.gemm.mm`, the GEMM on vLLM's prepacked kernel where
        there is one."""
        recovery: RolloutRecovery = layer.fp4rl_recovery
        x2 = x.reshape(-1, x.shape[-1])
        # the plug-in's methods (none, resq) quantize bf16 rows as they are, in one kernel
        # pass (widening to float32 is exact, so the operands are the same)
        acts = recovery.activation(x2 if x.dtype == torch.bfloat16 else x2.float(), x.dtype)
        ys, start = [], 0
        for rows, qw, kernel in _weight_in(layer, x.dtype):
            # several parts: per-shard scales (NVFP4), one GEMM per logical layer
            b = None if bias is None else bias[start:start + rows]
            ys.append(mm(acts, qw.t(), x.dtype, b, matmul=kernel))
            start += rows
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def requantize(layer: torch.nn.Module) -> None:
    """``Q(W)`` of every logical layer in ``layer`` (along in_features), cached in the
    compute-ready form; shards without a per-tensor scale are joined into one operand."""
    recovery: RolloutRecovery = layer.fp4rl_recovery
    fmt = recovery.weight_format
    w = layer.weight.detach()
    parts, start = [], 0
    with torch.no_grad():
        for rows in layer.fp4rl_shards:
            shard = recovery.transform_weight(w[start:start + rows])
            parts.append((rows, quantize_operand(shard, fmt, -1)))
            start += rows
    if all(q.scale is None for _, q in parts):
        parts = [(start, Operand(torch.cat([q.values for _, q in parts])))]
    layer.fp4rl_weight = parts
    layer.fp4rl_weight_cast = {}


Part = tuple[int, Operand, "Callable[[torch.Tensor], torch.Tensor] | None"]


def _weight_in(layer: torch.nn.Module, dtype: torch.dtype) -> list[Part]:
    """The cached ``Q(W)`` parts in the compute dtype (cast once per weight version; FP4
    values are exact in bf16), each with vLLM's prepacked GEMM of it where vLLM has one."""
    cast = layer.fp4rl_weight_cast
    if dtype not in cast:
        cast[dtype] = [(rows, q.to(dtype), _packed_matmul(q.values.to(dtype)))
                       for rows, q in layer.fp4rl_weight]
    return cast[dtype]


def _packed_matmul(values: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``rows -> rows @ values.T`` on vLLM's oneDNN kernel with the weight prepacked once
    (the kernel vLLM's own bf16 linears use on CPU; the same bits as ``torch.matmul``, about
    twice as fast at decode sizes), or None where it does not apply."""
    if values.device.type != "cpu" or values.dtype != torch.bfloat16:
        return None
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        return None
    handle = ops.create_onednn_mm(values.t(), 32)
    return lambda rows: ops.onednn_mm(handle, rows, None)


def requantize_model(model: torch.nn.Module) -> int:
    """Re-quantize every fp4rl layer of an engine's model (after new weights were
    loaded); returns how many."""
    count = 0
    for module in model.modules():
        if getattr(module, "fp4rl_shards", None) is not None:
            requantize(module)
            count += 1
    return count
