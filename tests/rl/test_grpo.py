"""GRPO math: advantages, the clipped TIS-weighted loss against a slow explicit path."""

from __future__ import annotations

import math

import pytest
import torch

from fp4rl.rl.grpo import (
    LossConfig,
    group_advantages,
    grpo_loss,
    k3_kl,
    mismatch_stats,
    tis_weights,
)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4)
    std = torch.tensor([1.0, 0, 0, 0]).std().item()
    assert a[0].item() == pytest.approx(0.75 / (std + 1e-6))
    assert a[1].item() == pytest.approx(-0.25 / (std + 1e-6))
    assert torch.equal(a[4:], torch.zeros(4))  # all-equal group: no signal
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def slow_loss(logp, old, mu, adv, mask, cfg, ref=None):
    """The paper's equation, one token at a time."""
    per_seq, tokens = [], []
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[0])):
            if not mask[i, t]:
                continue
            r = math.exp(logp[i][t] - old[i][t])
            w = min(math.exp(old[i][t] - mu[i][t]), cfg.tis_imp_ratio_cap)
            a = adv[i].item()
            clipped = min(max(r, 1 - cfg.epsilon), 1 + cfg.epsilon_high)
            term = -w * min(r * a, clipped * a)
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                term += cfg.beta * (math.exp(d) - d - 1)
            terms.append(term)
            tokens.append(term)
        per_seq.append(sum(terms) / max(len(terms), 1))
    if cfg.loss_agg_mode == "token-mean":
        return sum(tokens) / len(tokens)
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_matches_explicit_equation(mode, beta):
    g = torch.Generator().manual_seed(0)
    shape = (6, 9)
    old = -torch.rand(shape, generator=g) * 3
    logp = old + 0.5 * torch.randn(shape, generator=g)  # some ratios outside the clip range
    mu = old + 2.0 * torch.randn(shape, generator=g)  # some IS weights above the cap
    ref = old + 0.3 * torch.randn(shape, generator=g)
    adv = torch.randn(6, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    mask[:, 0] = True
    cfg = LossConfig(epsilon=0.2, epsilon_high=0.28, tis_imp_ratio_cap=5.0, beta=beta,
                     loss_agg_mode=mode)
    loss, stats = grpo_loss(logp, old, mu, adv, mask, cfg, ref if beta else None)
    want = slow_loss(logp.tolist(), old.tolist(), mu.tolist(), adv, mask, cfg,
                     ref.tolist() if beta else None)
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert 0 < stats["clip_ratio/region_mean"] < 1


def test_loss_gradient_flows_only_through_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, mu = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    loss, _ = grpo_loss(logp, old, mu, torch.tensor([1.0]), torch.ones(1, 2), LossConfig())
    loss.backward()
    w = tis_weights(old, mu, 5.0)
    # at ratio 1 inside the clip range, d(-w r A)/d logp = -w A / T (seq mean over 2 tokens)
    torch.testing.assert_close(logp.grad, -w / 2)


def test_tis_weights_truncate():
    old, mu = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0.0, -1.0, -3.0])
    w = tis_weights(old, mu, 5.0)
    torch.testing.assert_close(w, torch.tensor([1.0, math.e, 5.0]))
    assert torch.equal(tis_weights(old, mu, 0.0), torch.ones(3))


def test_k3_is_nonnegative_and_zero_at_equality():
    x = torch.randn(100)
    assert (k3_kl(x, x) == 0).all()
    assert (k3_kl(x, x + torch.randn(100)) >= 0).all()


def test_mismatch_stats():
    old = torch.tensor([[0.0, -1.0, 0.0]])
    mu = torch.tensor([[0.0, -1.5, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    s = mismatch_stats(old, mu, mask, 5.0)
    assert s["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
    assert s["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5))
    assert s["rollout_corr/rollout_is_truncated_frac"] == 0.0
    assert mismatch_stats(old, mu, torch.zeros(1, 3), 5.0) == {}
    # NeMo-RL's names, written out per token from their definitions: mean exp(|d|) and
    # the mean k3 estimate exp(d) - d - 1 over the two unmasked tokens (d = 0, then 0.5)
    assert s["mismatch/token_mult_prob_error"] == pytest.approx((1 + math.exp(0.5)) / 2)
    assert s["mismatch/gen_kl_error"] == pytest.approx((math.exp(0.5) - 1.5) / 2)
    assert s["rollout_corr/kl"] == s["mismatch/gen_kl_error"]
    same = mismatch_stats(old, old, mask, 5.0)
    assert (same["mismatch/token_mult_prob_error"], same["mismatch/gen_kl_error"]) == (1.0, 0.0)


def test_bad_loss_agg_mode():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        LossConfig(loss_agg_mode="sum")
