"""What the TRL plug-in's tests share, in the main environment and in vLLM's: a reward
that varies, the run's logged metrics, and an independent recomputation of log-probs."""

from __future__ import annotations

import torch
from torch import nn

IS_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
              "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
              "sampling/importance_sampling_ratio/max")


def digit_fraction(completions: list[str], **_: object) -> list[float]:
    """A reward that differs between completions, so the advantages (and the update) are
    not zero."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def logged(trainer: object) -> dict[str, float]:
    """Every metric of the run's log history, the last value of each."""
    return {k: v for entry in trainer.state.log_history for k, v in entry.items()}


def recomputed_logprobs(model: nn.Module, prompt: list[int], completion: list[int],
                        temperature: float, top_k: int) -> torch.Tensor:
    """log p(completion) under logits/temperature (top-k filtered): one unpadded row, one
    full forward without a KV cache, so nothing is shared with either rollout engine."""
    ids = torch.tensor([prompt + completion], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    targets = torch.tensor(completion, device=model.device)[:, None]
    return logits.log_softmax(-1).gather(-1, targets).squeeze(-1).cpu()
