"""Block-wise (random) Hadamard rotations along the reduction axis.

Rotating activations and weights by the same orthonormal matrix ``R`` along
the reduction axis leaves the GEMM unchanged, ``(X R)(W R)^T = X W^T``, while
spreading an outlier's energy over its whole block so that fewer values
underflow when the block is quantized to FP4. ``R`` here is block-diagonal,
each ``b x b`` block being ``H_b diag(s)`` with ``H_b`` the Sylvester Hadamard
matrix scaled by ``1/sqrt(b)`` and ``s`` a random sign vector; blocks keep the
rotation local so it can line up with quantization blocks.

Tensors are rotated as row vectors along their last axis: for a row ``v`` the
result is ``v R^T``; with ``R = H diag(s)`` and ``H`` symmetric that is
``H (s * v)`` per block.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_BLOCK_SIZE = 128

# Largest Hadamard factor applied as a dense GEMM rather than as butterflies.
_GEMM_STAGE_SIZE = 128


def _check_layout(x: Tensor, block_size: int) -> None:
    """Reject block sizes and shapes the blocked transform cannot handle."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"Hadamard block size must be a power of two, got {block_size}")
    if not x.is_floating_point():
        raise ValueError(f"Hadamard transform needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % block_size:
        size = "a scalar" if x.dim() == 0 else f"last axis {x.shape[-1]}"
        raise ValueError(f"Hadamard block size {block_size} must divide the last axis, got {size}")


def hadamard_transform(x: Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> Tensor:
    """Orthonormal Walsh–Hadamard transform of each last-axis block of ``x``.

    Each block is multiplied by ``H_b / sqrt(b)`` (Sylvester, natural order),
    which is symmetric and orthogonal, hence its own inverse. This is the fast
    transform with its first stages fused: ``H_b = H_{b/c} ⊗ H_c``, so the
    ``c = min(b, 128)`` inner stages run as one small GEMM (BLAS beats the
    strided butterflies there) and the outer ``log2(b/c)`` stages as
    butterflies on contiguous runs of at least ``c`` values, for O(log b)
    passes instead of a dense ``b x b`` product. Half-precision inputs are
    computed in float32 and cast back.
    """
    _check_layout(x, block_size)
    dtype = torch.promote_types(x.dtype, torch.float32)
    inner = min(block_size, _GEMM_STAGE_SIZE)
    chunks = x.to(dtype).reshape(-1, inner)
    work = (chunks @ _sylvester(inner, dtype, x.device)).reshape(-1, block_size)
    half = inner
    while half < block_size:
        pairs = work.view(-1, block_size // (2 * half), 2, half)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        work = torch.stack((low + high, low - high), dim=2)
        half *= 2
    return (work.reshape(x.shape) * block_size**-0.5).to(x.dtype)


def _sylvester(size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Unnormalized Sylvester Hadamard matrix (entries ±1, exact in any dtype)."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    base = torch.tensor([[1, 1], [1, -1]], dtype=dtype, device=device)
    while h.shape[0] < size:
        h = torch.kron(base, h)
    return h


def make_signs(
    d: int,
    generator: torch.Generator | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Draw ``d`` independent, uniformly random ±1 values.

    Pass a seeded ``generator`` so the activation and weight sides of a layer
    share the same rotation.
    """
    if d < 1:
        raise ValueError(f"need at least one sign, got d={d}")
    bits = torch.randint(0, 2, (d,), generator=generator, device=device)
    return (bits * 2 - 1).to(dtype)


def _check_signs(x: Tensor, signs: Tensor) -> Tensor:
    """Validate ``signs`` against ``x`` and cast them to its dtype (exact for ±1)."""
    if signs.shape != (x.shape[-1],):
        raise ValueError(
            f"signs must have shape ({x.shape[-1]},) to match the last axis, "
            f"got {tuple(signs.shape)}"
        )
    return signs.to(dtype=x.dtype, device=x.device)


def random_hadamard(x: Tensor, signs: Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> Tensor:
    """Apply ``H diag(signs)`` to each last-axis block (random signs, then transform).

    The random signs decorrelate the rotation from any structure in ``x``
    (a plain Hadamard maps a constant block onto a single spike).
    """
    _check_layout(x, block_size)
    return hadamard_transform(x * _check_signs(x, signs), block_size)


def inverse_random_hadamard(
    y: Tensor, signs: Tensor, block_size: int = DEFAULT_BLOCK_SIZE
) -> Tensor:
    """Undo :func:`random_hadamard`: apply ``diag(signs) H`` to each block."""
    _check_layout(y, block_size)
    return hadamard_transform(y, block_size) * _check_signs(y, signs)
