"""The ``fp4rl`` vLLM quantization method's configuration: what a ``quantization_config``
holds, how it is checked, and the rollouts the method can run.

A checkpoint selects the method with ``quantization_config`` in its ``config.json``::

    {"quant_method": "fp4rl",
     "rollout": {"weights": "hif4", "activations": "hif4",
                 "recovery": {"method": "resq", "sparsity": "2:4"}},
     "ignore": [], "weight_storage": "dequantized"}

Recovery methods that keep calibration state or read the high-precision weight
(SmoothQuant, RHT, OCC, ResQ-W) are refused with one line: fp4rl's own engine runs them.
Nothing here imports vLLM. The plug-in's error type is in :mod:`.errors`, what a host
sets for the engine in :mod:`.host`, and which Hugging Face layers a merged vLLM linear
holds is vLLM's own model's ``packed_modules_mapping`` (:mod:`.names`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypedDict

from pydantic import JsonValue

from fp4rl.formats import NumberFormat
from fp4rl.formats.registry import scale_rules
from fp4rl.nn.recipe import Recipe, as_recipe
from fp4rl.recovery import get_recovery, list_recoveries
from fp4rl.rollout.vllm.errors import VLLMError
from fp4rl.rollout.vllm.host import check_actor_recipe
from fp4rl.version import __version__

#: the name vLLM knows the method by (``quant_method`` in config.json)
QUANT_METHOD = "fp4rl"


class WeightStorage(StrEnum):
    """How an engine keeps ``Q(W)`` between weight versions: its values in the compute
    dtype (vLLM's own GEMM), or the format's 4-bit codes and scales, decoded at each
    forward. A member equals its value, the spelling configs use."""

    DEQUANTIZED = "dequantized"
    PACKED = "packed"


class RefitWire(StrEnum):
    """How ``Q(W)`` travels to an engine at a refit: the format's 4-bit codes and scales,
    or their values in bf16 (the dtype of the message, not the ``bf16`` number format)."""

    PACKED = "packed"
    BF16 = "bf16"


#: the storages' spellings, in the order configs list them (the first is the default)
WEIGHT_STORAGES = tuple(s.value for s in WeightStorage)
#: the keys of a ``quantization_config`` of this method
CONFIG_KEYS = ("quant_method", "rollout", "ignore", "weight_storage", "fp4rl_version")


def rollout_recipe(recipe: Recipe) -> Recipe:
    """``recipe`` checked for what the plug-in runs."""
    method = recipe.rollout.recovery.method
    if not get_recovery(method).serves_in_engines:
        raise VLLMError(f"rollout recovery {method!r} cannot run inside vLLM: the vLLM "
                        f"plug-in supports {', '.join(supported_recovery())} (ResQ with "
                        "dense, n:m, channel or block sparsity); use rollout.engine=hf for "
                        f"{method}")
    act = recipe.rollout.activations
    if isinstance(act, NumberFormat) and act.fixed_scale:
        others = " or ".join(r for r in scale_rules(act) if r != act.scale_rule)
        raise VLLMError(f"rollout activations {act} need the layer's fixed scale, which the "
                        "vLLM plug-in does not keep (it scales each call's activations): use "
                        f"rollout.engine=hf, or nvfp4_scale={others}")
    return recipe


def supported_recovery() -> list[str]:
    """The recovery methods the plug-in runs: those whose class says it serves in
    engines (``RolloutRecovery.serves_in_engines``)."""
    return [m for m in list_recoveries() if get_recovery(m).serves_in_engines]


class QuantizationEntry(TypedDict):
    """A config.json's ``quantization_config`` entry for fp4rl's method (what
    :func:`recipe_from_config` and :func:`storage_from_config` read back)."""

    quant_method: str
    rollout: dict[str, JsonValue]
    ignore: list[str]
    weight_storage: str
    fp4rl_version: str


def quantization_config(recipe: Recipe | str,
                        weight_storage: WeightStorage | str = WeightStorage.DEQUANTIZED
                        ) -> QuantizationEntry:
    """The ``quantization_config`` entry of a config.json that makes vLLM run ``recipe``'s
    rollout policy, keeping ``Q(W)`` as ``weight_storage`` says."""
    recipe = rollout_recipe(as_recipe(recipe))
    check_storage(weight_storage)
    return QuantizationEntry(quant_method=QUANT_METHOD, rollout=recipe.to_dict()["rollout"],
                              ignore=list(recipe.ignore), weight_storage=str(weight_storage),
                              fp4rl_version=__version__)


def check_storage(weight_storage: object) -> WeightStorage:
    """``weight_storage`` as a :class:`WeightStorage`; else one line with the choices."""
    try:
        return WeightStorage(str(weight_storage))
    except ValueError:
        raise VLLMError(f"weight_storage must be one of {', '.join(WEIGHT_STORAGES)}, got "
                        f"{weight_storage!r}") from None


def recipe_from_config(config: object) -> Recipe:
    """The rollout recipe a ``quantization_config`` entry holds (training side unset)."""
    if not isinstance(config, Mapping) or "rollout" not in config:
        raise VLLMError(f"quantization_config for {QUANT_METHOD!r} needs a 'rollout' "
                        f"mapping (weights, activations, recovery), got {config!r}")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise VLLMError(f"quantization_config for {QUANT_METHOD!r}: unknown key(s) {unknown}; "
                        f"allowed: {', '.join(CONFIG_KEYS)}")
    recipe = Recipe.from_dict({"rollout": config["rollout"], "ignore": config.get("ignore")})
    check_actor_recipe(recipe)
    return rollout_recipe(recipe)


def storage_from_config(config: Mapping[str, object]) -> WeightStorage:
    """The ``weight_storage`` a ``quantization_config`` entry asks for (default
    ``dequantized``)."""
    return check_storage(config.get("weight_storage", WeightStorage.DEQUANTIZED))
