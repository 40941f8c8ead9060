"""FP4 rollout inside vLLM: fp4rl's rollout policy as a vLLM quantization method.

vLLM (and the vLLM inside TRL, verl, OpenRLHF) finds the method through the
``vllm.general_plugins`` entry point, which calls :func:`register` in every vLLM process.
A checkpoint selects it with ``quantization_config`` in its ``config.json``::

    {"quant_method": "fp4rl",
     "rollout": {"weights": "hif4", "activations": "hif4",
                 "recovery": {"method": "resq", "sparsity": "2:4"}},
     "ignore": [], "weight_storage": "dequantized"}

(:func:`quantization_config` builds it; ``fp4rl export --format vllm`` writes it), or an
engine is built with ``LLM(..., quantization="fp4rl", hf_overrides={"quantization_config":
...})`` (:func:`make_llm`). Every linear that fp4rl patches (those inside transformer
blocks) then runs fp4rl's rollout mode with fp4rl's own code: ``Q(W)`` once per weight
version along in_features, ``Q(X)`` per call plus the recovery term, the GEMM in the
activation dtype (bf16 on FP4 operands that bf16 holds exactly, fp32 accumulation).
Merged linears (``qkv_proj``, ``gate_up_proj``) quantize each logical layer's rows on
their own, so NVFP4's per-tensor scale is the one fp4rl's separate layer would have.

No layer holds FP32: ``weight_storage`` ``dequantized`` (the default) keeps ``Q(W)``
once in the compute dtype (on a CPU, as vLLM's prepacked GEMM weight: no more memory
than a bf16 engine), ``packed`` the format's 4-bit codes and scales, decoded per forward.
:func:`refit` hands a running engine the ``Q(W)`` the trainer computed from its FP32
masters, through vLLM's ``collective_rpc`` and fp4rl's worker extension, so it works
whether the engine core runs in this process or in its own; the engine installs it
without re-quantizing.

Recovery methods that keep calibration state or read the high-precision weight
(SmoothQuant, RHT, OCC, ResQ-W) are refused with one line: fp4rl's own engine runs them.

This module is the integration's public face and the entry point's target; the code lives
in :mod:`fp4rl.rollout.vllm`, the ``vllm`` rollout engine.
"""

from fp4rl.rollout.vllm.config import (
    CONFIG_KEYS,
    QUANT_METHOD,
    WEIGHT_STORAGES,
    check_storage,
    quantization_config,
    recipe_from_config,
    rollout_recipe,
    storage_from_config,
    supported_recovery,
)
from fp4rl.rollout.vllm.engine import (
    EngineSpec,
    VLLMEngine,
    engine_model,
    make_llm,
    method_kwargs,
    model_dir,
    sharing_the_process,
)
from fp4rl.rollout.vllm.errors import VLLMError, one_line_refusals, require_vllm
from fp4rl.rollout.vllm.host import RECIPE_ENV, WORKER_EXTENSION, check_actor_recipe
from fp4rl.rollout.vllm.names import hf_layer_names
from fp4rl.rollout.vllm.plugin import register
from fp4rl.rollout.vllm.refit import RefitPayload, RefitStats, refit, refit_payload
from fp4rl.rollout.vllm.settings import default_kv_cache_bytes

__all__ = ["CONFIG_KEYS", "QUANT_METHOD", "RECIPE_ENV", "WEIGHT_STORAGES",
           "WORKER_EXTENSION", "EngineSpec", "RefitPayload", "RefitStats", "VLLMEngine",
           "VLLMError", "check_actor_recipe", "check_storage", "default_kv_cache_bytes",
           "engine_model", "hf_layer_names", "make_llm", "method_kwargs", "model_dir",
           "one_line_refusals", "quantization_config", "recipe_from_config", "refit",
           "refit_payload", "register", "require_vllm", "rollout_recipe", "sharing_the_process",
           "storage_from_config", "supported_recovery"]
