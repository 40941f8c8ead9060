"""The two-axis quantizer (one read of a matrix, its block values along the rows and along
the columns), interpreted on the CPU: bit for bit the single-axis path's two operands,
and the FP4 training layer that uses it (weight, activation and output gradient) computes
the same forward and gradients as with the reference quantizers."""

from __future__ import annotations

import pytest
import torch

from fp4rl.formats import get_format
from fp4rl.gemm import quantize_operand, quantize_operand_pair

pytest.importorskip("triton")

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered")
FORMATS = ["hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"]


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values (float32 bits; NaN in the same places)."""
    a, b = a.float(), b.float()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and
                torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def _reference(x: torch.Tensor, fmt: str, out_dtype: torch.dtype | None, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("FP4RL_DISABLE_KERNELS", "1")
        return (quantize_operand(x, get_format(fmt), -1, out_dtype=out_dtype),
                quantize_operand(x, get_format(fmt), 0, out_dtype=out_dtype))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(37, 100), (64, 64), (130, 70), (1, 33)])
@pytest.mark.parametrize("types", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                   (torch.bfloat16, None)])
def test_both_axes_from_one_read_are_each_axis_bit_for_bit(triton_path, monkeypatch, fmt,
                                                           shape, types):
    from fp4rl.kernels import triton_quant

    dtype, out = types
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
    x[0, min(2, shape[1] - 1)] = float("nan")
    x[-1, -1] = float("-inf")
    x = x.to(dtype)
    launched: list[object] = []
    real = triton_quant.quantize_both
    monkeypatch.setattr(triton_quant, "quantize_both",
                        lambda *a: launched.append(a) or real(*a))
    rows, cols = quantize_operand_pair(x, get_format(fmt), out)
    assert len(launched) == 1  # one kernel for both
    want_rows, want_cols = _reference(x, fmt, out, monkeypatch)
    assert rows.values.dtype == cols.values.dtype == (out or dtype)
    assert _same(rows.values, want_rows.values) and _same(cols.values, want_cols.values)
    for got, want in ((rows, want_rows), (cols, want_cols)):
        assert (got.scale is None) == (want.scale is None)
        assert got.scale is None or torch.equal(got.scale, want.scale)


def test_a_scale_per_token_takes_each_axis_on_its_own(triton_path, monkeypatch):
    """Per-token NVFP4 has a scale per vector along each axis: no shared scale, so the two
    operands come from the single-axis kernels (and still equal the reference)."""
    from fp4rl.kernels import triton_quant

    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(triton_quant, "quantize_both", lambda *a: pytest.fail("both"))
    rows, cols = quantize_operand_pair(x, get_format("nvfp4_per_token"))
    want_rows, want_cols = _reference(x, "nvfp4_per_token", None, monkeypatch)
    assert _same(rows.dense(), want_rows.dense()) and _same(cols.dense(), want_cols.dense())


@pytest.mark.parametrize("recipe", ["hif4", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_training_layer_computes_the_same_with_it(triton_path, monkeypatch, recipe,
                                                      dtype):
    """Forward and backward of an FP4 linear (two micro-batches, the kept weight operands
    made by the two-axis kernel in the first) against the same layer with the reference
    quantizers: the same output, input gradient and weight gradient, bit for bit."""
    from fp4rl.kernels import triton_quant
    from fp4rl.nn import FP4Linear, get_recipe

    g = torch.Generator().manual_seed(3)
    base = torch.nn.Linear(96, 80)
    xs = [torch.randn(2, 17, 96, generator=g) for _ in range(2)]
    dys = [torch.randn(2, 17, 80, generator=g) for _ in range(2)]

    def run() -> list[torch.Tensor]:
        layer = FP4Linear.from_linear(torch.nn.Linear(96, 80), get_recipe(recipe))
        layer.load_state_dict(base.state_dict())
        layer.hold()  # one step's micro-batches, the weights held as the trainer holds them
        out = []
        for x, dy in zip(xs, dys, strict=True):
            x = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                y = layer(x)
            y.backward(dy.to(y.dtype))
            out += [y.detach(), x.grad]
        return [*out, layer.weight.grad]

    launched: list[object] = []
    real = triton_quant.quantize_both
    monkeypatch.setattr(triton_quant, "quantize_both",
                        lambda *a: launched.append(a) or real(*a))
    fast = run()
    # first micro-batch: W, X, dY; second: X, dY (W's operands kept)
    assert len(launched) == 5
    monkeypatch.setenv("FP4RL_DISABLE_KERNELS", "1")
    slow = run()
    assert all(_same(a, b) for a, b in zip(fast, slow, strict=True))
