"""``train.wgrad_hadamard``: the weight-gradient GEMM's dY and X rotated along the tokens
by a random Hadamard transform of 16-token blocks before they are quantized (torchao's
NVFP4 training). The rotation is orthonormal, so unquantized it leaves the gradient as
it is; quantized, the GEMM multiplies Q(R dY)^T Q(R X)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp4rl.errors import RecipeError
from fp4rl.formats import get_format
from fp4rl.nn.linear import FP4Linear, rotate_tokens
from fp4rl.nn.recipe import Recipe, TrainPrecision


def _dense_rotation(tokens: int, signs: torch.Tensor) -> torch.Tensor:
    """The block-diagonal ``H_16 diag(s) / 4`` over ``tokens`` (a multiple of 16), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    block = h * signs.double() / 4.0
    return torch.block_diag(*[block] * (tokens // 16))


def _layer(fmt: str, how: str, seed: int = 0) -> FP4Linear:
    train = TrainPrecision(weights=fmt, activations=fmt, gradients=fmt, wgrad_hadamard=how)
    return FP4Linear.from_linear(nn.Linear(64, 32, bias=False), Recipe(train=train), seed)


def _grad_w(layer: FP4Linear, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    layer.weight.grad = None
    layer(x).backward(g)
    return layer.weight.grad.clone()


def test_the_rotation_is_the_block_hadamard_along_the_tokens():
    torch.manual_seed(0)
    x, signs = torch.randn(40, 24), torch.randint(0, 2, (16,)) * 2.0 - 1
    r = _dense_rotation(48, signs)
    padded = torch.cat([x.double(), torch.zeros(8, 24, dtype=torch.float64)])
    torch.testing.assert_close(rotate_tokens(x, signs).double(), r @ padded, rtol=0, atol=1e-5)


def test_unquantized_it_leaves_the_gradient_as_it_is():
    torch.manual_seed(1)
    x, g = torch.randn(37, 64), torch.randn(37, 32)
    plain, rotated = _layer("none", "off"), _layer("none", "fixed")
    rotated.weight = plain.weight
    torch.testing.assert_close(_grad_w(rotated, x, g), _grad_w(plain, x, g), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("fmt", ["nvfp4", "hif4", "mxfp4"])
def test_quantized_it_multiplies_the_rotated_quantized_operands(fmt):
    torch.manual_seed(2)
    x, g = torch.randn(48, 64) * torch.exp(torch.randn(48, 64)), torch.randn(48, 32)
    layer = _layer(fmt, "fixed", seed=7)
    signs = layer._wgrad_signs
    f = get_format(fmt)
    qg = f.quantize_reference(rotate_tokens(g, signs), dim=0).double()
    qx = f.quantize_reference(rotate_tokens(x, signs), dim=0).double()
    expected = (qg.t() @ qx).float()
    torch.testing.assert_close(_grad_w(layer, x, g), expected, rtol=1e-5, atol=1e-5)
    unrotated = _layer(fmt, "off", seed=7)
    unrotated.weight = layer.weight
    assert not torch.equal(_grad_w(unrotated, x, g), _grad_w(layer, x, g))


def test_fixed_signs_are_a_layers_own_and_fresh_ones_follow_torchs_seed():
    torch.manual_seed(3)
    x, g = torch.randn(32, 64), torch.randn(32, 32)
    fixed = _layer("hif4", "fixed", seed=5)
    assert torch.equal(_grad_w(fixed, x, g), _grad_w(fixed, x, g))
    assert torch.equal(fixed._wgrad_signs, _layer("hif4", "fixed", seed=5)._wgrad_signs)
    fresh = _layer("hif4", "fresh")
    grads = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        grads.append(_grad_w(fresh, x, g))
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def test_it_needs_the_requantized_backward():
    with pytest.raises(RecipeError, match=r"train\.wgrad_hadamard: fixed .* requantize"):
        TrainPrecision(weights="hif4", activations="hif4", wgrad_hadamard="fixed",
                       backward_operands="reuse_forward")
    with pytest.raises(RecipeError, match="wgrad_hadamard"):
        TrainPrecision(wgrad_hadamard="sometimes")
