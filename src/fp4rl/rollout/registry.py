"""The rollout engines by name: ``hf`` (fp4rl's KV-cache engine, also accepted as
``fp4rl``) and ``vllm`` (vLLM with the fp4rl quantization method). The training config's
``rollout.engine``, ``fp4rl demo --rollout-engine``, ``fp4rl bench rollout --engine`` and
the TRL plug-in's ``fp4_rollout_engine`` all read names from here; an engine of one's own
registers with :func:`register_engine` and is then accepted wherever those are."""

from __future__ import annotations

from fp4rl.errors import UserError
from fp4rl.registry import Registry
from fp4rl.rollout.base import RolloutEngine, RolloutSetup
from fp4rl.rollout.kv_cache import KVCacheEngine
from fp4rl.rollout.vllm.engine import VLLMEngine


class EngineError(UserError):
    """An engine name that names no engine, or one taken twice."""


_ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine", EngineError)
#: other names accepted for an engine (the TRL plug-in's earlier name for fp4rl's own)
ALIASES = {"fp4rl": "hf"}


def register_engine(engine: type[RolloutEngine], *, replace: bool = False
                    ) -> type[RolloutEngine]:
    """Make ``engine`` (a class with the :class:`RolloutEngine` methods) the engine called
    ``engine.name``; a name already taken is refused unless ``replace``. Usable as a class
    decorator."""
    name = getattr(engine, "name", None)
    if not isinstance(name, str) or not name or name in ALIASES:
        raise EngineError(f"a rollout engine needs a name of its own, got {name!r}")
    return _ENGINES.register(name, engine, replace=replace)


def list_engines() -> list[str]:
    """Engine names, in registration order (``hf`` first)."""
    return _ENGINES.names()


def engine_name(name: str) -> str:
    """The engine's one name for ``name`` (an engine or an alias); else one line listing
    them."""
    name = ALIASES.get(name, name)
    _ENGINES.get(name)
    return name


def get_engine(name: str) -> type[RolloutEngine]:
    """The engine class ``name`` (or an alias) stands for."""
    return _ENGINES.get(ALIASES.get(name, name))


def build_engine(name: str, setup: RolloutSetup) -> RolloutEngine:
    """The engine ``name`` serving ``setup``'s rollout policy."""
    return get_engine(name).from_setup(setup)


register_engine(KVCacheEngine)
register_engine(VLLMEngine)
