"""Triton kernel: activations times a weight kept as packed 4-bit codes, decoded in registers.

At decode sizes (a few dozen tokens) a rollout GEMM is bound by the bytes of its weight.
Decoding the packed codes into a bf16 buffer and then running a bf16 GEMM reads the codes,
writes and reads back a bf16 weight (2.25x a bf16 linear's bytes); this kernel reads the
codes and scales once (about 0.28x bf16's weight bytes for HiF4, 0.27x for NVFP4), decodes
each tile of the weight in registers with :func:`~fp4rl.kernels.triton_decode.decode_tile`
(the same values as the decode kernel, bit for bit) and feeds it to the tensor cores with
fp32 accumulation.

The epilogue is :func:`fp4rl.gemm.mm`'s, in its order: each activation term's fp32 product
times its scale (per tensor or per row), the terms summed (ResQ's ``Q(x)`` and its sparse
residual share every decoded weight tile: two accumulators), times the weight's per-tensor
or per-column scale (NVFP4's FP32 scale), plus the bias, rounded once to the output dtype.
Compiled without contraction (:data:`~fp4rl.kernels.triton_quant.COMPILE_OPTIONS`), so that
no product fuses with a sum the reference rounds separately. Only the accumulation order
within the GEMM differs from a decode-then-GEMM (as between any two GEMM kernels).

An absent scale is read as a 1.0 (``x * 1.0`` is ``x``, bit for bit), so one binary serves
scaled and unscaled operands; a bias is a constant of its own (``x + 0.0`` would turn
``-0.0`` into ``+0.0``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from fp4rl.kernels import KernelFormat
from fp4rl.kernels.codes import FormatCode
from fp4rl.kernels.triton_decode import decode_tile
from fp4rl.kernels.triton_quant import MAX_PROGRAMS, Variant, bf16_rne, format_fields

#: tile of the output (rows of the activations) and of the weight (its rows, and its
#: columns per step along K); BK covers a whole block of every 4-bit format (16, 32, 64)
BN, BK = 64, 32
#: the tile heights a launch picks from by its token count (16: one decode step of a few
#: sequences; 64: up to :data:`~fp4rl.kernels.FUSED_MAX_ROWS`, where callers stop)
HEIGHTS = (16, 64)
#: the bias types a launch takes (None: no bias); any other is widened to float32
BIASES = (None, torch.bfloat16, torch.float32)
#: warps per program by (tile height, terms): ResQ's two fp32 accumulators of a 64-row
#: tile do not fit 4 warps' registers (they spilled to local memory on sm_90), and one
#: HiF4 accumulator of 64 rows on 8 warps spilled a few values on sm_100
WARPS = {(16, 1): 4, (16, 2): 4, (64, 1): 4, (64, 2): 8}
#: loop stages by (tile height, terms) where Triton's default fails: Triton 3.6 (torch
#: 2.11's) stops in its pipeliner on sm_100 with two 64-row accumulators on 8 warps
STAGES = {(64, 2): 1}
#: the activations' and output's dtype the kernel takes (every FP4 value is exact in bf16)
DTYPE = torch.bfloat16


# the token count, and the scales' strides (0 or 1): one binary for every batch
@triton.jit(do_not_specialize=("m", "s0_stride", "s1_stride", "ws_stride"))
def _packed_mm_kernel(a_ptr, codes_ptr, scale_ptr, l2_ptr, l3_ptr, s0_ptr, s1_ptr, ws_ptr,
                      bias_ptr, y_ptr, m, n, k, blocks, s0_stride, s1_stride, ws_stride,
                      FMT: tl.constexpr, BS: tl.constexpr, TERMS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, F32_DOT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(n, BN)
    offs_m = (pid // n_tiles) * BM + tl.arange(0, BM).to(tl.int64)[:, None]  # (BM, 1)
    offs_n = (pid % n_tiles) * BN + tl.arange(0, BN).to(tl.int64)  # (BN,)
    w_rows = offs_n[:, None]  # (BN, 1): the weight's rows are the output's columns
    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k, BK):
        kk = k0 + tl.arange(0, BK).to(tl.int64)[None, :]  # (1, BK)
        w_live = (w_rows < n) & (kk < k)
        w = decode_tile(codes_ptr, scale_ptr, l2_ptr, l3_ptr, w_rows, w_rows < n, k0, blocks,
                        FMT, BS, BN, BK)
        # past K the product must add nothing (a NaN block's padding would add NaN)
        wt = tl.trans(tl.where(w_live, w, 0.0).to(tl.bfloat16))  # (BK, BN), exact
        a_live = (offs_m < m) & (kk < k)
        a0 = tl.load(a_ptr + offs_m * k + kk, mask=a_live, other=0.0)
        if F32_DOT:  # the interpreter: the same exact products, in float32
            wt = wt.to(tl.float32)
            a0 = a0.to(tl.float32)
        acc0 = tl.dot(a0, wt, acc0, input_precision="ieee" if F32_DOT else None)
        if TERMS == 2:  # ResQ's residual term, the rows after the first m
            a1 = tl.load(a_ptr + (offs_m + m) * k + kk, mask=a_live, other=0.0)
            if F32_DOT:
                a1 = a1.to(tl.float32)
            acc1 = tl.dot(a1, wt, acc1, input_precision="ieee" if F32_DOT else None)
    in_m = offs_m < m
    y = acc0 * tl.load(s0_ptr + offs_m * s0_stride, mask=in_m, other=1.0)
    if TERMS == 2:
        y = y + acc1 * tl.load(s1_ptr + offs_m * s1_stride, mask=in_m, other=1.0)
    in_n = offs_n[None, :] < n
    y = y * tl.load(ws_ptr + offs_n[None, :] * ws_stride, mask=in_n, other=1.0)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n[None, :], mask=in_n, other=0.0).to(tl.float32)
    # rounded to bf16 here, so that the store's conversion is exact (the interpreter's
    # truncates; a GPU's rounds to nearest even, as this does)
    tl.store(y_ptr + offs_m * n + offs_n[None, :], bf16_rne(y).to(y_ptr.dtype.element_ty),
             mask=in_m & in_n)


def height(m: int) -> int:
    """The tile height a launch of ``m`` token rows takes."""
    return next((h for h in HEIGHTS if m <= h), HEIGHTS[-1])


def packed_mm_variant(fmt: KernelFormat, terms: int, bias: torch.dtype | None, bm: int,
                      f32_dot: bool = False) -> Variant:
    """The packed GEMM for ``fmt`` with ``terms`` activation terms (1, or ResQ's 2), a bias
    of type ``bias`` (bf16 as vLLM's, float32 as an FP32 master's) or none, and tile
    height ``bm``; the scales are float32 (an absent one is a 1.0); a format without
    HiF4's two levels passes its scale in their place.
    ``f32_dot``: the tile products in float32 (the interpreter's ``tl.dot`` on bf16
    multiplies the raw bits; bf16 values and their products are exact in float32, so the
    products are the same); a GPU multiplies bf16 on its tensor cores."""
    code, bs = format_fields(fmt)
    return Variant(_packed_mm_kernel,
                   (DTYPE,) + (torch.uint8,) * 4 + (torch.float32,) * 3 + (bias or DTYPE, DTYPE),
                   (("FMT", code), ("BS", bs), ("TERMS", terms), ("HAS_BIAS", bias is not None),
                    ("BM", bm), ("BN", BN), ("BK", BK), ("F32_DOT", f32_dot)),
                   num_warps=WARPS[bm, terms], num_stages=STAGES.get((bm, terms)))


def packed_mm_variants(fmt: KernelFormat) -> list[Variant]:
    """What :func:`packed_mm_2d` can launch for ``fmt``."""
    if fmt.kernels is None or "packed_mm" not in fmt.kernels.triton:
        return []
    return [packed_mm_variant(fmt, terms, bias, bm)
            for terms in (1, 2) for bias in BIASES for bm in HEIGHTS]


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on ``device``, made once: an absent scale's stand-in, so that a
    launch adds no fill kernel of its own (one per linear at every decode step) and a
    CUDA graph reads a tensor that outlives it (the engine's eager warm-up makes it)."""
    return torch.ones((), dtype=torch.float32, device=device)


def _scale(s: torch.Tensor | None, one: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A scale's float32 values and stride along the rows: 0 for one value for all (a
    0-dim tensor), 1 for one a row (a column vector, of one row at a decode step of one
    token: still a row's scale)."""
    if s is None:
        return one, 0
    s = s.to(torch.float32).contiguous()
    return s, 0 if s.dim() == 0 else 1


def packed_mm_2d(fmt: KernelFormat, a: torch.Tensor, terms: int,
                 fields: dict[str, torch.Tensor], rows: int, cols: int,
                 term_scales: list[torch.Tensor | None], weight_scale: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``sum_t (a_t @ W.T) * s_t * ws + bias`` in bf16, ``a`` the ``terms`` activation
    terms stacked along the rows (``(terms * m, cols)`` bf16), ``W`` the ``(rows, cols)``
    weight packed along its rows (fields as :meth:`fp4rl.gemm.PackedOperand.row_fields`
    lays them out), ``term_scales`` each term's per-tensor or per-row scale (or None),
    ``weight_scale`` per tensor or per weight row."""
    code, bs = format_fields(fmt)
    if a.dtype != DTYPE or a.shape[1] != cols or a.shape[0] % terms:
        raise ValueError(f"packed_mm_2d takes {terms} bf16 terms of {cols} columns, got "
                         f"{tuple(a.shape)} {a.dtype}")
    m = a.shape[0] // terms
    flat = {k: v.contiguous() for k, v in fields.items()}
    codes, scale = flat["codes"], flat["scale"]
    l2, l3 = (flat["level2"], flat["level3"]) if code == FormatCode.HIF4 else (scale, scale)
    one = _one(a.device)
    s0, st0 = _scale(term_scales[0], one)
    s1, st1 = _scale(term_scales[-1], one)
    ws, wst = _scale(weight_scale, one)
    y = torch.empty(m, rows, dtype=DTYPE, device=a.device)
    bm = height(m)
    programs = triton.cdiv(m, bm) * triton.cdiv(rows, BN)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"a ({m}, {rows}) product needs {programs} programs, over CUDA's "
                         f"{MAX_PROGRAMS}")
    if bias is not None and bias.dtype not in BIASES:
        bias = bias.float()  # exact: a bias joins the float32 accumulator
    b = y if bias is None else bias.contiguous()
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    packed_mm_variant(fmt, terms, None if bias is None else bias.dtype, bm,
                      interpreted).launch(
        (programs,), a.contiguous(), codes, scale, l2, l3, s0, s1, ws, b, y, m, rows, cols,
        -(-cols // bs), st0, st1, wst)
    return y


__all__ = ["BIASES", "BK", "BN", "DTYPE", "HEIGHTS", "height", "packed_mm_2d",
           "packed_mm_variant", "packed_mm_variants"]
