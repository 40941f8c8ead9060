"""Patching a Hugging Face causal LM, and switching it between its two policies."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from torch import nn

from fp4rl.errors import UserError
from fp4rl.nn.linear import FP4Linear, Mode
from fp4rl.nn.recipe import Recipe, preset

#: a linear inside a transformer block: ``...layers.<i>.`` (Llama, Qwen2, Mistral, ...),
#: ``...h.<i>.`` (GPT-style) or ``...blocks.<i>.``
BLOCK_PREFIX = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\.")


class PatchError(UserError):
    """The model cannot be patched as asked."""


def _split(name: str) -> tuple[str, str]:
    parent, _, child = name.rpartition(".")
    return parent, child


def quantize_model(model: nn.Module, recipe: Recipe | str) -> nn.Module:
    """Replace every linear layer inside the transformer blocks by an :class:`FP4Linear`.

    Embeddings and ``lm_head`` stay as they are. Parameters are shared, not copied, so
    names, the state_dict and any optimizer keep working. Patching an already patched
    model just installs the new recipe. Returns ``model`` (modified in place).
    """
    recipe = preset(recipe) if isinstance(recipe, str) else recipe
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and BLOCK_PREFIX.search(name)]
    if not targets:
        raise PatchError("no linear layers found inside transformer blocks (expected module "
                         "names like 'model.layers.0.mlp.down_proj')")
    for seed, (name, module) in enumerate(targets):
        if isinstance(module, FP4Linear):
            module.set_recipe(recipe)
            continue
        parent, child = _split(name)
        setattr(model.get_submodule(parent), child, FP4Linear.from_linear(module, recipe, seed))
    model.fp4rl_recipe = recipe
    return model


def fp4_layers(model: nn.Module) -> dict[str, FP4Linear]:
    """The patched layers of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}


def _layers_or_raise(model: nn.Module) -> list[FP4Linear]:
    layers = list(fp4_layers(model).values())
    if not layers:
        raise PatchError("model has no FP4 layers: call fp4rl.quantize_model(model, recipe)")
    return layers


@contextlib.contextmanager
def _mode(model: nn.Module, mode: Mode) -> Iterator[nn.Module]:
    layers = _layers_or_raise(model)
    previous = [layer.mode for layer in layers]
    for layer in layers:
        layer.mode = mode
    try:
        yield model
    finally:
        for layer, old in zip(layers, previous, strict=True):
            layer.mode = old


def rollout_mode(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Context manager: every patched layer computes as the rollout policy."""
    return _mode(model, Mode.ROLLOUT)


def train_mode(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Context manager: every patched layer computes as the training policy."""
    return _mode(model, Mode.TRAIN)


def begin_step(model: nn.Module) -> None:
    """Mark the start of an RL step: SmoothQuant recalibrates, RHT may redraw its signs."""
    for layer in _layers_or_raise(model):
        layer.begin_step()
