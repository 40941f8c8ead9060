"""Tests for the block-wise random Hadamard rotation."""

from __future__ import annotations

import math

import pytest
import torch

from fp4rl.recovery.hadamard import (
    hadamard_transform,
    inverse_random_hadamard,
    make_signs,
    random_hadamard,
)


def sylvester(b: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix built by Kronecker products."""
    h = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.kron(base, h)
    return h / math.sqrt(b)


def signs_for(d: int, seed: int = 0) -> torch.Tensor:
    return make_signs(d, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("b", [1, 2, 4, 8, 16, 64, 128, 256])
def test_transform_of_identity_is_orthonormal_sylvester_matrix(b: int) -> None:
    h = hadamard_transform(torch.eye(b, dtype=torch.float64), b)
    assert torch.allclose(h, sylvester(b), atol=1e-12)
    assert torch.allclose(h @ h.T, torch.eye(b, dtype=torch.float64), atol=1e-12)


def test_known_vectors() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0]])
    assert torch.allclose(hadamard_transform(x, 4), torch.tensor([[2.0, 0, 0, 0, 0, 2.0, 0, 0]]))


@pytest.mark.parametrize("b", [2, 8, 32, 512])
def test_blocks_are_independent(b: int) -> None:
    x = torch.randn(3, 4 * b)
    y = x.clone()
    y[:, b:] = torch.randn(3, 3 * b)
    assert torch.equal(hadamard_transform(x, b)[:, :b], hadamard_transform(y, b)[:, :b])


@pytest.mark.parametrize("b", [4, 32, 128, 512])
def test_transform_is_an_involution_and_preserves_block_norms(b: int) -> None:
    x = torch.randn(5, 2 * b, dtype=torch.float64)
    y = hadamard_transform(x, b)
    assert torch.allclose(hadamard_transform(y, b), x, atol=1e-12)
    norms = x.reshape(5, 2, b).norm(dim=-1)
    assert torch.allclose(y.reshape(5, 2, b).norm(dim=-1), norms, atol=1e-12)


@pytest.mark.parametrize("b", [4, 32, 128, 512])
def test_random_hadamard_round_trips(b: int) -> None:
    x = torch.randn(2, 3, 2 * b, dtype=torch.float64)
    signs = signs_for(2 * b)
    forward = random_hadamard(x, signs, b)
    assert not torch.allclose(forward, x)
    assert torch.allclose(inverse_random_hadamard(forward, signs, b), x, atol=1e-12)
    assert torch.allclose(
        random_hadamard(inverse_random_hadamard(x, signs, b), signs, b), x, atol=1e-12
    )


def test_random_hadamard_is_h_times_diag_signs() -> None:
    b = 8
    signs = signs_for(b, seed=3)
    x = torch.randn(4, b, dtype=torch.float64)
    rotation = sylvester(b) @ torch.diag(signs.double())
    assert torch.allclose(random_hadamard(x, signs, b), x @ rotation.T, atol=1e-12)


@pytest.mark.parametrize(("b", "d"), [(4, 8), (32, 96), (128, 256), (256, 512)])
def test_rotating_both_gemm_operands_leaves_the_product_unchanged(b: int, d: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, d, generator=gen, dtype=torch.float64)
    w = torch.randn(11, d, generator=gen, dtype=torch.float64)
    signs = make_signs(d, gen)
    rotated = random_hadamard(x, signs, b) @ random_hadamard(w, signs, b).T
    assert torch.allclose(rotated, x @ w.T, atol=1e-10)
    with_other_signs = random_hadamard(x, signs, b) @ random_hadamard(w, -signs, b).T
    assert not torch.allclose(with_other_signs, x @ w.T, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_keep_their_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(4, 64)
    y = hadamard_transform(x.to(dtype), 32)
    assert y.dtype == dtype
    assert torch.allclose(y.float(), hadamard_transform(x, 32), atol=0.05, rtol=0.02)


def test_make_signs_is_reproducible_and_plus_minus_one() -> None:
    signs = signs_for(256, seed=7)
    assert torch.equal(signs, signs_for(256, seed=7))
    assert not torch.equal(signs, signs_for(256, seed=8))
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert make_signs(4, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="at least one"):
        make_signs(0)


@pytest.mark.parametrize("b", [0, 3, 12, -4])
def test_rejects_non_power_of_two_blocks(b: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(torch.randn(2, 24), b)


@pytest.mark.parametrize(("shape", "b"), [((2, 24), 16), ((40,), 32), ((), 4)])
def test_rejects_last_axis_not_divisible_by_block(shape: tuple[int, ...], b: int) -> None:
    with pytest.raises(ValueError, match="must divide the last axis"):
        hadamard_transform(torch.randn(shape), b)


def test_rejects_integer_tensors_and_mismatched_signs() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        hadamard_transform(torch.ones(2, 4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="signs must have shape"):
        random_hadamard(torch.randn(2, 8), signs_for(4), 4)
    with pytest.raises(ValueError, match="signs must have shape"):
        inverse_random_hadamard(torch.randn(2, 8), signs_for(16), 4)
