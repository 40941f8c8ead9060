"""Patching a Hugging Face causal LM, and switching it between its two policies."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from fp4rl.errors import UserError
from fp4rl.kernels.cpu import keep_panels
from fp4rl.nn.invariant import install_forward_hooks, set_batch_invariant
from fp4rl.nn.linear import FP4Linear, Mode
from fp4rl.nn.recipe import Recipe, as_recipe
from fp4rl.nn.select import BLOCK_INDEX


class PatchError(UserError):
    """The model cannot be patched as asked."""


def _split(name: str) -> tuple[str, str]:
    parent, _, child = name.rpartition(".")
    return parent, child


#: torchao's filter signature: (module, fully qualified name) -> patch it?
FilterFn = Callable[[nn.Module, str], bool]


def in_transformer_block(module: nn.Module, name: str) -> bool:
    """The default target: a linear layer inside a transformer block (so neither the
    embeddings nor ``lm_head``)."""
    return isinstance(module, nn.Linear) and BLOCK_INDEX.search(name) is not None


def quantize_model(model: nn.Module, recipe: Recipe | str,
                   filter_fn: FilterFn | None = None,
                   batch_invariant: bool | None = None,
                   weight_cache: bool | None = None) -> nn.Module:
    """Replace the targeted linear layers by :class:`FP4Linear` layers running ``recipe``.

    Targets are the ``nn.Linear`` modules for which ``filter_fn(module, name)`` is true
    (default :func:`in_transformer_block`), minus those the recipe's ``ignore`` leaves out
    (regexes, block positions, kinds: :mod:`fp4rl.nn.select`). Parameters are shared,
    not copied, so names, the state_dict and any optimizer keep working. Patching an
    already patched model installs the new recipe (and puts back a plain ``nn.Linear``
    where a layer is no longer targeted). ``batch_invariant``: every forward of the model
    gives a token the same logits bits at any batch, padding and decode step
    (:func:`fp4rl.nn.invariant.set_batch_invariant`; None leaves it as it is). Each
    forward tells the FP4 layers which token rows are padding, which a per-tensor scale
    then leaves out. ``weight_cache``: whether the FP4 layers keep the training policy's
    ``Q(W)`` operands for a weight version (:attr:`FP4Linear.cache_weights`, on by
    default; None leaves it as it is). Returns ``model``.
    """
    recipe = as_recipe(recipe)
    keep = filter_fn or in_transformer_block
    ignores = recipe.ignores_in(name for name, _ in model.named_modules())
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and keep(mod, name) and not ignores(name)]
    if not targets:
        raise PatchError("no linear layers to patch: the default targets linears inside "
                         "transformer blocks (names like 'model.layers.0.mlp.down_proj'); "
                         "check filter_fn and the recipe's ignore list")
    chosen = {name for name, _ in targets}
    for name, layer in list(fp4_layers(model).items()):
        if name not in chosen:
            _replace(model, name, _plain_linear(layer))
    for seed, (name, module) in enumerate(targets):
        if isinstance(module, FP4Linear):
            module.set_recipe(recipe)
        else:
            _replace(model, name, FP4Linear.from_linear(module, recipe, seed))
    model.fp4rl_recipe = recipe  # type: ignore[assignment]  # fp4rl's attribute on the model
    install_forward_hooks(model)
    if batch_invariant is not None:
        set_batch_invariant(model, batch_invariant)
    if weight_cache is not None:
        for layer in fp4_layers(model).values():
            layer.cache_weights = weight_cache
    return model


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, child = _split(name)
    setattr(model.get_submodule(parent), child, module)


def _plain_linear(layer: FP4Linear) -> nn.Linear:
    """An ``nn.Linear`` sharing ``layer``'s parameters."""
    plain = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(plain)
    plain.in_features, plain.out_features = layer.in_features, layer.out_features
    plain.weight, plain.bias = layer.weight, layer.bias
    return plain


def fp4_layers(model: nn.Module) -> dict[str, FP4Linear]:
    """The patched layers of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}


def rollout_states(model: nn.Module) -> dict[str, dict[str, object]]:
    """Every patched layer's rollout state by layer name (see ``FP4Linear.rollout_state``)."""
    return {name: layer.rollout_state() for name, layer in fp4_layers(model).items()}


def load_rollout_states(model: nn.Module, states: dict[str, dict[str, object]]) -> None:
    """Restore :func:`rollout_states` (layers missing from ``states`` keep theirs)."""
    for name, layer in fp4_layers(model).items():
        layer.load_rollout_state(states.get(name, {}))


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
    """Mark the start of an RL step: SmoothQuant recalibrates, RHT may redraw its signs, a
    static NVFP4 activation scale is fixed anew."""
    for layer in _layers_or_raise(model):
        layer.begin_step()


@contextlib.contextmanager
def hold_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: within it the caller changes the weights only through optimizer
    steps (``torch.optim``, fused or not: each drops what is kept) or writes that bump a
    parameter's version or move its storage, so the FP4 layers keep what they derive from
    their weights (``Q(W)`` in each GEMM's form, the rollout ``Q(W)``) for a weight version.

    Outside it nothing is kept: a write through ``weight.data`` (a PEFT merge, a loader's
    ``param.data.copy_``, a user's edit between steps) is invisible to any cheap key, so
    plain library use quantizes the master at every GEMM and can never compute with an
    old ``Q(W)``. fp4rl's trainer holds the policy for a step, its engine for a
    ``generate``, TRL's plug-in for a training step. Nested scopes share the outermost;
    entering and leaving it drops everything kept. Returns ``model``."""
    layers = list(fp4_layers(model).values())
    for layer in layers:
        layer.hold()
    try:
        with keep_panels():  # the batch-invariant GEMM's packed weights, by the same rule
            yield model
    finally:
        for layer in layers:
            layer.release()


def needs_static_calibration(model: nn.Module) -> bool:
    """Whether any patched layer's activations (in its current mode) take a static NVFP4
    scale, which :func:`calibrate_static_scales` fixes."""
    return any(layer._static_format() is not None for layer in fp4_layers(model).values())


def copy_static_scales(source: nn.Module, target: nn.Module) -> None:
    """Give ``target``'s patched layers the static NVFP4 scales ``source``'s fixed (by layer
    name): a rollout copy calibrates, the training model it was copied from scores with the
    same scale (one policy)."""
    mine = fp4_layers(target)
    for name, layer in fp4_layers(source).items():
        if name in mine and layer._static is not None:
            mine[name]._static = layer._static.to(mine[name].weight.device)


@contextlib.contextmanager
def calibrate_static_scales(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: the forwards run inside it calibrate every static NVFP4 activation
    scale of ``model``, which is fixed on leaving, for the RL step (until the next
    :func:`begin_step`): the amax of each layer's real input rows over all of them, with
    the layers computing unquantized meanwhile. The scale then depends on the set of
    inputs alone, not on how they were split into forwards or ordered. Where a forward
    raises, no scale is fixed."""
    layers = list(fp4_layers(model).values())
    for layer in layers:
        layer.start_calibration()
    try:
        yield model
    except BaseException:
        for layer in layers:
            layer._calibration = None
        raise
    for layer in layers:
        layer.finish_calibration()
