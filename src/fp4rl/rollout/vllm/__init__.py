"""FP4 rollout inside vLLM: fp4rl's rollout policy as the vLLM quantization method
``fp4rl`` (:mod:`.config`, :mod:`.plugin`, :mod:`.method`), refit from a trainer through
vLLM's worker interface (:mod:`.refit`, :mod:`.worker`), and the rollout engine a trainer
drives (:mod:`.engine`). :mod:`fp4rl.integrations.vllm` is its public face. Only
:mod:`.method` imports vLLM at import time, and only vLLM's processes import it."""
