"""Plug-ins from outside the package: the examples of docs/architecture.md (a recovery
method, a number format, a reward), run as a user's own module would run them, then used
through recipe strings, a training config and one GRPO step."""

from __future__ import annotations

import json
import re
import sys
from types import ModuleType

import pytest
import torch
from _paths import ROOT
from torch import nn

import fp4rl
from fp4rl.errors import RecipeError
from fp4rl.experiments.grid import grid_cells
from fp4rl.models import tiny_model
from fp4rl.nn import FP4Linear, Mode, fp4_layers, get_recipe, quantize_model
from fp4rl.recovery import register_recovery, unregister_recovery
from fp4rl.rl import rewards
from fp4rl.rl.config import load_config
from fp4rl.rl.trainer import Trainer

DOC = ROOT / "docs" / "architecture.md"


def doc_examples() -> list[str]:
    """The Python code blocks of the architecture page, in order."""
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture
def plugins():
    """Run every example of the page in a fresh module (each registers itself; the
    registrations are taken back by conftest's fixture)."""
    module = ModuleType("user_plugins")
    sys.modules[module.__name__] = module
    for code in doc_examples():
        exec(compile(code, str(DOC), "exec"), module.__dict__)
    yield module
    del sys.modules[module.__name__]


@pytest.fixture
def clip_method(plugins):
    return plugins.Clip


def test_the_page_has_the_three_examples(plugins):
    assert len(doc_examples()) == 3
    assert fp4rl.recovery.get_recovery("clip") is plugins.Clip
    assert "mxint4" in fp4rl.formats.list_formats()
    assert rewards.get_reward("ends_with_answer")("so it is 42", "42") == 1.0


def test_registered_format_is_exact_against_its_reference(plugins):
    fmt = fp4rl.get_format("mxint4")
    x = torch.randn(8, 96) * torch.exp(torch.randn(8, 96))
    q = fp4rl.quantize(x, "mxint4")
    assert torch.equal(q, fmt.quantize_reference(x))
    assert torch.equal(fmt.decode(fmt.encode(x)), q)
    assert torch.equal(q.bfloat16().float(), q)  # exact in bf16, as the GEMM needs
    codes = q.reshape(8, 3, 32) / q.reshape(8, 3, 32).abs().amax(-1, keepdim=True)
    assert (codes.abs() <= 1).all()


def test_registered_method_is_a_recipe(clip_method):
    recipe = get_recipe("hif4+clip-0.25")
    assert recipe.rollout.recovery.method == "clip"
    assert recipe.rollout.recovery.config == clip_method.config_cls(ratio=0.25)
    assert recipe.rollout.recovery.label == "clip-0.25"
    yaml_form = fp4rl.Recipe.from_dict(recipe.to_dict())
    assert yaml_form == recipe
    with pytest.raises(RecipeError, match="ratio must be in"):
        get_recipe("hif4+clip-2")


@pytest.mark.parametrize("fmt", ["hif4", "mxint4"])
def test_registered_method_computes_its_rollout(plugins, fmt):
    """The layer's rollout output against the formats' reference paths, in fp32 and
    under bf16 autocast (the operands are exact in bf16, so only summation differs)."""
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(128, 32, bias=False), get_recipe(f"{fmt}+clip-0.5"))
    layer.mode = Mode.ROLLOUT
    x = torch.randn(6, 128)
    limit = 0.5 * x.abs().amax(dim=-1, keepdim=True)
    f = fp4rl.get_format(fmt)
    expected = f.quantize_reference(x.clamp(-limit, limit)) @ \
        f.quantize_reference(layer.weight.detach()).t()
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)


def test_registered_method_joins_the_recovery_grid(clip_method):
    cells = {c.name: c.row for c in grid_cells("recovery", ("hif4",))}
    assert cells["hif4+clip-0.5"] == "Clip (0.5)"


def test_unregistered_method_is_refused_with_the_registry():
    assert "clip" not in fp4rl.recovery.list_recoveries()
    with pytest.raises(RecipeError, match=r"unknown recovery method 'clip'.*"
                                          r"fp4rl\.recovery\.register_recovery"):
        get_recipe("hif4+clip-0.5")


def test_name_clash_is_refused_and_unregister_takes_back(clip_method):
    with pytest.raises(RecipeError, match="already registered"):
        register_recovery("resq", clip_method)
    unregister_recovery("clip")
    assert "clip" not in fp4rl.recovery.list_recoveries()


def test_one_grpo_step_through_a_recipe_string(plugins, tmp_path):
    """Format, method and reward from the page, in one GRPO step on a tiny model; the
    recipe comes from the string ``"mxint4+clip-0.1"``."""
    recipe = get_recipe("mxint4+clip-0.1").to_dict()
    cfg = load_config(None, [
        f"train={json.dumps(recipe['train'])}", f"rollout={json.dumps(recipe['rollout'])}",
        "grpo.num_generations=2", "grpo.batch_size=2", "grpo.max_response_length=4",
        "data.train_size=4", "data.reward=ends_with_answer", "run.steps=1"])
    model, tok = tiny_model("llama")
    trainer = Trainer(cfg, tmp_path, model, tok, log=lambda m: None)
    history = trainer.train()
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))
    layers = list(fp4_layers(trainer.model).values())
    assert {type(layer.recovery) for layer in layers} == {plugins.Clip}
    mxint4 = fp4rl.get_format("mxint4")
    assert layers[0].recipe.train.weights is layers[0].recipe.rollout.activations is mxint4
    assert layers[0].recovery.config.ratio == pytest.approx(0.1)


def test_filter_fn_and_ignore_choose_the_targets():
    model, _ = tiny_model("llama")
    every = set(fp4_layers(quantize_model(model, "hif4")))
    assert every and all(".layers." in n for n in every)
    recipe = fp4rl.Recipe.from_dict({**get_recipe("hif4").to_dict(),
                                     "ignore": ["re:.*mlp\\.down_proj", r".*\.0\.self_attn\..*"]})
    kept = set(fp4_layers(quantize_model(model, recipe)))
    assert kept == {n for n in every if not n.endswith("down_proj")
                    and ".0.self_attn." not in n}
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), nn.Linear)
    only_mlp = set(fp4_layers(quantize_model(model, "hif4",
                                             filter_fn=lambda m, name: ".mlp." in name)))
    assert only_mlp == {n for n in every if ".mlp." in n}
    with pytest.raises(fp4rl.nn.PatchError, match="filter_fn"):
        quantize_model(model, "hif4", filter_fn=lambda m, name: False)


def test_scratch_undoes_what_is_registered_or_replaced_inside():
    """A notebook's temporary plug-ins end with its ``scratch()`` block: a new reward is
    gone after it, a replaced format is the original again."""
    from fp4rl.formats import get_format, register_format
    from fp4rl.formats.hif4 import HiF4
    from fp4rl.registry import scratch

    original = get_format("hif4")
    with scratch():
        rewards.register_reward("always", lambda completion, reference: 1.0)
        register_format(HiF4(), replace=True)
        assert "always" in rewards.list_rewards() and get_format("hif4") is not original
    assert "always" not in rewards.list_rewards()
    assert get_format("hif4") is original
