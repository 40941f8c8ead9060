"""Triton kernels, bit for bit against the float64 reference (interpreted on CPU).

``FP4RL_KERNELS=triton`` routes the public functions through the Triton kernels, so
these tests check the kernels and the dispatch that reaches them on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4rl
from fp4rl.formats import get_format
from fp4rl.recovery import resq_activation, sparsify

pytest.importorskip("triton")
# the interpreter evaluates both sides of masked selects (NaN/Inf blocks) with numpy
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered")

FORMATS = ["hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"]


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS", raising=False)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.float().view(torch.int32),
                                              b.float().view(torch.int32))


def _heavy_tailed(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape", [(37, 100), (64, 64), (5, 3)])
def test_quantize_along_either_axis_matches_reference(triton_path, fmt, dim, shape):
    x = _heavy_tailed(shape)
    x[1, 2] = float("nan")
    x[-1, -1] = float("-inf")
    fast = fp4rl.quantize(x, fmt, dim=dim)
    assert _bits_equal(fast, get_format(fmt).quantize_reference(x, dim=dim))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stochastic_rounding_draws_the_same_noise(triton_path, fmt, dtype):
    x = _heavy_tailed((24, 70), seed=1).to(dtype)
    for dim in (0, 1):
        fast = fp4rl.quantize(x, fmt, dim=dim, rounding="stochastic",
                              generator=torch.Generator().manual_seed(7))
        ref = get_format(fmt).quantize_reference(x, dim=dim, rounding="stochastic",
                                                 generator=torch.Generator().manual_seed(7))
        assert _bits_equal(fast, ref)


@pytest.mark.parametrize("per_tensor_scale", [True, False])
def test_nvfp4_tensor_scale(triton_path, per_tensor_scale):
    x = _heavy_tailed((16, 48), seed=2) * 1e4
    fast = fp4rl.quantize(x, "nvfp4", per_tensor_scale=per_tensor_scale)
    ref = get_format("nvfp4").quantize_reference(x, per_tensor_scale=per_tensor_scale)
    assert _bits_equal(fast, ref)


def test_non_contiguous_and_higher_rank_inputs(triton_path):
    x = _heavy_tailed((40, 96), seed=3)
    assert _bits_equal(fp4rl.quantize(x.t(), "hif4", dim=1),
                       get_format("hif4").quantize_reference(x.t(), dim=1))
    y = _heavy_tailed((2, 3, 64), seed=4)
    assert _bits_equal(fp4rl.quantize(y, "mxfp4", dim=1),
                       get_format("mxfp4").quantize_reference(y, dim=1))


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("pattern", ["dense", "2:4", "1:8", "4:16"])
def test_fused_resq_matches_composed_reference(triton_path, fmt, pattern):
    x = _heavy_tailed((33, 160), seed=5)
    from fp4rl.kernels import triton_quant

    keep, group = (0, 0) if pattern == "dense" else map(int, pattern.split(":"))
    fused = triton_quant.fused_resq(fmt, x, keep, group)
    assert fused is not None  # the kernel itself ran, not a fallback
    q = get_format(fmt).quantize_reference
    qx = q(x)
    assert _bits_equal(fused, qx + sparsify(q(x - qx), pattern))
    assert _bits_equal(resq_activation(x, fmt, pattern), fused)


def test_fused_resq_declines_what_it_cannot_fuse(triton_path):
    from fp4rl.kernels import resq_rows, triton_quant

    x = _heavy_tailed((8, 64), seed=6)
    assert resq_rows("nvfp4", x, 2, 4) is None
    assert triton_quant.fused_resq("nvfp4", x, 2, 4) is None
    assert triton_quant.fused_resq("hif4", x, 2, 6) is None
    q = get_format("hif4").quantize_reference
    qx = q(x)
    assert _bits_equal(resq_activation(x, "hif4", "2:6"), qx + sparsify(q(x - qx), "2:6"))


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(FORMATS), exponent=st.integers(-60, 60),
       rows=st.integers(1, 9), cols=st.integers(1, 130), seed=st.integers(0, 2**16))
def test_any_scale_and_shape(fmt, exponent, rows, cols, seed):
    import os

    os.environ["FP4RL_KERNELS"] = "triton"
    try:
        x = _heavy_tailed((rows, cols), seed) * 2.0 ** exponent
        assert _bits_equal(fp4rl.quantize(x, fmt), get_format(fmt).quantize_reference(x))
    finally:
        del os.environ["FP4RL_KERNELS"]
