"""Registering the ``fp4rl`` quantization method with vLLM: the target of the
``vllm.general_plugins`` entry point, which vLLM calls in every one of its processes."""

from __future__ import annotations

from fp4rl.rollout.vllm.compat import check_version
from fp4rl.rollout.vllm.config import QUANT_METHOD
from fp4rl.rollout.vllm.errors import require_vllm

_REGISTERED = False


def register() -> None:
    """Register the ``fp4rl`` quantization method with vLLM (idempotent): the target of
    the ``vllm.general_plugins`` entry point."""
    global _REGISTERED
    if _REGISTERED:
        return
    require_vllm()
    check_version()
    from vllm.model_executor.layers.quantization import register_quantization_config

    from fp4rl.rollout.vllm.quant_config import FP4RLConfig

    register_quantization_config(QUANT_METHOD)(FP4RLConfig)
    _REGISTERED = True
