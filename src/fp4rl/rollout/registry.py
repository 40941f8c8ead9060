"""The rollout engines by name: ``hf`` (fp4rl's KV-cache engine) and ``vllm`` (vLLM with
the fp4rl quantization method); ``auto`` picks by what each engine says of itself (its
``auto_priority`` and whether it ``serves`` the run's recipe on its device: vLLM on a GPU
where it is installed, else ``hf``), and batch invariance takes an engine that says it is
batch-invariant. No rule here names an engine. The training config's
``rollout.engine``, ``fp4rl demo --rollout-engine``, ``fp4rl bench rollout --engine`` and
the TRL plug-in's ``fp4_rollout_engine`` all read names from here; an engine of one's own
registers with :func:`register_engine` and is then accepted wherever those are."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp4rl.errors import UserError
from fp4rl.registry import Registry
from fp4rl.rollout.base import RolloutEngine, RolloutSetup
from fp4rl.rollout.kv_cache import KVCacheEngine
from fp4rl.rollout.vllm.engine import VLLMEngine

if TYPE_CHECKING:
    from fp4rl.nn.recipe import Recipe


class EngineError(UserError):
    """An engine name that names no engine, or one taken twice."""


_ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine", EngineError)
#: what an engine says of itself, which the schema, the plan and the TRL plug-in ask
CAPABILITIES = ("summary", "settings", "batch_invariant", "auto_priority", "auto_when",
                "samples_module", "serves", "settle", "check_config", "check")


def register_engine(engine: type[RolloutEngine], *, replace: bool = False
                    ) -> type[RolloutEngine]:
    """Make ``engine`` (a class with the :class:`RolloutEngine` methods) the engine called
    ``engine.name``; a name already taken is refused unless ``replace``. Usable as a class
    decorator."""
    name = getattr(engine, "name", None)
    if not isinstance(name, str) or not name:
        raise EngineError(f"a rollout engine needs a name of its own, got {name!r}")
    missing = [a for a in CAPABILITIES if not hasattr(engine, a)]
    if missing:
        raise EngineError(f"rollout engine {name!r} does not say {', '.join(missing)}: a "
                          "RolloutEngine declares each (fp4rl.rollout.base)")
    return _ENGINES.register(name, engine, replace=replace)


def list_engines() -> list[str]:
    """Engine names, in registration order (``hf`` first)."""
    return _ENGINES.names()


#: the engine a user would pick on the run's device (:func:`resolve_engine`)
AUTO = "auto"
#: the engine a config that names none runs: fp4rl's own, which runs every recipe anywhere
DEFAULT_ENGINE = KVCacheEngine.name


def _by_priority(batch_invariant: bool = False) -> list[type[RolloutEngine]]:
    """The engines ``auto`` may pick, highest :attr:`~RolloutEngine.auto_priority` first
    (under ``batch_invariant`` the batch-invariant ones alone)."""
    engines = [_ENGINES.get(n) for n in _ENGINES.names()]
    return sorted((e for e in engines if e.batch_invariant or not batch_invariant),
                  key=lambda e: -e.auto_priority)


def auto_picks() -> str:
    """What :data:`AUTO` picks, as ``fp4rl train --help-config`` says it: each engine's
    :attr:`~RolloutEngine.auto_when`, by priority (a registered engine is in it)."""
    return ", else ".join(f"{e.name} {e.auto_when}".strip() for e in _by_priority())


def engine_name(name: str) -> str:
    """``name`` itself where it names an engine or ``auto``; else one line listing them."""
    if name != AUTO:
        _ENGINES.get(name)
    return name


def check_invariant_engine(name: str, setting: str = "batch_invariant=true",
                           own: str = "set rollout.engine to {fit}") -> None:
    """Refuse, in one line, batch invariance (``setting``, as the entry point spells it)
    with an engine that is not batch-invariant (:attr:`RolloutEngine.batch_invariant`:
    only fp4rl's own forward runs the patched model's fixed-order kernels; ``own`` says
    what to do in the entry point's words, ``{fit}`` standing for the engines that are).
    ``auto`` is fine: under batch invariance it picks a batch-invariant engine
    (:func:`resolve_engine`). The one place the rule is
    written: the config's check, the run's plan and the TRL trainer call it."""
    if name == AUTO or get_engine(name).batch_invariant:
        return
    fit = ", ".join(e.name for e in _by_priority(batch_invariant=True))
    raise EngineError(f"{setting} runs a batch-invariant engine ({own.format(fit=fit)}), "
                      f"not {name}, whose forward is not fp4rl's fixed-order one (vLLM's "
                      "has a batch-invariant mode of its own: VLLM_BATCH_INVARIANT=1, on a "
                      "GPU)")


def resolve_engine(name: str, device: torch.device, recipe: Recipe,
                   batch_invariant: bool = False) -> str:
    """The engine ``name`` stands for on ``device``: itself, or for ``auto`` the engine of
    highest :attr:`~RolloutEngine.auto_priority` that :meth:`~RolloutEngine.serves`
    ``recipe`` there (:func:`auto_picks`); under ``batch_invariant`` a batch-invariant
    one, another named engine refused (:func:`check_invariant_engine`)."""
    if batch_invariant:
        check_invariant_engine(name)
    if name != AUTO:
        return get_engine(name).name  # an alias names its engine
    for engine in _by_priority(batch_invariant):
        if engine.serves(recipe, device):
            return engine.name
    raise EngineError(f"rollout.engine=auto: no registered engine serves this run on "
                      f"{device}; name one of {', '.join(list_engines())}")


def get_engine(name: str) -> type[RolloutEngine]:
    """The engine class called ``name``."""
    return _ENGINES.get(name)


def build_engine(name: str, setup: RolloutSetup) -> RolloutEngine:
    """The engine ``name`` serving ``setup``'s rollout policy."""
    return get_engine(name).from_setup(setup)


register_engine(KVCacheEngine)
register_engine(VLLMEngine)
