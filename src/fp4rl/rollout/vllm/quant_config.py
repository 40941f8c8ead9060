"""vLLM's side of the ``fp4rl`` quantization method's configuration (imported only where
vLLM is): :class:`FP4RLConfig` decides per layer. A linear inside a transformer block that
the recipe does not ignore gets :class:`~fp4rl.rollout.vllm.method.FP4RLLinearMethod` with
the recipe; other linears get it with the unquantized recipe (a plain GEMM, and a weight a
refit can still load, where vLLM's own CPU method repacks it away); embeddings and the LM
head are left to vLLM. What a ``quantization_config`` holds is :mod:`.config`'s."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from fp4rl.nn.recipe import Recipe
from fp4rl.nn.select import BLOCK_INDEX
from fp4rl.rollout.vllm.config import (
    QUANT_METHOD,
    WeightStorage,
    recipe_from_config,
    storage_from_config,
)
from fp4rl.rollout.vllm.errors import VLLMError
from fp4rl.rollout.vllm.method import FP4RLLinearMethod
from fp4rl.rollout.vllm.names import hf_layer_names


class FP4RLConfig(QuantizationConfig):
    """fp4rl's rollout recipe as a vLLM quantization config."""

    def __init__(self, recipe: Recipe,
                 weight_storage: WeightStorage = WeightStorage.DEQUANTIZED) -> None:
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
    def from_config(cls, config: Mapping[str, object]) -> FP4RLConfig:
        return cls(recipe_from_config(config), storage_from_config(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str
                         ) -> FP4RLLinearMethod | None:
        """fp4rl's method for a linear (None: vLLM's own for anything else). The Hugging
        Face layers a merged linear holds are the model's ``packed_modules_mapping``,
        which vLLM sets on this config before it builds the model."""
        if not isinstance(layer, LinearBase):
            return None
        names = hf_layer_names(prefix, self.packed_modules_mapping)
        ignored = [self.recipe.ignores(n, _block_count()) for n in names]
        self._layers += 1
        if BLOCK_INDEX.search(prefix) is None or all(ignored):
            # unquantized, but through this method: vLLM's own CPU method repacks the
            # weight and drops it, which a refit could not load into
            return FP4RLLinearMethod(Recipe(), self._layers - 1, self.weight_storage, names)
        if any(ignored):
            raise VLLMError(f"ignore leaves part of vLLM's merged linear {prefix} "
                            f"({', '.join(n for n, i in zip(names, ignored, strict=True) if i)})"
                            " unquantized; vLLM runs it as one layer: ignore all of "
                            f"{', '.join(names)} or none")
        return FP4RLLinearMethod(self.recipe, self._layers - 1, self.weight_storage, names)



def _block_count() -> int | None:
    """The transformer blocks of the model vLLM is building (an ``ignore`` such as
    ``last:0.15`` counts from the end), or None outside a build."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        return None
    model = config.model_config
    text = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    return getattr(text, "num_hidden_layers", None)


__all__ = ["FP4RLConfig"]
