"""Tests for outlier clamping/compensation and the outlier-block statistic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4rl.recovery.outliers import (
    E2M1_UNDERFLOW_RATIO,
    abs_quantile,
    clamp_outliers,
    outlier_block_fraction,
    outlier_blocks,
    residual_matmul,
)

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_zero_share(blocks: torch.Tensor) -> torch.Tensor:
    """Share of each block that rounds to zero when its max is scaled to 6.

    Round-to-nearest on the E2M1 grid, ties to the even (lower) code: only
    values strictly above 0.25 reach 0.5.
    """
    scaled = blocks.abs() * 6.0 / blocks.abs().amax(dim=-1, keepdim=True)
    return (scaled <= 0.25).float().mean(dim=-1)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0])
@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_abs_quantile_matches_torch_quantile(q: float, size: int) -> None:
    x = torch.randn(size, generator=torch.Generator().manual_seed(size))
    # Compared in float64: torch.quantile forms the interpolation weight in the input dtype.
    expected = torch.quantile(x.abs().double(), q).float()
    assert torch.allclose(abs_quantile(x, q), expected, rtol=1e-6, atol=0)


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(st.integers(-4, 4).map(float), min_size=1, max_size=30),
    q=st.floats(0.0, 1.0),
)
def test_abs_quantile_with_ties(values: list[float], q: float) -> None:
    x = torch.tensor(values, dtype=torch.float64)
    assert torch.allclose(abs_quantile(x, q), torch.quantile(x.abs(), q), rtol=1e-12, atol=1e-12)


def test_abs_quantile_beyond_torch_quantile_size_limit() -> None:
    size = 2**24 + 3
    x = torch.zeros(size)
    x[: size // 10] = -2.0
    x[size // 10 : size // 5] = 1.0
    # Sorted |x|: ~80% zeros, ~10% ones, ~10% twos.
    assert abs_quantile(x, 0.85).item() == 1.0


@pytest.mark.parametrize("q", [-0.1, 1.5])
def test_abs_quantile_rejects_bad_input(q: float) -> None:
    with pytest.raises(ValueError, match="quantile"):
        abs_quantile(torch.ones(3), q)
    with pytest.raises(ValueError, match="empty"):
        abs_quantile(torch.ones(0), 0.5)


def test_clamp_outliers_on_crafted_tensor() -> None:
    # |x| = 1..100 with alternating signs: the 0.99 quantile interpolates to 99.01.
    x = torch.arange(1, 101, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(50)
    clamped, residual = clamp_outliers(x, 0.99)
    assert torch.allclose(clamped.abs().max(), torch.tensor(99.01))
    assert residual.count_nonzero().item() == 1
    assert torch.allclose(residual[-1], torch.tensor(-0.99), atol=1e-5)
    assert torch.equal(clamped[:-1], x[:-1])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    q=st.floats(0.5, 1.0),
    shape=st.sampled_from([(1,), (17,), (4, 33), (2, 3, 40)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_clamp_outliers_invariants(
    seed: int, q: float, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    clamped, residual = clamp_outliers(x, q)
    threshold = clamped.abs().max()
    assert clamped.dtype == residual.dtype == dtype
    assert torch.equal(residual != 0, x.abs() > threshold)
    assert torch.equal(torch.sign(residual[residual != 0]), torch.sign(x[residual != 0]))
    assert torch.allclose(
        (clamped + residual).double(), x.double(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6
    )
    # No more entries exceed the interpolated quantile than lie above its lower rank.
    lower_rank = int(q * (x.numel() - 1))
    assert residual.count_nonzero().item() <= x.numel() - 1 - lower_rank


def test_clamp_at_quantile_one_keeps_everything() -> None:
    x = torch.randn(8, 8)
    clamped, residual = clamp_outliers(x, 1.0)
    assert torch.equal(clamped, x)
    assert residual.count_nonzero().item() == 0


def scattered_residual(shape: tuple[int, ...], q: float = 0.99) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return clamp_outliers(x, q)[1]


def channel_residual(shape: tuple[int, ...], channels: list[int]) -> torch.Tensor:
    x = torch.zeros(shape)
    gen = torch.Generator().manual_seed(1)
    x[..., channels] = torch.randn(*shape[:-1], len(channels), generator=gen)
    x[..., 0, :] = 0.0  # an all-zero token as well
    return x


def token_residual(shape: tuple[int, int], tokens: list[int]) -> torch.Tensor:
    x = torch.zeros(shape)
    x[tokens] = torch.randn(len(tokens), shape[1], generator=torch.Generator().manual_seed(2))
    return x


@pytest.mark.parametrize(
    ("residual", "max_sparse_density"),
    [
        (scattered_residual((64, 256)), 0.05),  # CSR
        (scattered_residual((64, 256), 0.5), 0.05),  # too dense for CSR, nothing to compact
        (scattered_residual((64, 256), 0.5), 1.0),  # CSR forced
        (scattered_residual((2, 8, 128)), 0.05),  # leading dims
        (channel_residual((32, 256), [3, 100, 255]), 0.05),  # CSR
        (channel_residual((32, 256), [3, 100, 255]), 0.0),  # columns compacted
        (channel_residual((2, 16, 256), [7]), 0.0),  # columns compacted, leading dims
        (token_residual((64, 256), [5, 40]), 0.0),  # rows compacted
        (token_residual((64, 256), [5, 40]) * channel_residual((64, 256), [9]), 0.0),  # both
        (scattered_residual((64, 256)).double(), 0.05),
    ],
)
def test_residual_matmul_equals_dense_product(
    residual: torch.Tensor, max_sparse_density: float
) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, residual.shape[-1], generator=gen, dtype=residual.dtype)
    out = residual_matmul(residual, w, max_sparse_density=max_sparse_density)
    assert out.shape == (*residual.shape[:-1], 48)
    assert torch.allclose(out, residual @ w.T, atol=1e-5)


def test_residual_matmul_with_transposed_weight_view_and_half_precision() -> None:
    residual = scattered_residual((16, 64))
    w_t = torch.randn(64, 24)
    assert torch.allclose(residual_matmul(residual, w_t.T), residual @ w_t, atol=1e-5)
    low = residual.bfloat16()
    w = torch.randn(24, 64).bfloat16()
    assert torch.allclose(residual_matmul(low, w).float(), (low @ w.T).float(), atol=0.1)


def test_residual_matmul_of_zeros_and_shape_check() -> None:
    out = residual_matmul(torch.zeros(3, 5, 16), torch.randn(4, 16))
    assert torch.equal(out, torch.zeros(3, 5, 4))
    with pytest.raises(ValueError, match="shape"):
        residual_matmul(torch.zeros(3, 16), torch.randn(4, 8))


@pytest.mark.parametrize(
    ("block", "threshold", "flagged"),
    [
        ([1.0, 1.0, 1.0, 1.0], E2M1_UNDERFLOW_RATIO, False),
        ([1.0, 1.0, 1.0, 23.9], E2M1_UNDERFLOW_RATIO, False),
        ([1.0, 1.0, 1.0, 24.0], E2M1_UNDERFLOW_RATIO, True),  # median lands on 0.25 -> 0
        ([-1.0, 1.0, -1.0, -30.0], E2M1_UNDERFLOW_RATIO, True),
        ([0.1, 5.0, 5.0, 50.0], E2M1_UNDERFLOW_RATIO, False),  # lower median is 5
        ([0.1, 0.1, 5.0, 50.0], E2M1_UNDERFLOW_RATIO, True),  # lower median is 0.1
        ([0.0, 0.0, 0.0, 0.0], E2M1_UNDERFLOW_RATIO, False),
        ([0.0, 0.0, 1.0, 1.0], E2M1_UNDERFLOW_RATIO, True),  # half exact zeros
        ([1.0, 1.0, 1.0, 10.0], 8.0, True),
        ([1.0, 1.0, 1.0, 10.0], 16.0, False),
    ],
)
def test_outlier_block_rule(block: list[float], threshold: float, flagged: bool) -> None:
    flags = outlier_blocks(torch.tensor([block]), 4, threshold)
    assert flags.tolist() == [[flagged]]


def test_outlier_block_fraction_counts_blocks_along_last_axis() -> None:
    x = torch.ones(2, 3, 8)
    x[0, 1, 5] = 100.0  # second block of one row
    x[1, 2, 0] = -100.0  # first block of another
    flags = outlier_blocks(x, 4)
    assert flags.shape == (2, 3, 2)
    assert flags.sum().item() == 2
    assert outlier_block_fraction(x, 4) == 2 / 12
    assert outlier_block_fraction(torch.empty(0, 8), 4) == 0.0


@pytest.mark.parametrize("block_size", [16, 32])
def test_default_rule_flags_exactly_blocks_where_half_underflows(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    # Log-normal magnitudes with a per-block spread so both outcomes are common.
    spread = torch.rand(4000, 1, generator=gen) * 2.5
    blocks = torch.exp(torch.randn(4000, block_size, generator=gen) * spread)
    flags = outlier_blocks(blocks.reshape(1, -1), block_size).flatten()
    half_or_more_zero = e2m1_zero_share(blocks) >= 0.5
    assert 0.1 < flags.float().mean().item() < 0.9
    assert torch.equal(flags, half_or_more_zero)


def test_outlier_blocks_accepts_bfloat16_and_rejects_bad_layouts() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0, 30.0]]).bfloat16()
    assert outlier_blocks(x, 4).tolist() == [[True]]
    with pytest.raises(ValueError, match="divide"):
        outlier_blocks(torch.ones(2, 10), 4)
    with pytest.raises(ValueError, match="divide"):
        outlier_blocks(torch.ones(2, 8), 0)
    with pytest.raises(ValueError, match="positive"):
        outlier_blocks(torch.ones(2, 8), 4, threshold=0.0)
