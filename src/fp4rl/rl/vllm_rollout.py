"""The rollout in vLLM (``rollout.engine: vllm``): a colocated engine refit every step.

The engine serves the rollout policy through the ``fp4rl`` quantization method
(:mod:`fp4rl.integrations.vllm`). Before each step's rollout it receives ``Q(W)`` of the
trainer's current FP32 weights, computed here as fp4rl's own rollout computes it, and
installs it without re-quantizing, with no restart. Every response is sampled by vLLM's
sampler under its own seed (the run's seed, the step, the prompt's position and the
sample's index, as the ``hf`` engine seeds its rows), and each sampled token's
log-probability comes from vLLM's processed log-probs: the distribution actually sampled
(temperature, top-k, top-p applied). Those are the rollout log-probs mu that truncated
importance sampling divides by, so TIS corrects the real vLLM/trainer mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fp4rl.integrations.vllm import EngineSpec, RefitStats, make_llm, model_dir, refit
from fp4rl.nn.recipe import Recipe
from fp4rl.rl.rollout import RolloutBatch, SamplingConfig, left_pad


class VLLMRollout:
    """A vLLM engine running ``recipe``'s rollout policy for a trainer."""

    def __init__(self, model: str, recipe: Recipe, dtype: torch.dtype, seed: int,
                 max_model_len: int, pad_token_id: int,
                 weight_storage: str = "dequantized", refit_wire: str = "packed") -> None:
        self.spec = EngineSpec(model_dir(model), recipe, dtype=dtype, seed=seed,
                               max_model_len=max_model_len, weight_storage=weight_storage)
        self.packed_wire = refit_wire == "packed"
        self.pad_token_id = pad_token_id
        #: the engine, built now (seconds) so that no step's timings include its start
        self.llm = make_llm(self.spec)

    def refit(self, model: torch.nn.Module) -> RefitStats:
        """Hand the engine ``Q(W)`` of ``model``'s current weights (as 4-bit codes and
        scales, or their values in bf16) and the other tensors."""
        return refit(self.llm, model, packed=self.packed_wire)

    def generate(self, chunks: Sequence[Sequence[Sequence[int]]],
                 seeds: Sequence[Sequence[int]], config: SamplingConfig,
                 eos_token_ids: Sequence[int]) -> list[RolloutBatch]:
        """One response per prompt, ``chunks[c][i]`` sampled under ``seeds[c][i]``: every
        chunk in one call (vLLM batches them as it sees fit), returned chunk by chunk, laid
        out as the ``hf`` engine lays out its batches."""
        from vllm import SamplingParams, TokensPrompt

        prompts = [p for chunk in chunks for p in chunk]
        params = [SamplingParams(
            n=1, temperature=0.0 if config.greedy else config.temperature,
            top_p=config.top_p, top_k=config.top_k or -1, max_tokens=config.max_new_tokens,
            seed=seed, logprobs=0, detokenize=False,
            # stop exactly where fp4rl's engine stops: at its stop tokens, not at vLLM's own
            ignore_eos=True, stop_token_ids=list(eos_token_ids))
            for chunk_seeds in seeds for seed in chunk_seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 params, use_tqdm=False)
        batches, start, eos = [], 0, set(eos_token_ids)
        for chunk in chunks:
            part = [o.outputs[0] for o in outs[start:start + len(chunk)]]
            batches.append(self._batch(chunk, part, eos))
            start += len(chunk)
        return batches

    def _batch(self, prompts: Sequence[Sequence[int]], outputs: list[Any],
               eos: set[int]) -> RolloutBatch:
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id, torch.device("cpu"))
        width = max(1, max(len(o.token_ids) for o in outputs))
        n = len(outputs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        finished = torch.zeros(n, dtype=torch.bool)
        for row, out in enumerate(outputs):
            tokens = list(out.token_ids)
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
            logprobs[row, :len(tokens)] = torch.tensor(
                [step[t].logprob for t, step in zip(tokens, out.logprobs, strict=True)])
            finished[row] = bool(tokens) and tokens[-1] in eos
        return RolloutBatch(prompt_ids, prompt_mask, ids, mask, logprobs, finished)
