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
from fp4rl.recovery import parse_pattern, resq_activation, sparsify

pytest.importorskip("triton")
# the interpreter evaluates both sides of masked selects (NaN/Inf blocks) with numpy
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered")

FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token", "mxfp8_e4m3"]
#: the field's NVFP4 variants: Four Over Six block scales, 16 x 16 tiles (quantize only)
FIELD_FORMATS = ["nvfp4_4o6", "nvfp4_per_token_4o6", "nvfp4_2d"]


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


@pytest.mark.parametrize("fmt", FORMATS + FIELD_FORMATS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape", [(37, 100), (64, 64), (5, 3)])
def test_quantize_along_either_axis_matches_reference(triton_path, fmt, dim, shape):
    x = _heavy_tailed(shape)
    x[1, 2] = float("nan")
    x[-1, -1] = float("-inf")
    fast = fp4rl.quantize(x, fmt, dim=dim)
    assert _bits_equal(fast, get_format(fmt).quantize_reference(x, dim=dim))


@pytest.mark.parametrize("fmt", FORMATS + FIELD_FORMATS)
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
@pytest.mark.parametrize("pattern", ["dense", "2:4", "1:8", "4:8"])
def test_fused_resq_matches_composed_reference(triton_path, fmt, pattern):
    x = _heavy_tailed((33, 160), seed=5)
    from fp4rl.kernels import triton_quant

    keep, group = (0, 0) if pattern == "dense" else map(int, pattern.split(":"))
    fused = triton_quant.fused_resq(get_format(fmt), x, keep, group)
    assert fused is not None  # the kernel itself ran, not a fallback
    q = get_format(fmt).quantize_reference
    qx = q(x)
    assert _bits_equal(fused, qx + sparsify(q(x - qx), pattern))
    assert _bits_equal(resq_activation(x, get_format(fmt), parse_pattern(pattern)), fused)


def test_fused_resq_declines_what_it_cannot_fuse(triton_path):
    from fp4rl.kernels import resq_rows, triton_quant

    x = _heavy_tailed((8, 64), seed=6)
    assert resq_rows(get_format("nvfp4"), x, 2, 4) is None
    assert triton_quant.fused_resq(get_format("nvfp4"), x, 2, 4) is None
    assert triton_quant.fused_resq(get_format("hif4"), x, 2, 6) is None
    assert triton_quant.fused_resq(get_format("hif4"), x, 4, 16) is None  # past MAX_GROUP
    q = get_format("hif4").quantize_reference
    qx = q(x)
    for pattern in ("2:6", "4:16"):
        assert _bits_equal(resq_activation(x, get_format("hif4"), parse_pattern(pattern)),
                           qx + sparsify(q(x - qx), pattern))


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(FORMATS + FIELD_FORMATS), exponent=st.integers(-60, 60),
       rows=st.integers(1, 9), cols=st.integers(1, 130), seed=st.integers(0, 2**16))
def test_any_scale_and_shape(fmt, exponent, rows, cols, seed):
    import os

    os.environ["FP4RL_KERNELS"] = "triton"
    try:
        x = _heavy_tailed((rows, cols), seed) * 2.0 ** exponent
        assert _bits_equal(fp4rl.quantize(x, fmt), get_format(fmt).quantize_reference(x))
    finally:
        del os.environ["FP4RL_KERNELS"]


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN's payload and sign may differ (a bf16 NaN's bits
    depend on the converting hardware)."""
    both = torch.isnan(a.float()) & torch.isnan(b.float())
    return a.dtype == b.dtype and _bits_equal(torch.where(both, 0, a), torch.where(both, 0, b))


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_rows_to_bf16_block_values_in_one_pass(triton_path, fmt):
    """A bf16 activation read and written once in bf16: ``Q(x / g)`` with NVFP4's ``g``
    outside (a GEMM operand keeps it there), the reference's values exactly."""
    from fp4rl.kernels import quantize_rows_bf16

    x = (_heavy_tailed((19, 200), seed=8)).bfloat16()
    x[2, 5] = float("nan")
    f = get_format(fmt)
    g = f.tensor_scale(x)
    fast = quantize_rows_bf16(f, x, g)
    assert fast is not None and fast.dtype == torch.bfloat16
    opts = {} if g is None else {"per_tensor_scale": False}
    ref = f.quantize_reference(x.float() if g is None else x.float() / g, **opts)
    assert _same_or_both_nan(fast, ref.bfloat16())


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("pattern", ["dense", "2:4", "4:8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resq_terms_written_once_each(triton_path, fmt, pattern, dtype):
    from fp4rl.kernels import resq_terms

    x = _heavy_tailed((21, 160), seed=9).to(dtype)
    keep, group = (0, 0) if pattern == "dense" else map(int, pattern.split(":"))
    terms = resq_terms(get_format(fmt), x, keep, group)
    assert terms is not None  # the Triton kernel ran
    q = get_format(fmt).quantize_reference
    qx = q(x.float())
    assert _bits_equal(terms[0], qx.bfloat16())
    assert _bits_equal(terms[1], sparsify(q(x.float() - qx), pattern).bfloat16())
    assert terms[1].data_ptr() == terms[0].data_ptr() + terms[0].numel() * 2  # one buffer


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [64, 200])
def test_packed_decode_kernel_matches_the_reference_decoder(triton_path, fmt, dtype, cols):
    from fp4rl.formats.row_decode import decode_rows
    from fp4rl.gemm import pack_operand
    from fp4rl.kernels import triton_decode

    x = _heavy_tailed((9, cols), seed=10) * 2.0 ** 30
    x[3, 7] = float("nan")  # a NaN block
    x[5] = 0.0
    packed = pack_operand(x, get_format(fmt)).packed
    ref = get_format(fmt).decode(packed)
    fields = {k: v.reshape(9, -1) for k, v in packed.fields.items()}
    got = triton_decode.decode_2d(get_format(fmt), fields, 9, cols, dtype)
    assert _same_or_both_nan(got, ref.to(dtype))
    assert _same_or_both_nan(decode_rows(packed, dtype), ref.to(dtype))  # the dispatch


def test_every_op_on_a_gpu_selects_its_triton_kernel():
    """For a CUDA device (no GPU needed to ask), every operation of every format runs a
    Triton kernel; the only ones without are NVFP4's ResQ passes, which compose its
    quantizer's Triton passes (the residual has a per-tensor scale of its own) and MXFP8's
    packed decode and GEMM (no rollout weight is stored in 8 bits)."""
    from fp4rl.kernels import OPERATIONS, kernel_plan

    composed = {("nvfp4", "resq"), ("nvfp4", "resq_terms"), ("nvfp4_per_token", "resq"),
                ("nvfp4_per_token", "resq_terms"), ("mxfp8_e4m3", "decode"),
                ("mxfp8_e4m3", "packed_mm")}
    for fmt in FORMATS:
        plan = kernel_plan(get_format(fmt), "cuda")
        assert set(plan) == set(OPERATIONS)
        for op, backend in plan.items():
            assert backend == ("none" if (fmt, op) in composed else "triton"), (fmt, op)
    for fmt in FIELD_FORMATS:  # quantizers only: ResQ composes them, decode reads tables
        plan = kernel_plan(get_format(fmt), "cuda")
        assert {op for op, backend in plan.items() if backend == "triton"} == {"rows", "cols"}


@pytest.mark.parametrize("recipe", ["hif4+resq-2:4", "mxfp4+resq-dense", "nvfp4+resq-2:4",
                                    "mxfp4:fp4/w4a8"])
def test_a_model_on_the_triton_path_never_takes_the_reference(triton_path, recipe,
                                                              monkeypatch):
    """A patched model's rollout (bf16 compute, packed weights decoded per call) and its
    training step (forward and backward GEMMs, stochastic gradient rounding) with every
    reference quantizer and decoder switched off: each op finds its Triton kernel (what a
    CUDA tensor selects, through the same dispatch)."""
    from fp4rl.formats.base import BlockFormat
    from fp4rl.gemm import pack_operand
    from fp4rl.models import tiny_model

    def refuse(*args, **kwargs):
        raise AssertionError("the reference path ran")

    monkeypatch.setattr(BlockFormat, "_reference_rows", refuse)
    monkeypatch.setattr(BlockFormat, "decode", refuse)
    for fmt in {type(fp4rl.get_format(f)) for f in FORMATS}:
        monkeypatch.setattr(fmt, "table_decode", refuse)
    model, _ = tiny_model("llama", num_hidden_layers=1)
    fp4rl.quantize_model(model, recipe)
    ids = torch.randint(0, 100, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with fp4rl.rollout_mode(model):
            assert torch.isfinite(model(input_ids=ids).logits).all()
        model(input_ids=ids).logits.float().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    fmt = recipe.split(":")[0].split("+")[0]
    assert torch.isfinite(pack_operand(w, get_format(fmt)).decode(torch.bfloat16).values).all()


@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_the_fields_formats_quantize_on_triton_alone(triton_path, fmt, monkeypatch):
    """Four Over Six and the 16 x 16 tiles take their Triton kernel along either axis of
    a matrix and along any axis of a 3-D tensor (rows from several matrices, tiles of 16
    consecutive vectors): with the reference paths refused, the values are still the
    reference's, computed before."""
    from fp4rl.formats.base import BlockFormat
    from fp4rl.formats.nvfp4 import NVFP4Tiles

    f = get_format(fmt)
    cases = [(_heavy_tailed((48, 80), seed=5), 0), (_heavy_tailed((48, 80), seed=5), 1),
             (_heavy_tailed((3, 20, 40), seed=6), 1), (_heavy_tailed((3, 20, 40), seed=6), 2)]
    want = [f.quantize_reference(x, dim=d) for x, d in cases]

    def refuse(*args, **kwargs):
        raise AssertionError("the reference path ran")

    monkeypatch.setattr(BlockFormat, "_reference_rows", refuse)
    monkeypatch.setattr(NVFP4Tiles, "_tile_fields", refuse)
    for (x, d), expected in zip(cases, want, strict=True):
        assert _bits_equal(fp4rl.quantize(x, fmt, dim=d), expected)


def test_the_fields_formats_differ_from_nvfp4_where_their_rules_do():
    """What the kernels above reproduce is not NVFP4 under another name: on the same
    Gaussian matrix, Four Over Six picks a scale of 4 for some blocks (less error than
    NVFP4's), and a 16 x 16 tile's scale differs from its rows' own (more error)."""
    x = torch.randn((64, 256), generator=torch.Generator().manual_seed(9))
    err = {f: (fp4rl.quantize(x, f) - x).square().sum() for f in ("nvfp4", "nvfp4_4o6",
                                                                  "nvfp4_2d")}
    assert err["nvfp4_4o6"] < err["nvfp4"] < err["nvfp4_2d"]


@pytest.mark.parametrize("fmt", FORMATS + FIELD_FORMATS)
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_operand_values_written_in_the_gemm_dtype_by_the_kernel(triton_path, fmt, dim,
                                                                out_dtype):
    """quantize_operand(..., out_dtype=): the kernel writes the block values straight into
    the GEMM's dtype, with NVFP4's scale read and kept outside; the same bits as
    quantizing in float32 and casting after (the CPU's path)."""
    from fp4rl.gemm import quantize_operand
    from fp4rl.kernels import quantize_matrix_values

    x = _heavy_tailed((48, 96), seed=11)
    composed = quantize_operand(x, get_format(fmt), dim)
    f = get_format(fmt)
    assert quantize_matrix_values(f, x, dim, composed.scale, out_dtype) is not None
    direct = quantize_operand(x, get_format(fmt), dim, out_dtype=out_dtype)
    assert direct.values.dtype == out_dtype
    assert _bits_equal(direct.values, composed.values.to(out_dtype))
    assert (direct.scale is None) == (composed.scale is None)
    if composed.scale is not None:
        assert torch.equal(direct.scale, composed.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_amax_in_one_pass(triton_path, dtype):
    """NVFP4's per-tensor amax by one kernel (an atomic max of the bits): the largest finite
    magnitude, NaN and Inf left out, 0 for none; across several programs."""
    from fp4rl.formats.nvfp4 import finite_amax
    from fp4rl.kernels import triton_quant

    x = _heavy_tailed((3, 5000), seed=12).to(dtype)
    want = x.float().abs().max()
    assert torch.equal(triton_quant.finite_amax(x), want)
    x[0, 7] = float("nan")
    x[2, 4999] = float("-inf")
    assert torch.equal(finite_amax(x), want)
    assert torch.equal(triton_quant.finite_amax(torch.full((9,), float("nan"), dtype=dtype)),
                       torch.tensor(0.0))
    assert _bits_equal(fp4rl.quantize(x.float(), "nvfp4"),
                       get_format("nvfp4").quantize_reference(x.float()))
