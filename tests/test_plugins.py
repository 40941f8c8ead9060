"""Plug-ins from outside the package: a recovery method and a number format defined and
registered here, as a user's own module would, then used through a recipe string and
through a training config for one GRPO step (the example of docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fp4rl
from fp4rl.errors import RecipeError
from fp4rl.experiments.grid import grid_cells
from fp4rl.gemm import Operand
from fp4rl.models import tiny_model
from fp4rl.nn import FP4Linear, Mode, fp4_layers, preset, quantize_model
from fp4rl.recovery import RecoveryConfig, RolloutRecovery, register, unregister
from fp4rl.rl import rewards
from fp4rl.rl.config import load_config
from fp4rl.rl.trainer import Trainer


@dataclass(frozen=True)
class ClipConfig(RecoveryConfig):
    """ratio: each token row is clipped at ``ratio * max|x|`` before quantization."""

    ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.ratio <= 1:
            raise RecipeError(f"rollout.recovery.ratio must be in (0, 1], got {self.ratio}")

    @classmethod
    def from_text(cls, arg: str) -> ClipConfig:
        return cls(float(arg)) if arg else cls()

    def text(self) -> str:
        return f"{self.ratio:g}"


class Clip(RolloutRecovery):
    """Row-wise clipping of the activations: a deliberately simple third-party method."""

    config_cls = ClipConfig
    variants = (("0.5", "Clip (0.5)"),)

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        limit = self.config.ratio * x.abs().amax(dim=-1, keepdim=True)
        return [self.quantize_act(torch.maximum(torch.minimum(x, limit), -limit))]


@pytest.fixture
def clip_method():
    register("clip", Clip)
    yield Clip
    unregister("clip")


def test_registered_method_is_a_recipe(clip_method):
    recipe = preset("hif4+clip-0.25")
    assert recipe.rollout.recovery.method == "clip"
    assert recipe.rollout.recovery.config == ClipConfig(0.25)
    assert recipe.rollout.recovery.label == "clip-0.25"
    yaml_form = fp4rl.Recipe.from_dict(recipe.to_dict())
    assert yaml_form == recipe
    with pytest.raises(RecipeError, match="ratio must be in"):
        preset("hif4+clip-2")


def test_registered_method_computes_its_rollout(clip_method):
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(128, 32, bias=False), preset("hif4+clip-0.5"))
    layer.mode = Mode.ROLLOUT
    x = torch.randn(6, 128)
    limit = 0.5 * x.abs().amax(dim=-1, keepdim=True)
    expected = fp4rl.quantize(x.clamp(-limit, limit), "hif4") @ \
        fp4rl.quantize(layer.weight.detach(), "hif4").t()
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)


def test_registered_method_joins_the_recovery_grid(clip_method):
    cells = {c.name: c.row for c in grid_cells("recovery", ("hif4",))}
    assert cells["hif4+clip-0.5"] == "Clip (0.5)"


def test_unregistered_method_is_refused_with_the_registry():
    with pytest.raises(RecipeError, match=r"not a registered method.*fp4rl\.recovery\.register"):
        preset("hif4+clip-0.5")


def test_name_clash_is_refused(clip_method):
    with pytest.raises(RecipeError, match="already registered"):
        register("resq", Clip)


def test_one_grpo_step_with_a_registered_method(clip_method, tmp_path):
    rewards.register_reward("has_digit", lambda c, r: float(any(ch.isdigit() for ch in c)))
    cfg = load_config(None, [
        "train.weights=hif4", "train.activations=hif4", "train.gradients=hif4",
        "rollout.weights=hif4", "rollout.activations=hif4",
        "rollout.recovery.method=clip", "rollout.recovery.ratio=1e-1",
        "grpo.num_generations=2", "grpo.batch_size=2", "grpo.max_response_length=4",
        "data.train_size=4", "data.reward=has_digit", "run.steps=1"])
    model, tok = tiny_model("llama")
    trainer = Trainer(cfg, tmp_path, model, tok, log=lambda m: None)
    history = trainer.train()
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))
    layers = fp4_layers(trainer.model)
    assert {type(layer.recovery) for layer in layers.values()} == {Clip}
    assert next(iter(layers.values())).recovery.config.ratio == pytest.approx(0.1)


def test_filter_fn_and_ignore_choose_the_targets():
    model, _ = tiny_model("llama")
    every = set(fp4_layers(quantize_model(model, "hif4")))
    assert every and all(".layers." in n for n in every)
    recipe = fp4rl.Recipe.from_dict({**preset("hif4").to_dict(),
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
