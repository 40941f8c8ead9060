"""How far a rollout policy strays from the training policy on the tokens it sampled,
in the names and definitions other frameworks log, so that runs compare across them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from statistics import mean

import torch

#: NeMo-RL's CI gates on a run's mismatch (its NVFP4 W4A4 recipe's limits): a metric
#: under its limit passes
NEMO_RL_LIMITS = {"mismatch/token_mult_prob_error": 1.15, "mismatch/gen_kl_error": 0.1}


def nemo_rl_mismatch(diff: torch.Tensor) -> dict[str, torch.Tensor]:
    """NeMo-RL's two rollout/trainer mismatch metrics of the sampled tokens'
    ``diff = log pi_old - log mu`` (trainer minus rollout), as NeMo-RL defines them:
    ``token_mult_prob_error``, the mean of ``exp(|diff|)`` (1 when the two agree), and
    ``gen_kl_error``, the mean k3 estimate ``exp(diff) - diff - 1`` of KL(mu || pi_old)
    from the rollout's samples (their default KL type). Tensors, so that a caller on
    several processes gathers them before reading."""
    return {"mismatch/token_mult_prob_error": diff.abs().exp().mean(),
            "mismatch/gen_kl_error": (diff.exp() - diff - 1).mean()}


def nemo_rl_means(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each NeMo-RL metric's mean over the steps (metrics lines) that logged it."""
    rows = list(rows)
    return {key: mean(r[key] for r in rows if key in r)
            for key in NEMO_RL_LIMITS if any(key in r for r in rows)}


def nemo_rl_verdict(means: Mapping[str, float]) -> str:
    """One line: each metric's value against NeMo-RL's limit, ``within`` or ``over``."""
    return "; ".join(f"{key.split('/')[-1]} {value:.4g} "
                     f"({'within' if value < NEMO_RL_LIMITS[key] else 'over'} NeMo-RL's "
                     f"< {NEMO_RL_LIMITS[key]:g})" for key, value in means.items())


__all__ = ["NEMO_RL_LIMITS", "nemo_rl_means", "nemo_rl_mismatch", "nemo_rl_verdict"]
