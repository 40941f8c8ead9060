"""How far a rollout policy strays from the training policy on the tokens it sampled,
in the names and definitions other frameworks log, so that runs compare across them."""

from __future__ import annotations

import torch


def nemo_rl_mismatch(diff: torch.Tensor) -> dict[str, torch.Tensor]:
    """NeMo-RL's two rollout/trainer mismatch metrics of the sampled tokens'
    ``diff = log pi_old - log mu`` (trainer minus rollout), as NeMo-RL defines them:
    ``token_mult_prob_error``, the mean of ``exp(|diff|)`` (1 when the two agree), and
    ``gen_kl_error``, the mean k3 estimate ``exp(diff) - diff - 1`` of KL(mu || pi_old)
    from the rollout's samples (their default KL type). Tensors, so that a caller on
    several processes gathers them before reading."""
    return {"mismatch/token_mult_prob_error": diff.abs().exp().mean(),
            "mismatch/gen_kl_error": (diff.exp() - diff - 1).mean()}


__all__ = ["nemo_rl_mismatch"]
