"""Rollout-ResQ and the baselines, as functions and as plug-ins of the patched layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp4rl.formats import get_format, quantize
from fp4rl.nn import FP4Linear, Mode, Recipe, RolloutPrecision, get_recipe
from fp4rl.recovery import Recovery
from fp4rl.recovery.resq import resq_activation, resq_matmul
from fp4rl.recovery.rht import hadamard_block
from fp4rl.recovery.sparsity import parse_pattern, sparsify


def outlier_activations(tokens: int = 64, d: int = 256, seed: int = 0) -> torch.Tensor:
    """LLM-like inputs: a few channels 100x larger than the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    x[:, torch.randperm(d, generator=g)[:4]] *= 100.0
    return x


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("pattern", ["dense", "2:4", "channel:0.5", "block:32x64:0.5"])
def test_resq_two_gemm_form_equals_folded(fmt, pattern):
    x, w = outlier_activations(), torch.randn(96, 256)
    folded = resq_matmul(x, w, fmt, pattern)
    two = resq_matmul(x, w, fmt, pattern, two_gemm=True)
    torch.testing.assert_close(folded, two, rtol=1e-5, atol=1e-3)
    qx = quantize(x, fmt)
    explicit = qx @ quantize(w, fmt).t() + sparsify(quantize(x - qx, fmt), pattern) @ \
        quantize(w, fmt).t()
    torch.testing.assert_close(two, explicit)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("pattern", ["dense", "2:4", "4:8"])
@pytest.mark.parametrize("shape", [(7, 576), (33, 100), (128, 1536)])
def test_fused_bf16_terms_equal_the_composed_steps(fmt, pattern, shape):
    """The one-pass kernel's two bf16 operands are Q(x) and S(Q(x - Q(x))) bit for bit
    (partial blocks and groups included), and the bf16 rollout activation uses them."""
    from fp4rl.kernels import resq_terms
    from fp4rl.recovery.resq import ResQ, ResQConfig
    from fp4rl.recovery.sparsity import parse_pattern

    x = outlier_activations(*shape)
    p = parse_pattern(pattern)
    keep, group = (p.n, p.m) if pattern != "dense" else (0, 0)
    terms = resq_terms(get_format(fmt), x, keep, group)
    assert terms is not None and all(t.dtype == torch.bfloat16 for t in terms)
    qx = quantize(x, fmt)
    residual = sparsify(quantize(x - qx, fmt), pattern)
    assert torch.equal(terms[0].float(), qx) and torch.equal(terms[1].float(), residual)
    resq = ResQ(ResQConfig(sparsity=pattern), get_format(fmt), shape[1], seed=0)
    operands = resq.activation(x, torch.bfloat16)
    assert [torch.equal(o.values, t) for o, t in zip(operands, terms, strict=True)] == [True] * 2


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("pattern", ["dense", "2:4"])
def test_bf16_rows_give_the_terms_of_their_float32_widening(fmt, pattern):
    """A bf16 engine hands ResQ bf16 rows: read as they are (one kernel pass, no float32
    copy) they give the same two operands as their exact float32 widening."""
    from fp4rl.recovery.resq import ResQ, ResQConfig

    x = outlier_activations(33, 576).bfloat16()
    x[3, 70] = float("nan")
    resq = ResQ(ResQConfig(sparsity=pattern), get_format(fmt), 576, seed=0)
    got = resq.activation(x, torch.bfloat16)
    want = resq.activation(x.float(), torch.bfloat16)
    for g, w in zip(got, want, strict=True):
        assert g.values.dtype == w.values.dtype
        assert torch.equal(g.values.view(torch.int16), w.values.view(torch.int16))
        assert (g.scale is None) == (w.scale is None)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
@pytest.mark.parametrize("inference", [False, True])
def test_the_stacked_resq_terms_enter_the_gemm_without_a_copy(fmt, inference):
    """The kernel's two operands are halves of one buffer: mm multiplies that buffer in
    place (the product equals stacking copies), while terms elsewhere are copied. It holds
    under ``torch.inference_mode`` too, where views keep no ``_base`` (a serving engine)."""
    from fp4rl.gemm import Operand, mm, stack_rows
    from fp4rl.recovery.resq import ResQ, ResQConfig

    x = outlier_activations(16, 256).bfloat16()
    with torch.inference_mode(inference):
        resq = ResQ(ResQConfig(sparsity="2:4"), get_format(fmt), 256, seed=0)
        terms = resq.activation(x, torch.bfloat16)
    stacked = stack_rows([t.values for t in terms])
    assert stacked.data_ptr() == terms[0].values.data_ptr() and stacked.shape == (32, 256)
    assert torch.equal(stacked, torch.cat([t.values for t in terms]))
    apart = [terms[1].values.clone(), terms[0].values.clone()]
    assert torch.equal(stack_rows(apart), torch.cat(apart))
    assert stack_rows(apart).data_ptr() not in (a.data_ptr() for a in apart)
    w = Operand(quantize(torch.randn(64, 256), fmt).bfloat16())
    copies = [Operand(t.values.clone()) for t in terms]
    assert torch.equal(mm(terms, w.t(), torch.bfloat16), mm(copies, w.t(), torch.bfloat16))


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_resq_reduces_activation_error(fmt):
    """Dense ResQ beats 2:4 beats plain FP4 in activation error, on outlier inputs."""
    x = outlier_activations()
    plain = rel_err(quantize(x, fmt), x)
    sparse = rel_err(resq_activation(x, get_format(fmt), parse_pattern("2:4")), x)
    dense = rel_err(resq_activation(x, get_format(fmt), parse_pattern("dense")), x)
    assert dense < sparse < plain


def test_resq_restores_collapsed_zeros():
    """2:4 restores at most 2 of every 4 residuals; dense restores most (the residual of
    an outlier channel can collapse its block a second time)."""
    x = outlier_activations()
    zeros_plain = (quantize(x, "hif4") == 0).float().mean()
    hif4 = get_format("hif4")
    zeros_24 = (resq_activation(x, hif4, parse_pattern("2:4")) == 0).float().mean()
    zeros_dense = (resq_activation(x, hif4, parse_pattern("dense")) == 0).float().mean()
    assert zeros_plain > 0.3
    assert 0.4 * zeros_plain < zeros_24 < 0.6 * zeros_plain
    assert zeros_dense < 0.2 * zeros_plain


def _rollout_layer(method: str, act: str = "bf16", weights: str = "bf16",
                   **kw: object) -> FP4Linear:
    torch.manual_seed(0)
    recipe = Recipe(rollout=RolloutPrecision(weights=weights, activations=act,
                                             recovery=Recovery.make(method, **kw)))
    layer = FP4Linear.from_linear(nn.Linear(256, 96), recipe)
    layer.mode = Mode.ROLLOUT
    return layer


@pytest.mark.parametrize("method", ["smoothquant", "rht", "occ"])
def test_baselines_are_exact_transforms_without_quantization(method):
    """With float32-exact operands (bf16 off), each baseline reproduces X W^T + b."""
    layer = _rollout_layer(method, act="bf16", weights="bf16")
    x = outlier_activations().bfloat16().float()
    layer.weight.data = layer.weight.data.bfloat16().float()
    ref = x @ layer.weight.t() + layer.bias
    assert rel_err(layer(x), ref) < 2e-2


@pytest.mark.parametrize("method", ["none", "resq", "smoothquant", "rht", "occ"])
def test_baselines_help_on_outliers(method):
    """On outlier-heavy inputs, every method's FP4 output error is finite and bounded."""
    layer = _rollout_layer(method, act="mxfp4", weights="mxfp4")
    x = outlier_activations()
    ref = x @ layer.weight.t() + layer.bias
    err = rel_err(layer(x), ref)
    plain = rel_err(_rollout_layer("none", "mxfp4", "mxfp4")(x), ref)
    assert err < 0.5
    if method in ("resq", "occ", "rht"):
        assert err < plain


def test_smoothquant_calibrates_once_per_step():
    layer = _rollout_layer("smoothquant", "hif4", "hif4")
    layer.hold()  # the weights held, as the trainer holds them for a step
    x1, x2 = outlier_activations(seed=1), outlier_activations(seed=2)
    layer(x1)
    scales, version = layer.recovery.scales.clone(), layer.recovery.version
    cached = layer.rollout_weight()
    layer(x2)  # same step: scales and the quantized weight are reused
    assert torch.equal(layer.recovery.scales, scales) and layer.rollout_weight() is cached
    layer.begin_step()
    layer(x2)  # new step: recalibrated from live activations, weight re-quantized
    assert layer.recovery.version == version + 1
    assert not torch.equal(layer.recovery.scales, scales)
    assert layer.rollout_weight() is not cached
    expected = x2.abs().amax(0).pow(0.5) / layer.weight.abs().amax(0).pow(0.5)
    torch.testing.assert_close(layer.recovery.scales, expected.detach())


@pytest.mark.parametrize("fresh", [False, True])
def test_rht_signs_fixed_or_fresh(fresh):
    layer = _rollout_layer("rht", "hif4", "hif4", fresh_signs=fresh)
    signs = layer.recovery.signs.clone()
    layer.begin_step()
    assert torch.equal(layer.recovery.signs, signs) != fresh


def test_rht_block_fits_reduction_axis():
    assert hadamard_block(576, 128) == 64
    assert hadamard_block(1536, 128) == 128
    assert hadamard_block(4096, 256) == 256


def test_preset_builds_every_recovery():
    for name in ["hif4+resq-2:4", "hif4+smoothquant", "hif4+rht", "hif4+occ", "hif4"]:
        layer = FP4Linear.from_linear(nn.Linear(128, 64), get_recipe(name))
        layer.mode = Mode.ROLLOUT
        assert layer(torch.randn(4, 128)).shape == (4, 64)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("pattern", ["dense", "2:4", "1:4", "4:8", "3:8"])
@pytest.mark.parametrize("length", [256, 100, 7])
def test_fused_resq_kernel_matches_composed_steps(fmt, pattern, length):
    x = outlier_activations(tokens=9, d=256)[:, :length].contiguous()
    x[2, 3] = float("nan")
    x[4, :5] = x[4, 5]  # exact ties inside 2:4 groups
    qx = quantize(x, fmt)
    composed = qx + sparsify(quantize(x - qx, fmt), pattern)
    fused = resq_activation(x, get_format(fmt), parse_pattern(pattern))
    assert torch.equal(fused.view(torch.int32), composed.view(torch.int32)) or \
        torch.equal(torch.nan_to_num(fused, 7.0), torch.nan_to_num(composed, 7.0))


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "nvfp4"])
def test_resqw_repairs_the_weight_as_resq_repairs_the_activation(fmt):
    """ResQ-W's rollout output is X_eff W_eff^T with W_eff = Q(W) + S(Q(W - Q(W))),
    computed here independently in float64; in bf16 compute it stays within bf16
    rounding of that, and the weight residual brings the output closer to X W^T."""
    torch.manual_seed(0)
    x, linear = outlier_activations(tokens=16, d=128), nn.Linear(128, 64, bias=True)
    layer = FP4Linear.from_linear(linear, get_recipe(f"{fmt}+resqw-2:4"))
    layer.mode = Mode.ROLLOUT
    w = linear.weight.detach()
    qw = quantize(w, fmt)
    w_eff = qw + sparsify(quantize(w - qw, fmt), "2:4")
    x_eff = resq_activation(x, get_format(fmt), parse_pattern("2:4"))
    ref = x_eff.double() @ w_eff.double().t() + linear.bias.detach().double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_bf16 = layer(x)
    assert y_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(y_bf16.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max())
    exact = x.double() @ w.double().t() + linear.bias.detach().double()
    resq_only = x_eff.double() @ qw.double().t() + linear.bias.detach().double()
    assert rel_err(ref, exact) < rel_err(resq_only, exact)
    assert layer.recovery.reads_weight  # a rollout engine needs more than Q(W)

