"""FP4 rollout inside vLLM: fp4rl's rollout policy as the vLLM quantization method
``fp4rl`` (:mod:`.config`, :mod:`.plugin`, :mod:`.method`), refit from a trainer through
vLLM's worker interface (:mod:`.refit`, :mod:`.worker`), and the rollout engine a trainer
drives (:mod:`.engine`). :mod:`fp4rl.integrations.vllm` is its public face. Three
modules import vLLM at import time, the ones vLLM's processes load through the plug-in:
:mod:`.quant_config` (vLLM's config class), :mod:`.method` (its linear method) and
:mod:`.sharding` (its weight attributes); the rest import it inside functions or not at all,
so a trainer without vLLM imports them."""
