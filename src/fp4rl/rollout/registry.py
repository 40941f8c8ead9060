"""The rollout engines by name: ``hf`` (fp4rl's KV-cache engine, also accepted as
``fp4rl``) and ``vllm`` (vLLM with the fp4rl quantization method). The training config's
``rollout.engine``, ``fp4rl demo --rollout-engine``, ``fp4rl bench rollout --engine`` and
the TRL plug-in's ``fp4_rollout_engine`` all read names from here."""

from __future__ import annotations

from fp4rl.errors import UserError, did_you_mean
from fp4rl.rollout.base import RolloutEngine, RolloutSetup
from fp4rl.rollout.kv_cache import KVCacheEngine
from fp4rl.rollout.vllm.engine import VLLMEngine

#: every engine, by its one name
ENGINES: dict[str, type[RolloutEngine]] = {e.name: e for e in (KVCacheEngine, VLLMEngine)}
#: other names accepted for an engine (the TRL plug-in's earlier name for fp4rl's own)
ALIASES = {"fp4rl": "hf"}


class EngineError(UserError):
    """An engine name that names no engine."""


def engine_name(name: str) -> str:
    """The engine's one name for ``name`` (an engine or an alias); else one line listing
    them."""
    name = ALIASES.get(name, name)
    if name not in ENGINES:
        raise EngineError(f"unknown rollout engine {name!r}: choose from "
                          f"{', '.join(ENGINES)}{did_you_mean(name, [*ENGINES, *ALIASES])}")
    return name


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class ``name`` (or an alias) stands for."""
    return ENGINES[engine_name(name)]


def build_engine(name: str, setup: RolloutSetup) -> RolloutEngine:
    """The engine ``name`` serving ``setup``'s rollout policy."""
    return engine_class(name).from_setup(setup)
