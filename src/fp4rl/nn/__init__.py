"""FP4 linear layers, model patching and policy switching."""

from fp4rl.errors import RecipeError
from fp4rl.nn.invariant import batch_invariant, is_batch_invariant, set_batch_invariant
from fp4rl.nn.linear import FP4Linear, Mode
from fp4rl.nn.patch import (
    PatchError,
    begin_step,
    calibrate_static_scales,
    copy_static_scales,
    fp4_layers,
    hold_weights,
    in_transformer_block,
    load_rollout_states,
    needs_static_calibration,
    quantize_model,
    rollout_mode,
    rollout_states,
    train_mode,
)
from fp4rl.nn.recipe import (
    Recipe,
    RolloutPrecision,
    TrainPrecision,
    get_recipe,
)

__all__ = ["FP4Linear", "Mode", "PatchError", "Recipe", "RecipeError",
           "RolloutPrecision", "TrainPrecision", "batch_invariant", "begin_step",
           "calibrate_static_scales", "copy_static_scales", "fp4_layers", "get_recipe",
           "hold_weights", "in_transformer_block", "is_batch_invariant",
           "load_rollout_states", "needs_static_calibration", "quantize_model",
           "rollout_mode", "rollout_states", "set_batch_invariant", "train_mode"]
