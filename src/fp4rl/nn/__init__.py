"""FP4 linear layers, model patching and policy switching."""

from fp4rl.nn.linear import FP4Linear, Mode
from fp4rl.nn.patch import (
    PatchError,
    begin_step,
    fp4_layers,
    quantize_model,
    rollout_mode,
    train_mode,
)
from fp4rl.nn.recipe import Recipe, RecipeError, Recovery, RolloutPrecision, TrainPrecision, preset

__all__ = ["FP4Linear", "Mode", "PatchError", "Recipe", "RecipeError", "Recovery",
           "RolloutPrecision", "TrainPrecision", "begin_step", "fp4_layers", "preset",
           "quantize_model", "rollout_mode", "train_mode"]
