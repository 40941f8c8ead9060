"""``fp4rl diagnose --sensitivity``: a recipe's log-prob change under a tiny nudge."""

from __future__ import annotations

import torch

from fp4rl.analysis.sensitivity import parse_recipe, sensitivity
from fp4rl.formats import get_format
from fp4rl.models import tiny_model


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 128, (n,), generator=g) for n in (7, 12)]


def test_a_recipe_spec_takes_a_scale_rule():
    assert parse_recipe("nvfp4@pow2").rollout.activations is get_format("nvfp4_pow2")
    assert parse_recipe("hif4") == parse_recipe("hif4@dynamic")


def test_no_nudge_moves_nothing_and_a_nudge_moves_an_unquantized_policy_a_little():
    model = tiny_model("llama")[0]
    still = sensitivity(model, _prompts(), "bf16", nudge=0.0)
    assert still.max_nat == 0 and still.tokens == 6 + 11
    moved = sensitivity(model, _prompts(), "bf16", nudge=1e-3)
    assert 0 < moved.max_nat < 1e-2 and moved.changed_fraction > 0


def test_a_power_of_two_scale_stops_what_a_dynamic_one_carries():
    """A nudge that moves every per-token NVFP4 scale: the dynamic scale carries it into
    every output, the power-of-two one erases it (it rounds to the same power)."""
    model = tiny_model("llama")[0]
    dynamic = sensitivity(model, _prompts(), "nvfp4_per_token", nudge=1e-6)
    pow2 = sensitivity(model, _prompts(), "nvfp4_per_token@pow2", nudge=1e-6)
    assert dynamic.changed_fraction > pow2.changed_fraction
