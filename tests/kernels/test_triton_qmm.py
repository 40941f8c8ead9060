"""The quantize-on-load training GEMM (``fp4rl.kernels.triton_qmm``) and the per-vector
amax kernel, under Triton's interpreter, against quantizing first and multiplying after
(``quantize_operand`` + ``mm``), bit for bit.

The kernel's tile products and fp32 sums are a GEMM's, in its own order. Two kinds of
data make every sum exact, so that the bits must be the reference's whatever the order:
small integers times a power of two per value (every product and partial sum is a float32
integer multiple of 2^-8), and any data against a kept operand with one non-zero a column
(one product per output). The second puts NaN, Inf and zero blocks through the quantizer."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from fp4rl.formats import get_format
from fp4rl.gemm import mm, on_load, quantize_operand
from fp4rl.kernels import triton_quant
from fp4rl.kernels.triton_qmm import qmm

#: every format that declares the kernel, one per kernel code, with NVFP4's per-tensor
#: and per-token scales
FORMATS = ["hif4", "mxfp4", "mxfp8_e4m3", "nvfp4", "nvfp4_per_token"]
M, K, N = 70, 200, 90  # ragged: no multiple of a tile, K not of HiF4's 64


@pytest.fixture(autouse=True)
def _on_load(monkeypatch):
    monkeypatch.setenv("FP4RL_QUANTIZE_ON_LOAD", "1")
    monkeypatch.setenv("FP4RL_KERNELS", "triton")


def exact(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-7, 8, shape, generator=g).float()
    return ints * 2.0 ** torch.randint(-1, 2, shape, generator=g).float()


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32])
def test_the_forward_quantizes_the_activations_as_the_quantizer(name, bias):
    """Y = Q(X) Q(W)^T + b from a float32 X: the scales (per tensor, per token) and the
    bias in mm's epilogue order, one rounding to bf16."""
    f = get_format(name)
    x, w = exact(M, K, seed=1), exact(N, K, seed=2)
    b = None if bias is None else exact(N, seed=3).to(bias)
    qw = quantize_operand(w, f, -1, out_dtype=torch.bfloat16)  # its scale one a column
    want = mm(quantize_operand(x, f, -1), qw.t(), torch.bfloat16, b)
    a = on_load(x, f, -1)
    bias_in = b.to(torch.bfloat16) if b is not None and a.scale is None and qw.scale is None \
        else b
    got = qmm(x, f, a.scale, qw.values.t(), None, None if qw.scale is None else qw.scale.t(),
              bias_in, torch.bfloat16)
    _equal(got, want)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_the_backward_gemms_quantize_along_their_reduction_axes(name, source):
    """dX = Q(dY) Q(W) written as the float32 gradient, and dW = Q(dY)^T Q(X) with both
    operands quantized along the tokens, read in place through their strides."""
    f = get_format(name)
    g, x = exact(M, N, seed=4).to(source), exact(M, K, seed=5)
    qw0 = quantize_operand(exact(N, K, seed=6), f, 0, out_dtype=torch.bfloat16)
    want_x = mm(quantize_operand(g, f, -1), qw0, torch.bfloat16).float()
    gs = on_load(g, f, -1)
    _equal(qmm(g, f, gs.scale, qw0.values, None, qw0.scale, None, torch.float32), want_x)
    want_w = mm(quantize_operand(g, f, 0).t(), quantize_operand(x, f, 0), torch.bfloat16)
    gc, xc = on_load(g, f, 0).t(), on_load(x, f, 0)
    _equal(qmm(gc.source, f, gc.scale, x, f, xc.scale, None, torch.float32), want_w.float())


@pytest.mark.parametrize("name", FORMATS)
def test_any_data_quantizes_to_the_quantizers_bits(name):
    """Normal data with a NaN block, an Inf and a zero block: against a kept operand with
    one non-zero a column each output is one product, so the kernel's quantized operand is
    read back exactly (NaN where the quantizer gives NaN). The reference sums the products
    elementwise: a CPU GEMM library may spread a row's NaN to its neighbour row."""
    f = get_format(name)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(7)) * 3
    x[3, :40] = float("nan")
    x[5, 70] = float("inf")
    x[9, :] = 0.0
    pick = torch.zeros(K, N)
    pick[torch.arange(N) * 2 % K, torch.arange(N)] = 0.5
    q = quantize_operand(x, f, -1)
    products = q.values.float()[:, :, None] * pick[None, :, :]
    scale = torch.ones(()) if q.scale is None else q.scale
    want = (products.sum(1) * scale).bfloat16()
    a = on_load(x, f, -1)
    got = qmm(x, f, a.scale, pick.bfloat16(), None, None, None, torch.bfloat16)
    _equal(got, want)
    assert got[3].isnan().all() and not got[2].isnan().any()


def test_an_operand_of_another_type_is_refused():
    f = get_format("hif4")
    with pytest.raises(ValueError, match="kept operand"):
        qmm(torch.zeros(4, 64), f, None, torch.zeros(64, 8), None, None, None, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_amax_is_the_finite_maximum_of_each_row_and_column(dtype):
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(8)).to(dtype)
    x[2, 5], x[4, 7], x[6, :] = float("nan"), float("-inf"), 0.0
    x[:, 9] = -0.0
    finite = torch.where(torch.isfinite(x), x.abs(), 0).float()
    for dim in (-1, 0):
        _equal(triton_quant.vector_amax(x, dim), finite.amax(dim, keepdim=True))
        _equal(triton_quant.vector_amax(x.t(), dim), finite.t().amax(dim, keepdim=True))
    rows, cols = triton_quant.vector_amax_both(x)
    _equal(rows, finite.amax(-1, keepdim=True))
    _equal(cols, finite.amax(0, keepdim=True))


def test_per_token_scales_come_from_one_read_for_both_axes():
    f = get_format("nvfp4_per_token")
    x = torch.randn(33, 96)
    rows, cols = f.tensor_scales(x)
    with mock.patch.dict(os.environ, {"FP4RL_KERNELS": "cpu"}):  # torch's reduction
        _equal(rows, f.tensor_scale(x, -1))
        _equal(cols, f.tensor_scale(x, 0))


def _train(recipe: str, on: bool, dtype: torch.dtype = torch.float32):
    from fp4rl.nn import FP4Linear, get_recipe

    lin = torch.nn.Linear(K, N, bias=True)
    lin.weight.data, lin.bias.data = exact(N, K, seed=9), exact(N, seed=10)
    layer = FP4Linear.from_linear(lin, get_recipe(recipe))
    x = exact(3, 23, K, seed=11).to(dtype).requires_grad_()
    with mock.patch.dict(os.environ, {"FP4RL_QUANTIZE_ON_LOAD": "1" if on else "0"}), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(exact(*y.shape, seed=12).to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("recipe", ["hif4", "nvfp4", "nvfp4_per_token"])
def test_the_layer_on_load_gives_the_quantize_first_bits(recipe):
    """An FP4Linear's output and three gradients under autocast, FP32 masters: the same
    bits on both paths, the on-load path taken (three launches of the kernel a step)."""
    from fp4rl.kernels import triton_qmm

    calls = []
    real = triton_qmm.qmm_2d
    with mock.patch.object(triton_qmm, "qmm_2d",
                           lambda *a, **k: calls.append(a) or real(*a, **k)):
        on = _train(recipe, True)
    assert len(calls) == 3
    off = _train(recipe, False)
    assert len(calls) == 3
    for a, b in zip(on, off, strict=True):
        _equal(a, b)
    assert [t.dtype for t in on] == [torch.bfloat16] + [torch.float32] * 3


@pytest.mark.parametrize(("recipe", "reason"), [
    ("torchao-nvfp4", "rotated (wgrad_hadamard)"),
    ("nvfp4_4o6", "no quantize-on-load kernel for nvfp4_4o6 on cpu"),
    ("nvfp4_2d", "no quantize-on-load kernel for nvfp4_2d on cpu"),
    ("nemo-rl-nvfp4", "backward_operands dequantized"),
    ("bf16", None)])
def test_recipes_the_kernel_cannot_take_quantize_first_and_say_why(recipe, reason):
    """A rotated weight gradient (torchao's, whose dY also rounds stochastically), Four
    Over Six (its choice per block spills registers in a GEMM tile), NVFP4's 16 x 16 tiles
    and dequantized backward operands keep the
    quantize-first path, and say so once in a warning naming the reason; an unquantized
    recipe has nothing to quantize and says nothing."""
    import warnings

    from fp4rl.kernels import triton_qmm

    with mock.patch.object(triton_qmm, "qmm_2d", side_effect=AssertionError), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(recipe, True)
    said = {str(w.message) for w in caught if "FP4RL_QUANTIZE_ON_LOAD" in str(w.message)}
    if reason is None:
        assert said == set()
    else:
        assert said and all(reason in m and "quantizes first" in m for m in said), said
