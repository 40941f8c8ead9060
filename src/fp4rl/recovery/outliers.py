"""Outlier clamping and compensation (OCC) building blocks and outlier statistics.

OCC splits a tensor into a clamped part, whose range quantizes well to FP4, and
a sparse residual holding only the outliers' excess, which is multiplied in
separately (in higher precision or as a sparse GEMM)::

    x = clamp(x, -t, t) + residual,    residual != 0 only where |x| > t

so ``x @ w.T == clamped @ w.T + residual @ w.T``.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

# E2M1, the element format of MXFP4 and NVFP4, has largest magnitude 6 and
# smallest non-zero 0.5, so round-to-nearest (ties to even) sends anything up
# to 0.25 to zero. With a block scale that maps the block's max |x| to 6, a
# value collapses to zero once it is at most max|x| / (6 / 0.25). Scales that
# are themselves rounded move this ratio: MXFP4's power-of-two scale maps the
# max anywhere into [4, 8), putting the collapse ratio between 16 and 32.
E2M1_UNDERFLOW_RATIO = 6.0 / 0.25

# Above this share of non-zeros, a dense GEMM (on the non-zero rows and
# columns) beat building and multiplying a CSR matrix in CPU measurements.
SPARSE_DENSITY_MAX = 0.02

# Dtypes the CPU sparse CSR matmul kernel implements.
_CSR_DTYPES = (torch.float32, torch.float64)


def abs_quantile(x: Tensor, q: float) -> Tensor:
    """The ``q``-quantile of ``|x|`` over the whole tensor, as a 0-d float tensor.

    Matches ``torch.quantile``'s default linear interpolation, but is built on
    ``kthvalue`` so it also works beyond ``torch.quantile``'s 2**24-element
    input limit (a full weight matrix or a long rollout batch exceeds it).
    Computed in at least float32.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must lie in [0, 1], got {q}")
    if x.numel() == 0:
        raise ValueError("quantile of an empty tensor is undefined")
    flat = x.detach().abs().flatten().to(torch.promote_types(x.dtype, torch.float32))
    position = q * (flat.numel() - 1)
    lower_index = math.floor(position)
    lower = flat.kthvalue(lower_index + 1).values
    weight = position - lower_index
    if weight == 0.0:
        return lower
    return torch.lerp(lower, _next_order_statistic(flat, lower, lower_index + 1), weight)


def _next_order_statistic(flat: Tensor, kth: Tensor, k: int) -> Tensor:
    """The (k+1)-th smallest of ``flat`` given its k-th smallest ``kth``.

    Two elementwise passes instead of a second selection: it equals ``kth``
    when ``kth`` repeats beyond rank k, else it is the smallest larger value.
    Chosen on the device (no host sync).
    """
    repeats = (flat <= kth).sum() > k
    return torch.where(repeats, kth, torch.where(flat > kth, flat, torch.inf).amin())


def clamp_outliers(x: Tensor, quantile: float = 0.99) -> tuple[Tensor, Tensor]:
    """Split ``x`` into ``(clamped, residual)`` at the ``quantile`` of ``|x|``.

    The threshold ``t`` is rounded to ``x``'s dtype so that ``clamped`` lies
    exactly in ``[-t, t]`` and ``residual = x - clamped`` is non-zero exactly
    where ``|x| > t``: about a ``1 - quantile`` share of the entries.
    """
    threshold = abs_quantile(x, quantile).to(x.dtype)  # stays on the device: no host sync
    clamped = torch.clamp(x, -threshold, threshold)
    return clamped, x - clamped


def residual_matmul(
    residual: Tensor, w: Tensor, *, max_sparse_density: float = SPARSE_DENSITY_MAX
) -> Tensor:
    """Compute ``residual @ w.T`` doing work only for the residual's non-zero entries.

    ``residual`` has shape ``(..., d)`` and ``w`` shape ``(n, d)``. Both
    routes give the dense product up to summation order:

    * at most a ``max_sparse_density`` share of non-zeros, in a dtype with a
      CPU sparse kernel (float32/float64): a CSR x dense product, whose cost
      scales with the number of non-zeros (scattered outliers);
    * otherwise: a dense GEMM on the sub-matrix of rows (tokens) and columns
      (channels) that hold any non-zero, which pays off when outliers gather
      in a few channels, as they do in LLM activations.

    The CSR route reads ``w.T`` row by row: passing ``w`` as the transposed
    view of a contiguous ``(d, n)`` tensor saves a transposing copy of it.
    Off the CPU the product is one dense GEMM: choosing a route counts the
    non-zeros on the host, which would stall a GPU stream and break a CUDA graph.
    """
    d, n = residual.shape[-1], w.shape[0]
    if w.shape != (n, d):
        raise ValueError(f"w must have shape (n, {d}), got {tuple(w.shape)}")
    flat = residual.reshape(-1, d)
    if flat.device.type != "cpu":
        return (flat @ w.t()).reshape(*residual.shape[:-1], n)
    nonzero = flat != 0
    nnz = nonzero.sum().item()
    if nnz == 0:
        out = flat.new_zeros(flat.shape[0], n)
    elif nnz <= max_sparse_density * flat.numel() and _has_csr_kernel(flat):
        out = _csr_matmul(flat, w.t())
    else:
        out = _compacted_matmul(flat, nonzero, w)
    return out.reshape(*residual.shape[:-1], n)


def _has_csr_kernel(x: Tensor) -> bool:
    """Whether ``torch.sparse.mm`` implements CSR x dense for ``x`` (MKL on CPU)."""
    return x.device.type == "cpu" and x.dtype in _CSR_DTYPES


def _csr_matmul(x: Tensor, w_t: Tensor) -> Tensor:
    """``x @ w_t`` with ``x`` converted to CSR, so only its non-zeros are multiplied."""
    with warnings.catch_warnings():
        # The CSR layout is flagged as beta; tests check the product against dense.
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse.mm(x.to_sparse_csr(), w_t)


def _compacted_matmul(x: Tensor, nonzero: Tensor, w: Tensor) -> Tensor:
    """Dense GEMM restricted to the rows and columns of ``x`` holding a non-zero."""
    rows = _used_indices(nonzero.any(dim=1))
    cols = _used_indices(nonzero.any(dim=0))
    out = x.new_zeros(x.shape[0], w.shape[0])
    out[rows] = x[rows][:, cols] @ w[:, cols].t()
    return out


def _used_indices(used: Tensor) -> Tensor | slice:
    """Indices of the used positions of an axis, or all of it unless that halves it.

    Gathering the matching slices of ``w`` is a strided copy; it only repays
    itself when it removes a large share of the GEMM.
    """
    if 2 * used.sum().item() <= used.numel():
        return used.nonzero().squeeze(1)
    return slice(None)


def outlier_blocks(x: Tensor, block_size: int, threshold: float = E2M1_UNDERFLOW_RATIO) -> Tensor:
    """Flag each block of ``block_size`` consecutive last-axis values that holds an outlier.

    A block holds an outlier when ``max|x| >= threshold * median|x|`` over the
    block (the lower median for even sizes) and ``max|x| > 0``. With the
    default threshold of 24 this is exactly FP4's zero-collapse condition:
    once the block is scaled so that its max maps to E2M1's 6, the median, and
    with it at least half of the block, lands at or below 0.25 and rounds
    (to nearest, ties to even) to zero. A block that is at least half exact
    zeros is flagged as soon as it holds any non-zero value; an all-zero block
    is not.

    Returns a bool tensor of shape ``(..., d // block_size)``.
    """
    if block_size < 1 or x.dim() == 0 or x.shape[-1] % block_size:
        size = "a scalar" if x.dim() == 0 else f"last axis {x.shape[-1]}"
        raise ValueError(f"block size {block_size} must be >= 1 and divide the {size}")
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    magnitude = x.detach().abs().to(torch.promote_types(x.dtype, torch.float32))
    blocks = magnitude.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    peak = blocks.amax(dim=-1)
    median = blocks.median(dim=-1).values
    return (peak >= threshold * median) & (peak > 0)


def outlier_block_fraction(
    x: Tensor, block_size: int, threshold: float = E2M1_UNDERFLOW_RATIO
) -> float:
    """Share of blocks flagged by :func:`outlier_blocks` (0.0 for an empty tensor)."""
    flags = outlier_blocks(x, block_size, threshold)
    return flags.sum().item() / flags.numel() if flags.numel() else 0.0
