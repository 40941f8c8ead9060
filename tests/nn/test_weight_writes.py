"""No write path leaves an FP4 layer computing with an old ``Q(W)``.

Each writer below changes a layer's weights the way a user's code, a library or fp4rl does;
after it, the layer's next forward (training and rollout policy) must equal that of a new
layer built from the new weights. Outside :func:`fp4rl.nn.hold_weights` every writer passes
(nothing is kept); inside it, the writers a key sees (optimizer steps, writes that bump a
version or move a storage) pass too, and writes through ``.data`` are what the scope's
contract excludes: they are seen at the next scope, as between two training steps.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import fp4rl
from fp4rl.nn import FP4Linear, Mode, get_recipe, hold_weights

RECIPES = ["hif4", "nvfp4", "hif4+resqw-2:4"]

Writer = Callable[[FP4Linear], None]


def _new_values(layer: FP4Linear, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layer.weight.shape, generator=g) * 0.3


def _data_mul(layer: FP4Linear) -> None:
    layer.weight.data.mul_(-1)


def _data_copy(layer: FP4Linear) -> None:
    layer.weight.data.copy_(_new_values(layer))


def _data_assign(layer: FP4Linear) -> None:
    layer.weight.data = _new_values(layer)


def _peft_merge(layer: FP4Linear) -> None:
    """A LoRA adapter merged as PEFT merges it: ``base.weight.data += B @ A * scaling``."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, layer.in_features, generator=g), torch.randn(layer.out_features, 4,
                                                                       generator=g)
    layer.weight.data += (b @ a) * 0.5


def _peft_merge_unmerge(layer: FP4Linear) -> None:
    """Merged, used (a forward with the merged weights), then unmerged."""
    _peft_merge(layer)
    with torch.no_grad():
        layer(torch.randn(2, layer.in_features))
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, layer.in_features, generator=g), torch.randn(layer.out_features, 4,
                                                                       generator=g)
    layer.weight.data -= (b @ a) * 0.5
    layer.weight.data.mul_(1.25)  # and changed beyond the round trip, so a stale Q(W) shows


def _load_state_dict(layer: FP4Linear) -> None:
    layer.load_state_dict({**layer.state_dict(), "weight": _new_values(layer)})


def _load_state_dict_assign(layer: FP4Linear) -> None:
    layer.load_state_dict({**layer.state_dict(), "weight": _new_values(layer)}, assign=True)


def _vector_to_parameters(layer: FP4Linear) -> None:
    vec = nn.utils.parameters_to_vector(layer.parameters())
    nn.utils.vector_to_parameters(vec * -0.5, layer.parameters())


def _set(layer: FP4Linear) -> None:
    with torch.no_grad():
        layer.weight.set_(_new_values(layer))


def _in_place(layer: FP4Linear) -> None:
    with torch.no_grad():
        layer.weight.mul_(-2)


def _optimizer(name: str, **options: object) -> Writer:
    def step(layer: FP4Linear) -> None:
        opt = getattr(torch.optim, name)(layer.parameters(), lr=0.1, **options)
        layer.weight.grad = torch.ones_like(layer.weight)
        if layer.bias is not None:
            layer.bias.grad = torch.ones_like(layer.bias)
        opt.step()
    step.__name__ = f"{name}{options or ''}"
    return step


def _dcp_load(layer: FP4Linear, tmp: str) -> None:
    from torch.distributed import checkpoint as dcp

    saved = {"weight": _new_values(layer), "bias": layer.bias.detach().clone()}
    dcp.save(saved, checkpoint_id=tmp)
    state = layer.state_dict()
    dcp.load(state, checkpoint_id=tmp)


#: writers any held scope sees (a version bump, a new storage or an optimizer step)
SEEN = [_load_state_dict, _load_state_dict_assign, _vector_to_parameters, _set, _in_place,
        _optimizer("SGD", momentum=0.9), _optimizer("Adam"), _optimizer("AdamW", fused=True),
        _optimizer("AdamW", foreach=True), _optimizer("Adagrad"), _optimizer("RMSprop")]
#: writers through ``.data``: no key sees them, so nothing may be kept across them
UNSEEN = [_data_mul, _data_copy, _data_assign, _peft_merge, _peft_merge_unmerge]


def _fresh(layer: FP4Linear) -> FP4Linear:
    """A new layer of the same recipe on a copy of ``layer``'s current weights."""
    plain = nn.Linear(layer.in_features, layer.out_features)
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
        plain.bias.copy_(layer.bias)
    new = FP4Linear.from_linear(plain, layer.recipe, seed=layer.seed)
    new.mode = layer.mode
    return new


def _outputs(layer: FP4Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """The forward of both policies (and the training one's input gradient)."""
    out = []
    for mode in (Mode.TRAIN, Mode.ROLLOUT):
        layer.mode = mode
        xi = x.clone().requires_grad_(mode is Mode.TRAIN)
        y = layer(xi)
        out.append(y.detach())
        if mode is Mode.TRAIN:
            y.sum().backward()
            out.append(xi.grad)
    layer.mode = Mode.TRAIN
    return out


def _check(layer: FP4Linear, x: torch.Tensor) -> None:
    for got, want in zip(_outputs(layer, x), _outputs(_fresh(layer), x), strict=True):
        assert torch.equal(got, want)


def _layer(recipe: str) -> FP4Linear:
    torch.manual_seed(0)
    return FP4Linear.from_linear(nn.Linear(64, 48), get_recipe(recipe))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("writer", SEEN + UNSEEN, ids=lambda w: w.__name__)
def test_plain_use_never_computes_with_an_old_q_w(recipe: str, writer: Writer) -> None:
    """Outside any scope: after each writer the layer computes with the new weights."""
    layer = _layer(recipe)
    x = torch.randn(5, 64)
    _outputs(layer, x)  # a forward of both policies before the write
    writer(layer)
    _check(layer, x)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("writer", SEEN, ids=lambda w: w.__name__)
def test_a_held_scope_sees_every_write_a_key_can_see(recipe: str, writer: Writer) -> None:
    layer = _layer(recipe)
    x = torch.randn(5, 64)
    with hold_weights(layer):
        _outputs(layer, x)
        assert layer._kept.train  # the scope keeps Q(W)
        writer(layer)
        _check(layer, x)


@pytest.mark.parametrize("writer", UNSEEN, ids=lambda w: w.__name__)
def test_a_data_write_between_two_held_steps_is_seen(writer: Writer) -> None:
    """The trainer holds the weights for a step; a ``.data`` write between steps (a
    loader, a PEFT merge, a user's edit) is met by nothing kept."""
    layer = _layer("hif4")
    x = torch.randn(5, 64)
    with hold_weights(layer):
        _outputs(layer, x)
    writer(layer)
    with hold_weights(layer):
        _check(layer, x)


def test_a_dcp_load_is_seen(tmp_path) -> None:
    layer = _layer("hif4")
    x = torch.randn(5, 64)
    with hold_weights(layer):
        _outputs(layer, x)
    _dcp_load(layer, str(tmp_path / "ckpt"))
    assert torch.equal(layer.weight.detach(), _new_values(layer))
    with hold_weights(layer):
        _check(layer, x)


def test_a_received_q_w_holds_until_the_weight_changes() -> None:
    """A rollout copy's ``Q(W)`` sent by a sharded trainer (fp4rl's refresh) is used in
    place of its own, inside or outside a scope, until its weight is written again."""
    sender, copy = _layer("hif4"), _layer("hif4")
    with torch.no_grad():
        sender.weight.mul_(1.5)
    copy.receive_rollout_weight(sender.rollout_weight())
    copy.mode = sender.mode = Mode.ROLLOUT
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(copy(x), sender(x))
        with hold_weights(copy):
            assert torch.equal(copy(x), sender(x))
        copy.load_state_dict(sender.state_dict())  # written: its own Q(W) again
        assert torch.equal(copy(x), sender(x))
        assert copy._received_weight() is None


def test_a_model_held_keeps_and_leaving_drops() -> None:
    model, _ = fp4rl.models.tiny_model("llama")
    fp4rl.quantize_model(model, "hif4")
    ids = torch.randint(0, 100, (2, 6))
    layers = list(fp4rl.nn.fp4_layers(model).values())
    with hold_weights(model), hold_weights(model):  # nested: one scope
        model(ids).logits.sum().backward()
        assert all(layer.weight_cache_bytes() > 0 for layer in layers)
    assert all(layer.weight_cache_bytes() == 0 and layer._held == 0 for layer in layers)
