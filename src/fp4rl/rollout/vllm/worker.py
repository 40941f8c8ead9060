"""The worker side of a refit: methods vLLM mixes into its workers.

An engine built with ``worker_extension_cls`` naming :class:`FP4RLWorkerExtension`
(:data:`fp4rl.rollout.vllm.config.WORKER_EXTENSION`, which
:func:`fp4rl.rollout.vllm.engine.make_llm` passes) gives each worker these methods, which
``LLM.collective_rpc`` calls by name. The call travels the same way whether the engine core
runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or in its own (vLLM's
default on GPUs), so a refit never reaches into vLLM's objects.
"""

from __future__ import annotations

from typing import Any

import torch

from fp4rl.rollout.vllm.errors import VLLMError
from fp4rl.rollout.vllm.refit import PayloadWire, RefitPayload


class FP4RLWorkerExtension:
    """What fp4rl adds to a vLLM worker: installing a trainer's weights."""

    model_runner: Any  # the worker's, set by vLLM
    device: torch.device

    def fp4rl_refit(self, payload: PayloadWire) -> int:
        """Load a :class:`RefitPayload` (in its wire form), whole or one piece of it:
        plain tensors through the model's own ``load_weights``, each fp4rl layer's
        ``Q(W)`` as sent (never re-quantized), stored at once so that a piece's staging
        is freed before the next arrives. The last piece (``last``, true where absent)
        ends with vLLM's own post-load processing, as verl runs it after each sync: vLLM's
        other layers rebuild what they derive from their weights (on a CPU the LM head's
        prepacked GEMM copy, which would otherwise keep the embeddings of the first
        load). Returns how many fp4rl layers took a new ``Q(W)``."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        from fp4rl.rollout.vllm.loading import LayerState, install, process

        sent = RefitPayload.from_wire(payload)
        model = self.model_runner.model
        installed = 0
        with torch.no_grad():
            if sent.tensors:
                model.load_weights(sent.tensors)
            for module in model.modules():
                state = getattr(module, "fp4rl", None)
                if not isinstance(state, LayerState):
                    continue
                names = state.hf_names
                present = [n in sent.grids for n in names]
                if any(present) and not all(present):
                    raise VLLMError(f"a refit sent Q(W) for only some of {', '.join(names)}"
                                    " (one merged vLLM layer): send all of them")
                if all(present):
                    install(module, [sent.grids[n] for n in names])
                    process(module)
                    installed += 1
            if payload.get("last", True):
                process_weights_after_loading(model, self.model_runner.model_config,
                                              torch.device(self.device))
        return installed


__all__ = ["FP4RLWorkerExtension"]
