"""The rollout engines by name: ``hf`` (fp4rl's KV-cache engine) and ``vllm`` (vLLM with
the fp4rl quantization method); ``auto`` picks vLLM on a GPU where it is installed, else
``hf``. The training config's
``rollout.engine``, ``fp4rl demo --rollout-engine``, ``fp4rl bench rollout --engine`` and
the TRL plug-in's ``fp4_rollout_engine`` all read names from here; an engine of one's own
registers with :func:`register_engine` and is then accepted wherever those are."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from fp4rl.errors import UserError
from fp4rl.registry import Registry
from fp4rl.rollout.base import RolloutEngine, RolloutSetup
from fp4rl.rollout.kv_cache import KVCacheEngine
from fp4rl.rollout.vllm.config import rollout_recipe
from fp4rl.rollout.vllm.engine import VLLMEngine
from fp4rl.rollout.vllm.errors import VLLMError

if TYPE_CHECKING:
    from fp4rl.nn.recipe import Recipe


class EngineError(UserError):
    """An engine name that names no engine, or one taken twice."""


_ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine", EngineError)


def register_engine(engine: type[RolloutEngine], *, replace: bool = False
                    ) -> type[RolloutEngine]:
    """Make ``engine`` (a class with the :class:`RolloutEngine` methods) the engine called
    ``engine.name``; a name already taken is refused unless ``replace``. Usable as a class
    decorator."""
    name = getattr(engine, "name", None)
    if not isinstance(name, str) or not name:
        raise EngineError(f"a rollout engine needs a name of its own, got {name!r}")
    return _ENGINES.register(name, engine, replace=replace)


def list_engines() -> list[str]:
    """Engine names, in registration order (``hf`` first)."""
    return _ENGINES.names()


#: the engine a user would pick on the run's device (:func:`resolve_engine`)
AUTO = "auto"
#: the engine a config that names none runs: fp4rl's own, which runs every recipe anywhere
DEFAULT_ENGINE = KVCacheEngine.name
#: what :data:`AUTO` picks, as ``fp4rl train --help-config`` says it
AUTO_PICKS = "vllm on a CUDA device where vLLM is installed and runs the recipe's rollout, else hf"


def engine_name(name: str) -> str:
    """``name`` itself where it names an engine or ``auto``; else one line listing them."""
    if name != AUTO:
        _ENGINES.get(name)
    return name


def check_invariant_engine(name: str, setting: str = "batch_invariant=true",
                           own: str = f"rollout.engine={KVCacheEngine.name}") -> None:
    """Refuse, in one line, batch invariance (``setting``, as the entry point spells it)
    with an engine other than fp4rl's own (``own``, as the entry point spells that): only
    its forward runs the patched model's fixed-order kernels; vLLM's forward has a
    batch-invariant mode of its own. ``auto`` is fine: under batch invariance it picks
    fp4rl's engine (:func:`resolve_engine`). The one place the rule is written: the
    config's check, the run's plan and the TRL trainer call it."""
    if name != AUTO and get_engine(name).name != KVCacheEngine.name:  # an alias is fine
        raise EngineError(f"{setting} runs fp4rl's own engine ({own}), not {name}: vLLM's "
                          "forward has a batch-invariant mode of its own "
                          "(VLLM_BATCH_INVARIANT=1, on a GPU)")


def resolve_engine(name: str, device: torch.device, recipe: Recipe,
                   batch_invariant: bool = False) -> str:
    """The engine ``name`` stands for on ``device``: itself, or for ``auto`` vLLM on a
    CUDA device where vLLM is installed and its plug-in runs ``recipe``'s rollout (what
    users run on GPUs), else fp4rl's own engine; under ``batch_invariant`` fp4rl's own,
    another named engine refused (:func:`check_invariant_engine`)."""
    if batch_invariant:
        check_invariant_engine(name)
        return KVCacheEngine.name
    if name != AUTO:
        return engine_name(name)
    if device.type != "cuda" or importlib.util.find_spec("vllm") is None:
        return KVCacheEngine.name
    try:
        rollout_recipe(recipe)
    except VLLMError:
        return KVCacheEngine.name
    return VLLMEngine.name


def get_engine(name: str) -> type[RolloutEngine]:
    """The engine class called ``name``."""
    return _ENGINES.get(name)


def build_engine(name: str, setup: RolloutSetup) -> RolloutEngine:
    """The engine ``name`` serving ``setup``'s rollout policy."""
    return get_engine(name).from_setup(setup)


register_engine(KVCacheEngine)
register_engine(VLLMEngine)
