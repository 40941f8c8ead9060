"""Invariants of every format (hypothesis) and fast == reference on varied inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4rl

BLOCK_FORMATS = ["hif4", "mxfp4", "nvfp4", "nvfp4_per_token", "nvfp4_4o6", "nvfp4_per_token_4o6",
                 "nvfp4_2d", "mxfp8_e4m3"]
ALL_FORMATS = [*BLOCK_FORMATS, "bf16"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@st.composite
def tensors(draw, max_len: int = 150):
    rows = draw(st.integers(1, 3))
    length = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = 2.0 ** draw(st.integers(-30, 30))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, generator=g) * scale
    if draw(st.booleans()):  # heavy outliers, as in LLM activations
        x = x * torch.exp(3 * torch.randn(rows, length, generator=g))
    return x


def fast_rows_vs_reference(fmt, x, **opts):
    f = fp4rl.get_format(fmt)
    assert same(f.quantize(x, **opts), f.quantize_reference(x, **opts))


# NVFP4's E4M3 block scale is amax / 6 rounded to nearest, so a block whose maximum was
# rounded down can re-derive a smaller scale: it is idempotent where the re-derived scale
# field equals the first. The same holds of its tiles, and of Four Over Six (amax / 6 or
# / 4), whose blocks far below their tensor's or token's largest value take E4M3's coarse
# subnormal scales. MXFP4/MXFP8 (floor(log2 amax)) and bf16 are idempotent everywhere.
# HiF4 is not idempotent at all under formats.md (see the pinned test below).
SCALE_ROUNDED = {"nvfp4", "nvfp4_4o6", "nvfp4_per_token_4o6", "nvfp4_2d"}


def scale_unchanged_rows(fmt: str, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per block of ``x``, whether re-encoding ``q`` gives the same scale field."""
    f = fp4rl.get_format(fmt)
    opts = {"per_tensor_scale": False} if fmt == "nvfp4" else {}
    same_scale = f.encode(x, **opts).fields["scale"] == f.encode(q, **opts).fields["scale"]
    block = f.block_size
    per_value = same_scale.reshape(x.shape[0], -1).repeat_interleave(block, dim=1)
    return per_value[:, : x.shape[1]]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8_e4m3", "bf16"])
@settings(max_examples=40, deadline=None)
@given(x=tensors())
def test_idempotent(fmt, x):
    opts = {"per_tensor_scale": False} if fmt == "nvfp4" else {}
    once = fp4rl.quantize(x, fmt, **opts)
    twice = fp4rl.quantize(once, fmt, **opts)
    if fmt in SCALE_ROUNDED:
        keep = scale_unchanged_rows(fmt, x, once)
        once, twice = once[keep], twice[keep]
    assert same(twice, once)


def test_hif4_is_not_idempotent():
    """Pin two ways formats.md makes HiF4 non-idempotent.

    1. The level-1 scale re-derives: vmax 129.04 gives s = 20; its quantized value 120
       gives s = 16, moving every other value in the group onto a new grid.
    2. r = bf16(1/s) sits just below 1/s: with s = 7, x = 29.31 (x r = 4.18, level-2 bit
       set) quantizes to 28 = 4 s, but 28 r = 3.99 < 4 clears the bit on the second pass.
    """
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1] = 129.0426483154297, -35.0
    x[1, 0], x[1, 8] = 48.0, 29.3096
    once = fp4rl.quantize(x, "hif4")
    twice = fp4rl.quantize(once, "hif4")
    assert once[0, 0] == 120.0 and twice[0, 0] == 112.0
    assert once[0, 1] == -40.0 and twice[0, 1] == -48.0
    assert once[1, 8] == 28.0 and twice[1, 8] == 24.5


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@settings(max_examples=40, deadline=None)
@given(x=tensors())
def test_sign_symmetric(fmt, x):
    assert same(fp4rl.quantize(-x, fmt), -fp4rl.quantize(x, fmt))


@pytest.mark.parametrize("fmt", ["mxfp4", "hif4", "mxfp8_e4m3", "nvfp4"])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), e=st.integers(-8, 8), k=st.integers(-8, 8),
       length=st.integers(1, 150))
def test_power_of_two_equivariant(fmt, seed, e, k, length):
    """Scaling by 2^k commutes with quantization while the scales stay inside their range.

    Inputs stay within 2^-8 .. 2^11 so that neither HiF4's E6M2 clamps nor float32
    subnormals are reached. NVFP4 has the property through its per-tensor scale.
    """
    x = torch.randn(2, length, generator=torch.Generator().manual_seed(seed)) * 2.0**e
    assert same(fp4rl.quantize(x * 2.0**k, fmt), fp4rl.quantize(x, fmt) * 2.0**k)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@settings(max_examples=40, deadline=None)
@given(x=tensors())
def test_outputs_are_representable(fmt, x):
    """Re-encoding a quantized tensor loses nothing: decode(encode(q)) == q."""
    f = fp4rl.get_format(fmt)
    opts = {"per_tensor_scale": False} if fmt == "nvfp4" else {}
    q = f.quantize(x, **opts)
    requantized = f.decode(f.encode(q, **opts))
    if fmt in SCALE_ROUNDED:
        keep = scale_unchanged_rows(fmt, x, q)
        q, requantized = q[keep], requantized[keep]
    if fmt == "hif4":  # not idempotent; check the encoded fields describe q exactly instead
        requantized = f.decode(f.encode(x))
    assert same(requantized, q)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@settings(max_examples=40, deadline=None)
@given(x=tensors())
def test_padding_invariant(fmt, x):
    """A short last block equals the same block zero-padded to full length."""
    block = fp4rl.get_format(fmt).block_size
    padded = torch.nn.functional.pad(x, (0, -x.shape[-1] % block + block))
    opts = {"per_tensor_scale": False} if fmt == "nvfp4" else {}
    full = fp4rl.quantize(padded, fmt, **opts)[:, : x.shape[-1]]
    assert same(fp4rl.quantize(x, fmt, **opts), full)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_round_trip(fmt, dtype):
    """Half-precision inputs quantize as their exact float32 values, then cast back."""
    x = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    out = fp4rl.quantize(x, fmt)
    assert out.dtype == dtype and out.shape == x.shape
    assert same(out, fp4rl.quantize(x.float(), fmt).to(dtype))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_fast_matches_reference_any_axis(fmt, dtype, dim):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 70, 33, generator=g) * torch.exp(2 * torch.randn(5, 70, 33, generator=g)))
    x = x.to(dtype)
    f = fp4rl.get_format(fmt)
    assert same(f.quantize(x, dim=dim), f.quantize_reference(x, dim=dim))
    moved = f.quantize(x.movedim(dim, -1).contiguous()).movedim(-1, dim)
    assert same(f.quantize(x, dim=dim), moved)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_fast_matches_reference_on_extremes(fmt):
    """Subnormals, huge values, zeros and exact ties, all in one tensor."""
    vals = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1e-30, 3.0e38, -3.4e38, 0.25, 0.75, 2.5,
                         5.0, 1.75, 6.0, 7.0, 448.0, 49152.0, 65504.0, 1.0])
    x = vals.repeat(40)[: 64 * 10].reshape(10, 64)
    x = x * torch.randint(-1, 2, x.shape, generator=torch.Generator().manual_seed(0))
    for opts in ({}, {"per_tensor_scale": False}) if fmt == "nvfp4" else ({},):
        fast_rows_vs_reference(fmt, x, **opts)


@pytest.mark.parametrize("fmt", [f for f in BLOCK_FORMATS if f != "nvfp4_2d"])  # a tile: 16 rows
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_poisons_its_block_only(fmt, bad):
    f = fp4rl.get_format(fmt)
    x = torch.randn(2, 4 * f.block_size, generator=torch.Generator().manual_seed(0))
    x[0, f.block_size + 3] = bad
    for path in (f.quantize, f.quantize_reference, lambda t: f.decode(f.encode(t))):
        y = path(x)
        block = y[0, f.block_size: 2 * f.block_size]
        assert torch.isnan(block).all()
        rest = torch.cat([y[0, : f.block_size], y[0, 2 * f.block_size:], y[1]])
        assert torch.isfinite(rest).all()


def test_bf16_keeps_nonfinite_elementwise():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 3.0])
    y = fp4rl.quantize(x, "bf16")
    assert torch.isnan(y[1]) and y[2] == float("inf") and y[3] == -float("inf")
    assert y[0] == 1.0 and y[4] == 3.0


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_stochastic_rounding_is_seeded_and_matches_reference(fmt):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    f = fp4rl.get_format(fmt)

    def run(path, seed):
        return path(x, rounding="stochastic", generator=torch.Generator().manual_seed(seed))

    assert same(run(f.quantize, 7), run(f.quantize, 7))
    assert same(run(f.quantize, 7), run(f.quantize_reference, 7))
    assert not torch.equal(run(f.quantize, 7), run(f.quantize, 8))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_stochastic_rounding_is_unbiased(fmt):
    """E[q(x)] = x inside the representable range: the mean of many draws converges to x.

    Values within 70% of their block's maximum never saturate in MXFP4/NVFP4/MXFP8; in
    HiF4 the top code of a quad is 1.75 * 2^d * s, read from the encoded fields.
    """
    f = fp4rl.get_format(fmt)
    base = torch.randn(1, max(f.block_size, 64), generator=torch.Generator().manual_seed(3))
    base[0, 0] = 4.0
    inside = base.abs()[0] < 0.7 * 4.0
    if fmt == "hif4":
        fields = f.fields(base.double(), None)
        d = fields["d8"].repeat_interleave(8, -1) + fields["d16"].repeat_interleave(4, -1)
        inside = base.abs()[0] < (1.75 * 2.0 ** d * fields["scale"])[0]
    x = base.repeat(4000, 1)
    opts = {"per_tensor_scale": False} if fmt == "nvfp4" else {}
    q = f.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(11), **opts)
    nearest_err = (f.quantize(base, **opts) - base)[0, inside].abs().mean()
    mean_err = (q.mean(0) - base[0])[inside].abs().mean()
    assert mean_err < 0.15 * nearest_err
    if fmt in ("mxfp4", "mxfp8_e4m3", "bf16"):  # each draw lies on the grid
        assert same(f.quantize(q), q)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@settings(max_examples=30, deadline=None)
@given(x=tensors())
def test_axis0_kernel_matches_reference(fmt, x):
    """Along axis 0 the kernel runs blocks of rows with columns as lanes: partial blocks
    and partial lane groups (1-3 columns here) must match the reference bit for bit."""
    f = fp4rl.get_format(fmt)
    cols = x.t().contiguous()
    assert same(f.quantize(cols, dim=0), f.quantize_reference(cols, dim=0))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("transposed", [False, True])
def test_matrix_kernel_either_axis(fmt, dim, transposed):
    """2-D tensors take the kernel that quantizes along either axis without a copy."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(150, 70, generator=g) * torch.exp(2 * torch.randn(150, 70, generator=g))
    x[7, 9] = float("nan")
    x = x.t() if transposed else x
    f = fp4rl.get_format(fmt)
    assert same(f.quantize(x, dim=dim), f.quantize_reference(x, dim=dim))
    fast = f.quantize(x, dim=dim, rounding="stochastic",
                      generator=torch.Generator().manual_seed(4))
    ref = f.quantize_reference(x, dim=dim, rounding="stochastic",
                               generator=torch.Generator().manual_seed(4))
    assert same(fast, ref)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4", "mxfp8_e4m3"])
@settings(max_examples=30, deadline=None)
@given(x=tensors())
def test_bf16_row_kernel_matches_reference(fmt, x):
    """bf16 rows quantized in one pass to bf16 (a bf16 engine's activation operand) equal
    the reference on their float32 widening: partial blocks, outliers, any scale."""
    from fp4rl.gemm import quantize_operand
    from fp4rl.kernels import quantize_rows_bf16

    rows = x.bfloat16()
    rows[0, 0] = float("nan") if x.shape[1] > 40 else rows[0, 0]  # a poisoned first block
    fast = quantize_rows_bf16(fp4rl.get_format(fmt), rows)
    assert fast is not None and fast.dtype == torch.bfloat16
    reference = fp4rl.get_format(fmt).quantize_reference(rows.float())
    # every value exact (bf16 holds them all); NaN where the reference has NaN (a NaN's
    # payload bits differ between torch's vectorized and scalar casts)
    torch.testing.assert_close(fast.float(), reference, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(quantize_operand(rows, fp4rl.get_format(fmt)).values, fast,
                               rtol=0, atol=0, equal_nan=True)


def test_bf16_row_kernel_leaves_nvfp4_and_fp32_to_the_general_path():
    """NVFP4's per-tensor scale needs the whole tensor, and float32 rows are not bf16."""
    from fp4rl.kernels import quantize_rows_bf16

    x = torch.randn(4, 64)
    assert quantize_rows_bf16(fp4rl.get_format("nvfp4"), x.bfloat16()) is None
    assert quantize_rows_bf16(fp4rl.get_format("hif4"), x) is None
