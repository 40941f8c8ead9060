"""GRPO as the paper writes it (its equation 2 and Appendix A), as pure tensor functions.

For a group of G responses to one prompt, advantages are the group-normalized rewards.
The per-token objective is PPO's clipped surrogate with asymmetric clip range, weighted
by a *token-level truncated importance sampling* weight that corrects for the rollout
policy ``mu`` (FP4 rollout, possibly with ResQ) differing from the training policy
``pi_old`` (FP4 training numerics)::

    r_t = pi_theta / pi_old,     w_t = min(pi_old / mu, C)           (C = 5.0, detached)
    J   = agg( w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) )  [- beta * KL_k3]

``agg`` is the paper's per-response token mean then group mean (verl's
``seq-mean-token-mean``), or ``token-mean`` over all tokens of the batch.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field

from fp4rl.rollout.mismatch import nemo_rl_mismatch

LossAggMode = Literal["seq-mean-token-mean", "token-mean"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` for rewards laid out group by group.

    The std is the unbiased sample std (as TRL and verl compute it). A group whose
    rewards are all equal gets zero advantages: it carries no learning signal.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().reshape(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    return ((grouped - mean) / (std + eps)).reshape(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1)


class LossConfig(BaseModel):
    """Loss hyper-parameters, named as in TRL's GRPOConfig where TRL has the concept.

    The one definition of these fields: the training config's ``grpo`` section extends
    this model, so a value validated there is the value the loss reads."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    epsilon: float = Field(0.2, ge=0, description="the ratio's lower clip, eps_low (TRL's "
                           "epsilon, verl's clip_ratio_low)")
    epsilon_high: float = Field(0.2, ge=0, description="the ratio's upper clip, eps_high "
                                "(TRL's epsilon_high, verl's clip_ratio_high)")
    tis_imp_ratio_cap: float = Field(5.0, description="C of token-level truncated importance "
                                     "sampling between the rollout and training policies "
                                     "(verl's name); <= 0 switches the correction off")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the starting policy "
                        "(TRL's beta; the k3 estimator, verl's low_var_kl); 0: no reference")
    loss_agg_mode: LossAggMode = Field("seq-mean-token-mean", description="how token losses "
                                       "reduce: each sequence's token mean, then the mean "
                                       "over sequences; or token-mean over the batch")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar by ``mode`` (see module docstring)."""
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    per_seq = masked_mean(per_token, mask, dim=1)
    return per_seq.mean()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): ``exp(d) - d - 1``, d = ref - logp."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                cap: float) -> torch.Tensor:
    """Token-level truncated importance weights ``min(pi_old / mu, cap)`` (no gradient)."""
    if cap <= 0:
        return torch.ones_like(old_logp)
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
              ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                dict[str, torch.Tensor]]:
    """The GRPO loss (to minimize) and per-batch statistics.

    Shapes: log-probs and ``mask`` (B, T) over response tokens, ``advantages`` (B,).
    """
    mask = mask.bool()
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - cfg.epsilon, 1 + cfg.epsilon_high) * adv
    weights = tis_weights(old_logp, rollout_logp, cfg.tis_imp_ratio_cap)
    per_token = -weights * torch.minimum(unclipped, clipped)
    kl = None
    if cfg.beta > 0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + cfg.beta * kl
    loss = aggregate(per_token, mask, cfg.loss_agg_mode)
    with torch.no_grad():
        low = (ratio < 1 - cfg.epsilon) & (adv < 0)
        high = (ratio > 1 + cfg.epsilon_high) & (adv > 0)
        stats = {
            "clip_ratio/low_mean": masked_mean(low.float(), mask),
            "clip_ratio/high_mean": masked_mean(high.float(), mask),
            "clip_ratio/region_mean": masked_mean((low | high).float(), mask),
        }
        if kl is not None:
            stats["kl"] = masked_mean(kl, mask)
    return loss, stats


def mismatch_stats(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                   cap: float) -> dict[str, float]:
    """How far the rollout policy strays from the training policy on the sampled tokens.

    Names follow TRL (``sampling/...``), verl (``rollout_corr/...``) and NeMo-RL
    (``mismatch/...``).
    """
    mask = mask.bool()
    if not mask.any():
        return {}
    diff = (old_logp - rollout_logp)[mask]
    raw = torch.exp(diff)
    truncated = raw.clamp(max=cap) if cap > 0 else raw
    nemo = nemo_rl_mismatch(diff)
    ess = truncated.sum() ** 2 / (truncated.pow(2).sum() * truncated.numel()).clamp_min(1e-12)
    return {**{k: v.item() for k, v in nemo.items()},
        "sampling/sampling_logp_difference/mean": diff.abs().mean().item(),
        "sampling/sampling_logp_difference/max": diff.abs().max().item(),
        "sampling/importance_sampling_ratio/min": truncated.min().item(),
        "sampling/importance_sampling_ratio/mean": truncated.mean().item(),
        "sampling/importance_sampling_ratio/max": truncated.max().item(),
        "rollout_corr/kl": nemo["mismatch/gen_kl_error"].item(),  # verl's k3 is NeMo-RL's
        "rollout_corr/rollout_is_mean": raw.mean().item(),
        "rollout_corr/rollout_is_truncated_frac": (raw > cap).float().mean().item()
        if cap > 0 else 0.0,
        "rollout_corr/rollout_is_eff_sample_size": ess.item(),
    }
