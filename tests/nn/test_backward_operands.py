"""``train.backward_operands``: the backward GEMMs re-quantizing W and X along their own
reduction axes (the default) or reusing the forward's Q(W) and Q(X) (the authors'
simulation), each held to an explicit slow path built here from ``fp4rl.quantize``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4rl
from fp4rl.errors import RecipeError
from fp4rl.nn import FP4Linear, Recipe, TrainPrecision
from fp4rl.rl.config import ConfigError, load_config

FORMATS = ["hif4", "mxfp4", "nvfp4"]
#: (W axis for dX, X axis for dW) of each scheme, written out rather than imported
AXES = {"requantize": (0, 0), "reuse_forward": (-1, -1)}


def _layer(train: TrainPrecision, seed: int = 0) -> FP4Linear:
    torch.manual_seed(seed)
    return FP4Linear.from_linear(nn.Linear(128, 64), Recipe(train=train))


def _heavy_tailed(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return torch.where(torch.rand(*shape, generator=g) < 0.02, x * 200, x)


def _slow_path(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
               train: TrainPrecision, scheme: str, dtype: torch.dtype
               ) -> tuple[torch.Tensor, ...]:
    """Y, dX, dW as ``dtype`` matmuls of operands quantized independently (from fp32)."""
    def q(t: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
        return (t if fmt == "bf16" else fp4rl.quantize(t, fmt, dim=dim)).to(dtype)

    w_axis, x_axis = AXES[scheme]
    y = q(x, train.activations, -1) @ q(w, train.weights, -1).t() + b.to(dtype)
    dx = q(g, train.gradients, -1) @ q(w, train.weights, w_axis)
    dw = q(g, train.gradients, 0).t() @ q(x, train.activations, x_axis)
    return y, dx, dw


def _run(layer: FP4Linear, x: torch.Tensor, g: torch.Tensor, autocast: bool = False
         ) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", ["requantize", "reuse_forward"])
def test_fp32_gemms_match_slow_path(fmt, scheme):
    train = TrainPrecision(weights=fmt, activations=fmt, gradients=fmt, backward_operands=scheme)
    layer = _layer(train)
    x, g = _heavy_tailed(96, 128, seed=1), _heavy_tailed(96, 64, seed=2)
    got = _run(layer, x, g)
    want = _slow_path(x, layer.weight.detach(), layer.bias.detach(), g, train, scheme,
                      torch.float32)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fmt", ["hif4", "nvfp4"])
def test_bf16_compute_reuse_forward_matches_fp64_slow_path(fmt):
    """Under bf16 autocast the GEMMs keep the exact FP4 operands: within two bf16
    roundings of the fp64 product (the weight gradient in FP32, for the master)."""
    train = TrainPrecision(weights=fmt, activations=fmt, gradients=fmt,
                           backward_operands="reuse_forward")
    layer = _layer(train)
    x, g = _heavy_tailed(80, 128, seed=3), _heavy_tailed(80, 64, seed=4)
    g = g.to(torch.bfloat16).float()  # the incoming gradient is bf16 under autocast
    y, dx, dw = _run(layer, x, g, autocast=True)
    assert dw.dtype == torch.float32
    want = _slow_path(x, layer.weight.detach(), layer.bias.detach(), g, train,
                      "reuse_forward", torch.float64)
    bias = layer.bias.detach().double().abs()
    scales = ((want[0] - layer.bias.detach().double()).abs() + bias, want[1].abs(),
              want[2].abs())
    for got, exact, scale in zip((y, dx, dw), want, scales, strict=True):
        err = (got.double() - exact).abs()
        assert (err <= 2**-7 * scale + 1e-6 * scale.max()).all()


def test_schemes_share_the_forward_and_differ_in_backward():
    x, g = _heavy_tailed(64, 128, seed=5), _heavy_tailed(64, 64, seed=6)
    runs = {s: _run(_layer(TrainPrecision(weights="hif4", activations="hif4", gradients="hif4",
                                          backward_operands=s)),
                    x, g) for s in AXES}
    req, reuse = runs["requantize"], runs["reuse_forward"]
    assert torch.equal(req[0], reuse[0])
    assert not torch.equal(req[1], reuse[1]) and not torch.equal(req[2], reuse[2])


def test_reuse_forward_with_bf16_gradients_is_the_straight_through_gradient():
    """No gradient quantization: the exact gradient of Y = Q(X) Q(W)^T + b, with the
    quantizers passed straight through (autograd of the dense product)."""
    layer = _layer(TrainPrecision(weights="mxfp4", activations="mxfp4", gradients="bf16",
                                  backward_operands="reuse_forward"))
    x, g = _heavy_tailed(64, 128, seed=7), _heavy_tailed(64, 64, seed=8)
    _, dx, dw = _run(layer, x, g)
    w = layer.weight.detach().clone().requires_grad_()
    xs = x.clone().requires_grad_()
    qx = xs + (fp4rl.quantize(x, "mxfp4") - x)  # value Q(X), gradient of the identity
    qw = w + (fp4rl.quantize(w.detach(), "mxfp4") - w.detach())
    (qx @ qw.t()).backward(g)
    torch.testing.assert_close(dx, xs.grad)
    torch.testing.assert_close(dw, w.grad)


@pytest.mark.parametrize("scheme", ["requantize", "reuse_forward"])
def test_saved_activation_is_one_quantized_copy(scheme):
    """Backward keeps one Q(X) per token in the compute dtype (blocked along tokens or,
    reusing the forward's, along in_features) and no copy of the weight."""
    layer = _layer(TrainPrecision(weights="hif4", activations="hif4", gradients="hif4",
                                  backward_operands=scheme))
    x = _heavy_tailed(128, 128, seed=9).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() != layer.weight.data_ptr():
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    assert len(saved) == 1 and saved[0].dtype == torch.bfloat16
    assert saved[0].shape == x.shape
    axis = AXES[scheme][1]
    assert torch.equal(saved[0].float(), fp4rl.quantize(x.detach(), "hif4", dim=axis))


def test_recipe_and_config_accept_the_scheme():
    data = {"train": {"weights": "hif4", "activations": "hif4", "gradients": "hif4",
                      "backward_operands": "reuse_forward"}}
    recipe = Recipe.from_dict(data)
    assert recipe.train.backward_operands == "reuse_forward"
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    assert TrainPrecision().backward_operands == "requantize"
    cfg = load_config(None, ["train.weights=hif4", "train.backward_operands=reuse_forward"])
    assert cfg.recipe().train.backward_operands == "reuse_forward"


def test_bad_scheme_is_refused_with_the_choices():
    with pytest.raises(RecipeError, match=r"train\.backward_operands: 'reuse_fwd' is not a "
                                          r"backward scheme \(did you mean 'reuse_forward'\?\)"
                                          r"; choose one of requantize, reuse_forward, "
                                          r"dequantized"):
        Recipe.from_dict({"train": {"backward_operands": "reuse_fwd"}})
    with pytest.raises(ConfigError, match=r"backward_operands"):
        load_config(None, ["train.backward_operands=exact"])


@pytest.mark.parametrize("fmt", ["hif4", "nvfp4", "nvfp4_per_token"])
def test_dequantized_backward_is_bf16_gemms_on_the_forwards_dequantized_operands(fmt):
    """NeMo-RL's and Miles's backward: dX = dY Q(W) and dW = dY^T Q(X) with the forward's
    operands (blocked along in_features) dequantized, rounded to bf16 once, and dY as it
    is; per-token activation scales included, which reuse_forward refuses."""
    train = TrainPrecision(weights=fmt if fmt != "nvfp4_per_token" else "nvfp4",
                           activations=fmt,
                           backward_operands="dequantized")
    layer = _layer(train)
    x, g = _heavy_tailed(96, 128, seed=11), _heavy_tailed(96, 64, seed=12)
    g = g.to(torch.bfloat16).float()
    _, dx, dw = _run(layer, x, g, autocast=True)
    w = layer.weight.detach()
    qw = fp4rl.quantize(w, train.weights, dim=-1).to(torch.bfloat16).double()
    qx = fp4rl.quantize(x, fmt, dim=-1).to(torch.bfloat16).double()
    gb = g.to(torch.bfloat16).double()  # the incoming gradient is bf16 under autocast
    # fp32 accumulation of exact bf16 products, rounded once to bf16 (dX) or kept in fp32
    # (dW): within one bf16 rounding of the fp64 product, as the bf16 test above bounds it
    for got, exact in ((dx, gb @ qw), (dw, gb.t() @ qx)):
        err = (got.double() - exact).abs()
        assert (err <= 2**-8 * exact.abs() + 1e-6 * exact.abs().max()).all()
    assert dx.dtype == torch.float32 and dw.dtype == torch.float32
    if fmt == "nvfp4":  # the scale kept outside (reuse_forward) instead of rounded in
        reuse = TrainPrecision(weights=fmt, activations=fmt, gradients="bf16",
                               backward_operands="reuse_forward")
        _, dx_reuse, dw_reuse = _run(_layer(reuse), x, g, autocast=True)
        for a, b in ((dx, dx_reuse), (dw, dw_reuse)):
            assert not torch.equal(a, b)  # NVFP4's values times g are not all bf16 numbers
            assert (a - b).norm() / b.norm() < 1e-2


def test_dequantized_backward_takes_unquantized_gradients_only():
    with pytest.raises(RecipeError, match=r"train\.gradients: hif4 with backward_operands: "
                                          r"dequantized.*set gradients: none"):
        TrainPrecision(weights="hif4", activations="hif4", gradients="hif4",
                       backward_operands="dequantized")
    recipe = Recipe.from_dict({"train": {"weights": "nvfp4", "activations": "nvfp4_per_token",
                                         "backward_operands": "dequantized"}})
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    assert recipe.to_dict()["train"]["backward_operands"] == "dequantized"
