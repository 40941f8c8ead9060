"""FP4 linear layers: quantized GEMMs, autograd, patching, modes, rollout weight cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4rl
from fp4rl.models import tiny_model
from fp4rl.nn import FP4Linear, Mode, PatchError, Recipe, TrainPrecision, fp4_layers, get_recipe

FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token"]


def _layer(recipe: Recipe, bias: bool = True, seed: int = 0) -> FP4Linear:
    torch.manual_seed(seed)
    return FP4Linear.from_linear(nn.Linear(128, 64, bias=bias), recipe)


@pytest.mark.parametrize("fmt", FORMATS)
def test_train_gemms_match_explicit_slow_path(fmt):
    """fp32 compute: the three GEMMs equal products of the reference-quantized operands."""
    train = get_recipe(fmt).train  # nvfp4_per_token: NVFP4 weights, per-token X and dY
    layer = _layer(Recipe(train=train))
    x = torch.randn(3, 40, 128, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    x2, w, g = x.detach().reshape(-1, 128), layer.weight.detach(), dy.reshape(-1, 64)
    ref = lambda t, d: fp4rl.get_format(fmt).quantize_reference(t, dim=d)  # noqa: E731
    ref_w = lambda d: fp4rl.get_format(train.weights).quantize_reference(w, dim=d)  # noqa: E731
    want_y = ref(x2, -1) @ ref_w(-1).t() + layer.bias.detach()
    want_dx = ref(g, -1) @ ref_w(0)             # reduction over out_features
    want_dw = ref(g, 0).t() @ ref(x2, 0)        # reduction over tokens
    torch.testing.assert_close(y.detach().reshape(-1, 64), want_y)
    torch.testing.assert_close(x.grad.reshape(-1, 128), want_dx)
    torch.testing.assert_close(layer.weight.grad, want_dw)
    torch.testing.assert_close(layer.bias.grad, g.sum(0))


def test_bf16_recipe_matches_plain_linear_gradients():
    torch.manual_seed(0)
    plain = nn.Linear(128, 64)
    layer = FP4Linear.from_linear(nn.Linear(128, 64), Recipe())
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(16, 128)
    for mod in (plain, layer):
        mod(x).square().sum().backward()
    rel = (layer.weight.grad - plain.weight.grad).norm() / plain.weight.grad.norm()
    assert rel < 1e-2  # bf16 keeps 8 significant bits of each operand


def test_fp4_gradients_stay_close_to_exact():
    """A sanity floor: HiF4 weight gradients keep a positive cosine with exact ones."""
    torch.manual_seed(0)
    plain = nn.Linear(128, 64)
    layer = FP4Linear.from_linear(nn.Linear(128, 64), get_recipe("hif4"))
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(256, 128)
    for mod in (plain, layer):
        mod(x).square().sum().backward()
    cos = torch.nn.functional.cosine_similarity(layer.weight.grad.flatten(),
                                                plain.weight.grad.flatten(), dim=0)
    assert cos > 0.95


def test_stochastic_gradients_follow_torch_seed():
    recipe = Recipe(train=TrainPrecision(weights="hif4", activations="hif4", gradients="hif4",
                                         stochastic_gradients=True))
    grads = []
    for seed in (1, 1, 2):
        layer = _layer(recipe)
        torch.manual_seed(seed)
        layer(torch.ones(8, 128)).sum().backward()
        grads.append(layer.weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_patching_keeps_names_and_state(arch):
    model, _ = tiny_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = dict(model.named_parameters())
    fp4rl.quantize_model(model, "hif4+resq-2:4")
    layers = fp4_layers(model)
    n_layers = model.config.num_hidden_layers
    assert len(layers) == 7 * n_layers  # q k v o gate up down
    assert not isinstance(model.lm_head, FP4Linear)
    assert all(".layers." in name for name in layers)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params_before[n] for n, p in model.named_parameters())


def test_patch_twice_changes_recipe_only():
    model, _ = tiny_model("llama")
    fp4rl.quantize_model(model, "hif4")
    layer = model.model.layers[0].mlp.down_proj
    fp4rl.quantize_model(model, "mxfp4")
    assert model.model.layers[0].mlp.down_proj is layer
    assert str(layer.recipe.train.weights) == "mxfp4"


def test_patch_errors():
    with pytest.raises(PatchError, match="no linear layers"):
        fp4rl.quantize_model(nn.Sequential(nn.Linear(4, 4)), "hif4")
    model, _ = tiny_model("llama")
    with pytest.raises(PatchError, match="quantize_model"), fp4rl.rollout_mode(model):
        pass


def test_modes_switch_and_restore():
    model, _ = tiny_model("llama")
    fp4rl.quantize_model(model, "hif4")
    layers = list(fp4_layers(model).values())
    with fp4rl.rollout_mode(model):
        assert all(layer.mode == "rollout" for layer in layers)
        with fp4rl.train_mode(model):
            assert all(layer.mode == "train" for layer in layers)
        assert all(layer.mode == "rollout" for layer in layers)
    assert all(layer.mode == "train" for layer in layers)


def test_rollout_and_train_policies_differ_only_by_recipe():
    model, _ = tiny_model("llama")
    ids = torch.tensor([[3, 9, 27, 81, 40, 12]])
    fp4rl.quantize_model(model, "hif4:fp4/fp4")
    with torch.no_grad():
        train_logits = model(input_ids=ids).logits
        with fp4rl.rollout_mode(model):
            rollout_logits = model(input_ids=ids).logits
    torch.testing.assert_close(train_logits, rollout_logits)  # same formats, same math
    fp4rl.quantize_model(model, "hif4:fp4/fp4+resq-dense")
    with torch.no_grad(), fp4rl.rollout_mode(model):
        assert not torch.equal(model(input_ids=ids).logits, train_logits)


def test_rollout_weight_quantized_once_per_version():
    """The rollout forward reuses one Q(W) until the weight changes: the cached operand
    is the very object every forward reads, and an optimizer step makes a new one, equal
    to Q of the new weight."""
    layer = _layer(get_recipe("hif4"))
    layer.mode = Mode.ROLLOUT
    layer.hold()  # the weights held, as an engine's generate or a trainer's step does
    first = layer.rollout_weight()
    for _ in range(5):
        layer(torch.randn(2, 128))
        assert layer.rollout_weight() is first
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer.weight.grad = torch.randn_like(layer.weight)
    opt.step()
    second = layer.rollout_weight()
    assert second is not first and not torch.equal(second.values, first.values)
    assert torch.equal(second.dense(), fp4rl.quantize(layer.weight.detach(), "hif4"))
    assert layer.rollout_weight() is second
    layer.release()  # outside the scope nothing is kept
    assert layer.rollout_weight() is not layer.rollout_weight()


@pytest.mark.parametrize("options", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_any_optimizer_step_makes_the_cached_rollout_weight_stale(options):
    """A fused AdamW writes the parameter's storage without bumping its version counter:
    the rollout policy must still see the new weights at its next forward."""
    from fp4rl.gemm import quantize_operand

    layer = FP4Linear(64, 32, recipe=get_recipe("hif4"))
    layer.mode = Mode.ROLLOUT
    layer.hold()
    x = torch.randn(3, 64)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, **options)
    with torch.no_grad():
        layer(x)  # caches Q(W)
    layer.weight.grad = torch.randn_like(layer.weight)
    opt.step()
    want = quantize_operand(layer.weight.detach(), fp4rl.get_format("hif4"))
    assert torch.equal(layer.rollout_weight().values, want.values)


def _fwd_bwd(layer: FP4Linear, x: torch.Tensor, g: torch.Tensor, bf16: bool):
    x = x.clone().requires_grad_()
    layer.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = layer(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad.clone()


@pytest.mark.parametrize("recipe", ["hif4", "nvfp4", "hif4:fp4-reuse/fp4", "miles-nvfp4"])
@pytest.mark.parametrize("bf16", [False, True])
def test_kept_weight_operands_give_the_same_bits_and_follow_every_update(recipe, bf16):
    """The training policy's Q(W) operands, kept for a weight version, give every
    micro-batch's output and gradients bit for bit as quantizing the master each time
    does; an optimizer step (fused too), an in-place update and load_state_dict each make
    them stale (tested against a layer that keeps none)."""
    g = torch.Generator().manual_seed(0)
    kept = FP4Linear(64, 48, recipe=get_recipe(recipe))
    fresh = FP4Linear(64, 48, recipe=get_recipe(recipe))
    fresh.load_state_dict(kept.state_dict())
    fresh.cache_weights = False
    kept.hold()
    fresh.hold()
    opt = torch.optim.AdamW(kept.parameters(), lr=0.05, fused=True)

    def same(step: int) -> None:
        x, dy = torch.randn(8, 64, generator=g), torch.randn(8, 48, generator=g)
        for a, b in zip(_fwd_bwd(kept, x, dy, bf16), _fwd_bwd(fresh, x, dy, bf16),
                        strict=True):
            assert torch.equal(a, b), step

    same(0)
    assert kept.weight_cache_bytes() > 0 and fresh.weight_cache_bytes() == 0
    same(1)  # a second micro-batch reads the kept operands
    opt.step()  # fused: no version bump; the step count drops them
    assert kept.weight_cache_bytes() == 0
    fresh.load_state_dict(kept.state_dict())
    same(2)
    with torch.no_grad():
        kept.weight.mul_(1.5)
        fresh.weight.mul_(1.5)
    same(3)
    state = {k: v * 0.5 for k, v in kept.state_dict().items()}
    kept.load_state_dict(state)
    fresh.load_state_dict(state)
    same(4)


def test_the_weight_cache_option_turns_it_off():
    model, _ = tiny_model("llama")
    fp4rl.quantize_model(model, "hif4", weight_cache=False)
    assert not any(layer.cache_weights for layer in fp4_layers(model).values())
    ids = torch.randint(0, 100, (2, 6))
    with fp4rl.nn.hold_weights(model):
        model(ids).logits.sum().backward()
        assert all(layer.weight_cache_bytes() == 0 for layer in fp4_layers(model).values())
    fp4rl.quantize_model(model, "hif4", weight_cache=True)
    with fp4rl.nn.hold_weights(model):
        model(ids).logits.sum().backward()
        assert all(layer.weight_cache_bytes() > 0 for layer in fp4_layers(model).values())
    # leaving the scope drops them; plain library use keeps nothing
    assert all(layer.weight_cache_bytes() == 0 for layer in fp4_layers(model).values())
    model(ids).logits.sum().backward()
    assert all(layer.weight_cache_bytes() == 0 for layer in fp4_layers(model).values())
