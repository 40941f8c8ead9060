"""NVFP4's second-level scale rules: dynamic, pow2, static (formats, recipes, layers)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4rl
from fp4rl.errors import ConfigError, RecipeError
from fp4rl.formats import get_format
from fp4rl.formats.nvfp4 import TENSOR_RANGE, ScaleRule
from fp4rl.nn import FP4Linear, Mode, fp4_layers, get_recipe
from fp4rl.nn.recipe import scale_rule
from fp4rl.rl.config import load_config


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False))
def test_pow2_is_the_dynamic_scale_rounded_up_to_a_power_of_two(amax):
    x = torch.tensor([amax, -amax / 3], dtype=torch.float32)
    dynamic = float(get_format("nvfp4").tensor_scale(x))
    pow2 = float(get_format("nvfp4_pow2").tensor_scale(x))
    assert pow2 >= dynamic and pow2 / 2 < dynamic
    assert math.frexp(pow2)[0] == 0.5  # a power of two


def test_pow2_erases_an_ulp_of_the_amax():
    x = torch.tensor([3.1, 1.0])
    nudged = torch.stack([torch.nextafter(x[0], torch.tensor(4.0)), x[1]])  # one float32 ulp
    for name, same in (("nvfp4", False), ("nvfp4_pow2", True)):
        f = get_format(name)
        assert torch.equal(f.tensor_scale(x), f.tensor_scale(nudged)) is same


def test_variants_keep_the_base_codes_and_give_weights_the_base():
    x = torch.randn(4, 64)
    for name in ("nvfp4_pow2", "nvfp4_static", "nvfp4_per_token_pow2"):
        f = get_format(name)
        assert torch.equal(f.decode(f.encode(x)), f.quantize(x))
    recipe = get_recipe("nvfp4_static")
    assert recipe.train.weights is get_format("nvfp4")
    assert recipe.rollout.activations is get_format("nvfp4_static")
    assert get_recipe("nvfp4_per_token_pow2").train.weights is get_format("nvfp4")


def test_a_recipe_takes_the_rule_for_its_nvfp4_activations_alone():
    recipe = get_recipe("nemo-rl-nvfp4").with_nvfp4_scale(scale_rule("static"))
    assert recipe.train.activations is get_format("nvfp4_static")
    assert recipe.rollout.activations is get_format("nvfp4_static")
    assert recipe.train.weights is get_format("nvfp4") and recipe.ignore
    miles = get_recipe("miles-nvfp4").with_nvfp4_scale(ScaleRule.POW2)
    assert miles.rollout.activations is get_format("nvfp4_per_token_4o6_pow2")
    assert miles.with_nvfp4_scale(scale_rule("dynamic")).rollout.activations is \
        get_format("nvfp4_per_token_4o6")
    assert get_recipe("hif4").with_nvfp4_scale(scale_rule("dynamic")) == get_recipe("hif4")


@pytest.mark.parametrize(("recipe", "rule", "message"), [
    ("hif4", "pow2", "this recipe's activations are hif4"),
    ("nvfp4_per_token", "static", "per-token scale is the token's own"),
    ("nvfp4", "fixed", "nvfp4_scale must be one of dynamic, pow2, static"),
])
def test_a_rule_that_does_not_apply_is_one_line(recipe, rule, message):
    with pytest.raises(RecipeError, match=message):
        get_recipe(recipe).with_nvfp4_scale(scale_rule(rule))


def test_static_takes_no_recovery_and_no_weight():
    with pytest.raises(RecipeError, match="takes no recovery method"):
        get_recipe("nvfp4_static+resq-2:4")
    with pytest.raises(ConfigError, match="a weight takes nvfp4"):
        load_config(None, ["train.weights=nvfp4_static"])


def test_the_training_config_applies_the_rule_and_refuses_vllm_with_batch_invariance():
    cfg = load_config(None, ["recipe=torchao-nvfp4", "nvfp4_scale=static",
                             "batch_invariant=true"])
    assert cfg.recipe().train.activations is get_format("nvfp4_static")
    assert cfg.batch_invariant
    with pytest.raises(Exception, match="batch_invariant=true runs a batch-invariant engine"):
        load_config(None, ["batch_invariant=true", "rollout.engine=vllm"])


def test_a_format_says_its_scale_and_the_rules_it_takes():
    """The recipe, the layers and the engines ask the format (``scale_rule``,
    ``fixed_scale``, :func:`scale_rules`), not its class: the static rule is the fixed one,
    a per-token scale takes no static rule, and a format without a scale on top of its
    blocks takes none."""
    from fp4rl.formats.base import FIXED_SCALE_RULE
    from fp4rl.formats.nvfp4 import ScaleRule
    from fp4rl.formats.registry import scale_rules, with_scale_rule

    assert FIXED_SCALE_RULE == ScaleRule.STATIC
    assert get_format("nvfp4_static").fixed_scale and not get_format("nvfp4").fixed_scale
    assert not get_format("nvfp4_pow2").fixed_scale and not get_format("mxfp4").fixed_scale
    assert scale_rules(get_format("nvfp4")) == list(ScaleRule)
    assert scale_rules(get_format("nvfp4_per_token")) == [ScaleRule.DYNAMIC, ScaleRule.POW2]
    assert scale_rules(get_format("hif4")) == [] and get_format("hif4").scale_rule is None
    assert with_scale_rule(get_format("nvfp4_pow2"), ScaleRule.STATIC) is get_format("nvfp4_static")
    assert with_scale_rule(get_format("nvfp4_static"), ScaleRule.DYNAMIC) is get_format("nvfp4")
    assert with_scale_rule(get_format("nvfp4_per_token"), ScaleRule.STATIC) is None


def test_a_static_scale_is_fixed_per_step_and_shared_by_both_policies():
    """Fixed by the step's first forward where no calibration fixed it, shared by the other
    policy and kept through a weight update (one scale for the RL step, however its
    mini-batches update the weights), fixed anew at the next step."""
    layer = FP4Linear(64, 32, recipe=get_recipe("nvfp4_static"))
    g = torch.Generator().manual_seed(0)
    first, louder = torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g) * 8
    dynamic = FP4Linear(64, 32, recipe=get_recipe("nvfp4"))
    dynamic.weight, dynamic.bias = layer.weight, layer.bias
    with torch.no_grad():
        layer.mode = Mode.ROLLOUT
        dynamic.mode = Mode.ROLLOUT
        assert torch.equal(layer(first), dynamic(first))  # calibrates on its first forward
        fixed = layer._static
        layer.mode = Mode.TRAIN
        out = layer(louder)  # the training policy: the rollout's scale, not louder's
        assert torch.equal(layer._static, fixed)
        dynamic.mode = Mode.TRAIN
        assert not torch.equal(out, dynamic(louder))
        layer.weight.add_(0.5)  # a mini-batch's update within the step: the step's scale
        layer(louder)
        assert torch.equal(layer._static, fixed)
        layer.begin_step()  # the next step: fixed anew
        layer(louder)
    assert not torch.equal(layer._static, fixed)
    assert torch.equal(layer._static, get_format("nvfp4").tensor_scale(louder))
    assert float(get_format("nvfp4").tensor_scale(louder)) == \
        pytest.approx(float(louder.abs().max()) / TENSOR_RANGE)


def test_a_calibration_fixes_the_scale_from_the_amax_of_all_its_forwards():
    """The amax of every real row over the calibration's forwards, whatever their split;
    the layers compute unquantized meanwhile; a forward that raises fixes nothing."""
    from torch import nn

    from fp4rl.nn import calibrate_static_scales

    model = nn.Sequential(nn.Linear(64, 32))
    fp4rl.quantize_model(model, "nvfp4_static", filter_fn=lambda m, n: isinstance(m, nn.Linear))
    layer = fp4_layers(model)["0"]
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(10, 64, generator=g)
    rows[7, 3] = 40.0
    scales = []
    for split in (10, 4, 1):
        with torch.no_grad(), calibrate_static_scales(model):
            for part in rows.split(split):
                assert torch.equal(model(part), nn.functional.linear(part, layer.weight,
                                                                     layer.bias))
        scales.append(layer._static)
    want = get_format("nvfp4").tensor_scale(rows)
    assert all(torch.equal(s, want) for s in scales)
    layer.begin_step()
    with pytest.raises(RuntimeError), calibrate_static_scales(model):
        model(rows[:3])
        raise RuntimeError("a forward failed")
    assert layer._static is None and layer._calibration is None


def test_the_vllm_plugin_refuses_a_static_scale_in_one_line():
    """vLLM's method scales each call's activations; it keeps no layer scale, so a static
    one would silently run dynamic there."""
    from fp4rl.rollout.vllm.config import rollout_recipe
    from fp4rl.rollout.vllm.errors import VLLMError

    with pytest.raises(VLLMError, match="need the layer's fixed scale"):
        rollout_recipe(get_recipe("nvfp4").with_nvfp4_scale(scale_rule("static")))
    assert rollout_recipe(get_recipe("nvfp4").with_nvfp4_scale(scale_rule("pow2")))
    with pytest.raises(ConfigError, match="need the layer's fixed scale"):
        load_config(None, ["recipe=nvfp4", "nvfp4_scale=static", "rollout.engine=vllm"])
