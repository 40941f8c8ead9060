"""Rollout engines: sampling the rollout policy, with the log-probabilities GRPO needs.

One interface (:class:`RolloutEngine`: ``sync(model) -> metrics``,
``generate(chunks, seeds, sampling) -> batches``), two engines chosen by name
(:mod:`fp4rl.rollout.registry`): ``hf``, fp4rl's KV-cache engine on the Hugging Face model
(:mod:`fp4rl.rollout.kv_cache`), and ``vllm``, vLLM running the ``fp4rl`` quantization
method (:mod:`fp4rl.rollout.vllm`). The trainer, ``fp4rl bench rollout``, evaluation and
the TRL plug-in sample through it. This package sits below ``rl/`` and ``integrations/``
and imports neither.
"""

from fp4rl.rollout.base import ProgressFn, RolloutEngine, RolloutSetup, settings_as
from fp4rl.rollout.batch import (
    RolloutBatch,
    SamplingConfig,
    concat_batches,
    left_pad,
    position_ids,
)
from fp4rl.rollout.kv_cache import KVCacheEngine, generate
from fp4rl.rollout.registry import (
    EngineError,
    build_engine,
    check_invariant_engine,
    engine_name,
    get_engine,
    list_engines,
    register_engine,
    resolve_engine,
)
from fp4rl.rollout.sampling import row_generators, sample_next, sample_seed
from fp4rl.rollout.vllm.engine import VLLMEngine

__all__ = ["EngineError", "KVCacheEngine", "ProgressFn", "RolloutBatch",
           "RolloutEngine", "RolloutSetup", "SamplingConfig", "VLLMEngine", "build_engine",
           "check_invariant_engine", "concat_batches", "engine_name", "generate", "get_engine",
           "left_pad", "list_engines", "position_ids", "register_engine", "resolve_engine",
           "row_generators", "sample_next", "sample_seed", "settings_as"]
