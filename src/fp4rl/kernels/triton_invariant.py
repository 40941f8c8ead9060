"""Triton kernel: the batch-invariant GEMM on a GPU.

A library GEMM on a GPU chooses its tiles, its split of K across thread blocks and its
algorithm by the problem's shape, so a row's result depends on how many rows come with it.
This kernel takes one tile configuration for every shape and never splits K: each output
tile walks K in ``BLOCK_K`` steps, in order, accumulating ``tl.dot`` products in float32,
so an output's sequence of operations depends on K alone (vLLM's batch-invariant mode does
the same). bf16 operands multiply on the tensor cores as TF32, in which every bf16 value is
exact, with float32 accumulation; float32 operands in IEEE precision (no TF32 rounding).
The bias joins the float32 accumulator; the output is rounded once.

The launcher is the ``fp4rl::bi_mm`` operator (a fake implementation gives shapes on the
``meta`` device and under ``torch.compile``), which
:class:`fp4rl.nn.invariant.BatchInvariantMode` routes a GPU's ``mm``, ``addmm`` and
``bmm`` to.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from fp4rl.kernels.triton_quant import Variant

#: the one tile configuration (a row's bits depend on it, so it never changes with shape)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit(do_not_specialize=("M", "N", "K"))
def _bi_mm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                  stride_bn, stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    ks = tl.arange(0, BK).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + ks
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:  # bf16 values are exact in TF32 (10 mantissa bits): tensor cores, no rounding
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def mm_variant(dtype: torch.dtype, bias: bool) -> Variant:
    """The kernel for ``dtype`` operands and output (float32 or bfloat16), with or without
    a bias (of the same dtype; absent, the output pointer stands in, never read)."""
    return Variant(_bi_mm_kernel, (dtype, dtype, dtype, dtype),
                   (("BM", BLOCK_M), ("BN", BLOCK_N), ("BK", BLOCK_K), ("HAS_BIAS", bias),
                    ("IEEE", dtype == torch.float32)))


def variants() -> Iterator[Variant]:
    """Every variant the launcher can produce, for ahead-of-time compilation."""
    for dtype in (torch.float32, torch.bfloat16):
        for bias in (False, True):
            yield mm_variant(dtype, bias)


def bi_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` of 2-D ``a`` (M, K) and ``b`` (K, N), any strides, one launch."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    mm_variant(a.dtype, bias is not None).launch(
        grid, a, b, out if bias is None else bias, out, m, n, k, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), out.stride(0), out.stride(1))
    return out


@torch.library.custom_op("fp4rl::bi_mm", mutates_args=())
def _bi_mm_op(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The batch-invariant GEMM of 2-D or batched 3-D operands (a loop of launches over
    the batch: each entry's rows are their own)."""
    if a.dim() == 2:
        return bi_mm(a, b, bias)
    return torch.stack([bi_mm(x, y, bias) for x, y in zip(a, b, strict=True)])


@_bi_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "bi_mm", "mm_variant", "variants"]
