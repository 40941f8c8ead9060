"""Log-probabilities of response tokens under a policy: the trainer's scoring pass (the
training side of GRPO), and any host's that must score a token as the engine does."""

from __future__ import annotations

import torch

from fp4rl.nn.invariant import invariant_for
from fp4rl.rollout.batch import position_ids


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, prompt_width: int,
                      temperature: float = 1.0,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(response token) (B, R) and optionally the entropy (B, R).

    ``input_ids`` is ``[left-padded prompt | right-padded response]`` with the prompt
    occupying the first ``prompt_width`` columns. Logits are divided by ``temperature``
    so the policy matches the distribution the rollout sampled from (before top-p/top-k).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask), use_cache=False).logits
    logits = logits[:, prompt_width - 1: -1].float() / temperature
    with invariant_for(model):  # the engine's kernel, where the model is batch-invariant
        logp_all = torch.log_softmax(logits, dim=-1)
    targets = input_ids[:, prompt_width:]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
