"""Triton kernel: activations times a weight kept as packed 4-bit codes, decoded in registers.

A rollout GEMM at decode sizes (a few dozen tokens) is bound by the bytes of its weight.
Decoding the packed codes into a bf16 buffer and then running a bf16 GEMM reads the codes,
writes and reads back a bf16 weight (2.25x a bf16 linear's bytes); this kernel reads the
codes and scales (about 0.28x bf16's weight bytes for HiF4, 0.27x for NVFP4), decodes
each tile of the weight in registers with :func:`~fp4rl.kernels.triton_decode.decode_tile`
(the same values as the decode kernel, bit for bit) and feeds it to the tensor cores with
fp32 accumulation. It runs at every token count: a prefill or a large decode batch takes
taller tiles (:data:`HEIGHTS`), so that each program decodes its weight tile for more rows.

Bytes, counted as every GEMM in ``fp4rl bench --traffic`` is (one read of each input per
launch): the activations, the codes and scales, the output. A real launch re-reads a
weight tile once per row tile, ``ceil(M / BM)`` times (1 up to 128 tokens, 2 at 256, 16
at 2048 for one term; ResQ's two terms stop at 64 rows: 4 at 256, 32 at 2048), and an
activation tile once per 64 outputs, as a bf16 GEMM re-reads its operands once per tile
of its own; those re-reads mostly hit the L2 cache, which the count does not model.

Few output tiles (2048 outputs at a decode step: 32 programs on a GPU of 132 SMs) split K
(:func:`k_split`, from the shape alone, never from timing or the device): each part's
fp32 sums go to memory and :func:`_packed_reduce_kernel` adds them in part order, then
applies the epilogue, so the result does not depend on which program ran first. The split
and the tile height depend on the token count, so the reduction order does too: a
batch-invariant forward does without this kernel (:func:`fp4rl.gemm.packed_fusion`).

The epilogue is :func:`fp4rl.gemm.mm`'s, in its order: each activation term's fp32 product
times its scale (per tensor or per row), the terms summed (ResQ's ``Q(x)`` and its sparse
residual share every decoded weight tile: two accumulators), times the weight's per-tensor
or per-column scale (NVFP4's FP32 scale), plus the bias, rounded once to the output dtype.
Compiled without contraction (:data:`~fp4rl.kernels.triton_quant.COMPILE_OPTIONS`), so that
no product fuses with a sum the reference rounds separately. Only the accumulation order
within the GEMM differs from a decode-then-GEMM (as between any two GEMM kernels); where
every partial sum is exact in fp32, a split or unsplit launch gives the same bits as it.

ResQ's second term may come n:m sparse, as sparse tensor cores take an operand
(:class:`fp4rl.gemm.NMOperand`: of each group, the kept values in order and a byte of bits
for their positions; at 2:4, 0.625x a dense bf16 term's bytes, written by the ResQ kernel
and read here). Each tile is expanded in registers to the dense term's values, +0 where a
value was not kept, so the products and their order are those of the dense term.

An absent scale is read as a 1.0 (``x * 1.0`` is ``x``, bit for bit), so one binary serves
scaled and unscaled operands; a bias is a constant of its own (``x + 0.0`` would turn
``-0.0`` into ``+0.0``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fp4rl.kernels.base import KernelFormat, Operation
from fp4rl.kernels.codes import FormatCode
from fp4rl.kernels.triton_decode import decode_tile
from fp4rl.kernels.triton_quant import (
    MAX_PROGRAMS,
    Variant,
    bf16_rne,
    format_fields,
    scale_argument,
)

#: tile of the output (rows of the activations) and of the weight (its rows, and its
#: columns per step along K); BK covers a whole block of every 4-bit format (16, 32, 64)
BN, BK = 64, 32
#: the tile heights a launch picks from by its token count, by the terms it multiplies
#: (16: one decode step of a few sequences; 64: a large decode batch; 128: a prefill).
#: Each program decodes its weight tile once for its BM rows, so a taller tile decodes
#: (and reads) the weight fewer times: ``ceil(M / BM)`` per launch. ResQ's two fp32
#: accumulators of 128 rows spilled to local memory on sm_90 and sm_100 (on 8 warps, and
#: more on 16): two terms stop at 64
# ResQ's two terms at 64 rows spilled registers on sm_100 with Triton 3.6 (torch 2.11's)
HEIGHTS = {1: (16, 64, 128), 2: (16,)}
#: the bias types a launch takes (None: no bias); any other is widened to float32
BIASES = (None, torch.bfloat16, torch.float32)
#: warps per program by (tile height, terms): ResQ's two fp32 accumulators of a 64-row
#: tile do not fit 4 warps' registers (they spilled to local memory on sm_90), and one
#: HiF4 accumulator of 64 rows on 8 warps spilled a few values on sm_100
WARPS = {(16, 1): 4, (16, 2): 4, (64, 1): 4, (64, 2): 8, (128, 1): 8}
#: loop stages by (tile height, terms) where Triton's default fails: Triton 3.6 (torch
#: 2.11's) stops in its pipeliner on sm_100 with two 64-row accumulators on 8 warps
STAGES = {(64, 2): 1}
#: the activations' and output's dtype the kernel takes (every FP4 value is exact in bf16)
DTYPE = torch.bfloat16
#: the programs a launch aims for before it splits K: a fixed number (the SMs of an
#: H100/H200), not the device's, so that a shape splits the same way on every GPU and the
#: split never depends on timing
SPLIT_PROGRAMS = 132
#: the fp32 partial sums a split writes and the reduction reads back are held to at most
#: 1/PARTIAL_SHARE of a bf16 weight's bytes (at most about 1/9 of the codes' bytes)
PARTIAL_SHARE = 32
#: the reduction's output tile
REDUCE_BM, REDUCE_BN = 16, 128


@triton.jit
def _epilogue(acc0, acc1, offs_m, offs_n, m, n, s0_ptr, s1_ptr, ws_ptr, bias_ptr, y_ptr,
              s0_stride, s1_stride, ws_stride, TERMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`fp4rl.gemm.mm`'s epilogue on the fp32 sums of a (BM, BN) output tile
    (``offs_m`` (BM, 1), ``offs_n`` (BN,), int64): each term's scale, the terms summed,
    the weight's scale, the bias, one rounding to bf16, stored."""
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


# the token count, the scales' strides (0 or 1) and the split: one binary for every batch
@triton.jit
def _nm_tile(r_ptr, bits_ptr, offs_m, kk, live, groups, keep, size):
    """The (BM, BK) dense tile of an n:m operand (:class:`fp4rl.gemm.NMOperand`) of groups
    of ``size`` (at most 8: a byte's bits): a kept position's value from its group's
    ``keep`` in order (its slot: the kept positions before it, counted from the group's
    bits), +0 elsewhere."""
    group = kk // size
    pos = (kk % size).to(tl.int32)
    bits = tl.load(bits_ptr + offs_m * groups + group, mask=live, other=0).to(tl.int32)
    below = bits & ((1 << pos) - 1)
    slot = tl.zeros_like(below)
    for t in tl.static_range(8):
        slot += (below >> t) & 1
    kept = live & (((bits >> pos) & 1) != 0)
    return tl.load(r_ptr + offs_m * groups * keep + group * keep + slot.to(tl.int64),
                   mask=kept, other=0.0)


@triton.jit(do_not_specialize=("m", "s0_stride", "s1_stride", "ws_stride", "k_part",
                               "groups", "keep", "size"))
def _packed_mm_kernel(a_ptr, codes_ptr, scale_ptr, l2_ptr, l3_ptr, s0_ptr, s1_ptr, ws_ptr,
                      bias_ptr, y_ptr, part_ptr, r_ptr, bits_ptr, m, n, k, blocks,
                      s0_stride, s1_stride, ws_stride, k_part, groups, keep, size,
                      FMT: tl.constexpr, BS: tl.constexpr, TERMS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, F32_DOT: tl.constexpr, NM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(n, BN)
    tiles = tl.cdiv(m, BM) * n_tiles
    split = pid // tiles  # the part of K this program sums: [k_lo, k_hi)
    tile = pid % tiles
    offs_m = (tile // n_tiles) * BM + tl.arange(0, BM).to(tl.int64)[:, None]  # (BM, 1)
    offs_n = (tile % n_tiles) * BN + tl.arange(0, BN).to(tl.int64)  # (BN,)
    w_rows = offs_n[:, None]  # (BN, 1): the weight's rows are the output's columns
    k_lo = split * k_part
    k_hi = tl.minimum(k_lo + k_part, k)
    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
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
        if TERMS == 2:  # ResQ's residual term: n:m sparse, or the rows after the first m
            if NM > 0:
                a1 = _nm_tile(r_ptr, bits_ptr, offs_m, kk, a_live, groups, keep, size)
            else:
                a1 = tl.load(a_ptr + (offs_m + m) * k + kk, mask=a_live, other=0.0)
            if F32_DOT:
                a1 = a1.to(tl.float32)
            acc1 = tl.dot(a1, wt, acc1, input_precision="ieee" if F32_DOT else None)
    if k_part < k:  # one part of K: the fp32 sums, for the reduction in split order
        live = (offs_m < m) & (offs_n[None, :] < n)
        at = offs_m * n + offs_n[None, :]
        tl.store(part_ptr + (split * TERMS) * m * n + at, acc0, mask=live)
        if TERMS == 2:
            tl.store(part_ptr + (split * TERMS + 1) * m * n + at, acc1, mask=live)
    else:
        _epilogue(acc0, acc1, offs_m, offs_n, m, n, s0_ptr, s1_ptr, ws_ptr, bias_ptr, y_ptr,
                  s0_stride, s1_stride, ws_stride, TERMS, HAS_BIAS)


@triton.jit(do_not_specialize=("m", "splits", "s0_stride", "s1_stride", "ws_stride"))
def _packed_reduce_kernel(part_ptr, s0_ptr, s1_ptr, ws_ptr, bias_ptr, y_ptr, m, n, splits,
                          s0_stride, s1_stride, ws_stride, TERMS: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The split GEMM's partial sums added in split order (0, 1, 2, ...: fixed, whatever
    order the programs ran in), then the epilogue."""
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(n, BN)
    offs_m = (pid // n_tiles) * BM + tl.arange(0, BM).to(tl.int64)[:, None]  # (BM, 1)
    offs_n = (pid % n_tiles) * BN + tl.arange(0, BN).to(tl.int64)  # (BN,)
    live = (offs_m < m) & (offs_n[None, :] < n)
    at = offs_m * n + offs_n[None, :]
    term = (offs_m * 0 + m) * n  # (BM, 1) int64: one term's sums of one part
    p0 = part_ptr + at
    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, splits):
        acc0 = acc0 + tl.load(p0, mask=live, other=0.0)
        if TERMS == 2:
            acc1 = acc1 + tl.load(p0 + term, mask=live, other=0.0)
        p0 += term * TERMS
    _epilogue(acc0, acc1, offs_m, offs_n, m, n, s0_ptr, s1_ptr, ws_ptr, bias_ptr, y_ptr,
              s0_stride, s1_stride, ws_stride, TERMS, HAS_BIAS)


def height(m: int, terms: int = 1) -> int:
    """The tile height a launch of ``m`` token rows of ``terms`` terms takes."""
    heights = HEIGHTS[terms]
    return next((h for h in heights if m <= h), heights[-1])


def k_split(m: int, n: int, k: int, terms: int) -> int:
    """The columns of K each program of an ``(m, k) x (k, n)`` launch of ``terms`` terms
    sums (a multiple of BK; ``k`` or more: no split), chosen from the shape alone.

    With few output tiles (2048 outputs and a few tokens: 32 programs) most of a GPU's
    SMs would sit idle while the weight is read; K is then cut into parts, each summed by
    programs of their own, so that the launch has about :data:`SPLIT_PROGRAMS` programs.
    The parts' fp32 sums go to memory and a second kernel adds them in part order, so the
    result does not depend on which program ran first; the parts are held so that those
    partial sums' bytes stay under 1/:data:`PARTIAL_SHARE` of a bf16 weight's (a split
    pays only where the weight's bytes dominate: a few tokens)."""
    steps = -(-k // BK)
    tiles = -(-m // height(m, terms)) * -(-n // BN)
    if tiles == 0:
        return k
    # partials written and read: 2 * 4 bytes * splits * terms * m * n <= 2 * n * k / SHARE
    by_bytes = k // (4 * PARTIAL_SHARE * terms * max(m, 1))
    splits = min(-(-SPLIT_PROGRAMS // tiles), steps, by_bytes)
    if splits <= 1:
        return k
    per = -(-steps // splits)  # BK steps a part
    return per * BK


def packed_mm_variant(fmt: KernelFormat, terms: int, bias: torch.dtype | None, bm: int,
                      f32_dot: bool = False, nm: bool = False) -> Variant:
    """The packed GEMM for ``fmt`` with ``terms`` activation terms (1, or ResQ's 2), a bias
    of type ``bias`` (bf16 as vLLM's, float32 as an FP32 master's) or none, and tile
    height ``bm``; the scales are float32 (an absent one is a 1.0); a format without
    HiF4's two levels passes its scale in their place.
    ``f32_dot``: the tile products in float32 (the interpreter's ``tl.dot`` on bf16
    multiplies the raw bits; bf16 values and their products are exact in float32, so the
    products are the same); a GPU multiplies bf16 on its tensor cores. ``nm``: the
    second term kept n:m sparse (:class:`fp4rl.gemm.NMOperand`, any group up to 8, a
    launch's argument), expanded in registers; else dense, stacked after the first. Its
    pointers are the bf16 values and the uint8 bits (where absent, the activations and the
    codes are passed in their place)."""
    code, bs = format_fields(fmt)
    return Variant(_packed_mm_kernel,
                   (DTYPE,) + (torch.uint8,) * 4 + (torch.float32,) * 3 +
                   (bias or DTYPE, DTYPE, torch.float32, DTYPE, torch.uint8),
                   (("FMT", code), ("BS", bs), ("TERMS", terms), ("HAS_BIAS", bias is not None),
                    ("BM", bm), ("BN", BN), ("BK", BK), ("F32_DOT", f32_dot), ("NM", nm)),
                   num_warps=WARPS[bm, terms], num_stages=STAGES.get((bm, terms)))


def reduce_variant(terms: int, bias: torch.dtype | None) -> Variant:
    """The reduction of a split packed GEMM of ``terms`` terms and a bias of type ``bias``
    (or none): one for every format (it reads fp32 sums, not codes)."""
    return Variant(_packed_reduce_kernel,
                   (torch.float32,) * 4 + (bias or DTYPE, DTYPE),
                   (("TERMS", terms), ("HAS_BIAS", bias is not None), ("BM", REDUCE_BM),
                    ("BN", REDUCE_BN)))


def packed_mm_variants(fmt: KernelFormat) -> list[Variant]:
    """What :func:`packed_mm_2d` can launch for ``fmt``: the GEMM at each tile height, and
    the split GEMM's reduction."""
    if fmt.kernels is None or Operation.PACKED_MM not in fmt.kernels.triton:
        return []
    return [packed_mm_variant(fmt, terms, bias, bm)
            for terms in (1, 2) for bias in BIASES for bm in HEIGHTS[terms]] + \
        [packed_mm_variant(fmt, 2, bias, bm, nm=True) for bias in BIASES for bm in HEIGHTS[2]] + \
        [reduce_variant(terms, bias) for terms in (1, 2) for bias in BIASES]


def packed_mm_2d(fmt: KernelFormat, a: torch.Tensor, terms: int,
                 fields: dict[str, torch.Tensor], rows: int, cols: int,
                 term_scales: list[torch.Tensor | None], weight_scale: torch.Tensor | None,
                 bias: torch.Tensor | None,
                 residual: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
                 ) -> torch.Tensor:
    """``sum_t (a_t @ W.T) * s_t * ws + bias`` in bf16, ``a`` the ``terms`` activation
    terms stacked along the rows (``(terms * m, cols)`` bf16), ``W`` the ``(rows, cols)``
    weight packed along its rows (fields as :meth:`fp4rl.gemm.PackedOperand.row_fields`
    lays them out), ``term_scales`` each term's per-tensor or per-row scale (or None),
    ``weight_scale`` per tensor or per weight row. ``residual``: the second term kept n:m
    sparse (values, bits, keep, group, as :class:`fp4rl.gemm.NMOperand` holds them); ``a``
    then holds the first term alone."""
    code, bs = format_fields(fmt)
    stacked = terms if residual is None else 1
    if a.dtype != DTYPE or a.shape[1] != cols or a.shape[0] % stacked or \
            (residual is not None and terms != 2):
        raise ValueError(f"packed_mm_2d takes {terms} bf16 terms of {cols} columns, got "
                         f"{tuple(a.shape)} {a.dtype}")
    m = a.shape[0] // stacked
    r_values, r_bits, keep, group = (a, fields["codes"], 0, 1) if residual is None \
        else residual
    if residual is not None and (r_values.dtype != DTYPE or r_bits.dtype != torch.uint8 or
                                 not 0 < keep < group <= 8 or r_bits.shape[0] != m):
        raise ValueError("packed_mm_2d takes an n:m term of bf16 values and uint8 bits, "
                         f"{m} rows, keep < group <= 8")
    flat = {k: v.contiguous() for k, v in fields.items()}
    codes, scale = flat["codes"], flat["scale"]
    l2, l3 = (flat["level2"], flat["level3"]) if code == FormatCode.HIF4 else (scale, scale)
    s0, st0 = scale_argument(term_scales[0], m, a.device)
    s1, st1 = scale_argument(term_scales[-1], m, a.device)
    ws, wst = scale_argument(weight_scale, rows, a.device)
    y = torch.empty(m, rows, dtype=DTYPE, device=a.device)
    bm = height(m, terms)
    ks = k_split(m, rows, cols, terms)
    splits = -(-cols // ks)
    programs = splits * triton.cdiv(m, bm) * triton.cdiv(rows, BN)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"a ({m}, {rows}) product needs {programs} programs, over CUDA's "
                         f"{MAX_PROGRAMS}")
    if bias is not None and bias.dtype not in BIASES:
        bias = bias.float()  # exact: a bias joins the float32 accumulator
    b = y if bias is None else bias.contiguous()
    bias_type = None if bias is None else bias.dtype
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    part = s0 if splits == 1 else \
        torch.empty(splits * terms * m * rows, dtype=torch.float32, device=a.device)
    packed_mm_variant(fmt, terms, bias_type, bm, interpreted, residual is not None).launch(
        (programs,), a.contiguous(), codes, scale, l2, l3, s0, s1, ws, b, y, part,
        r_values.contiguous(), r_bits.contiguous(), m, rows, cols, -(-cols // bs), st0, st1,
        wst, ks, -(-cols // group), keep, group)
    if splits > 1:
        reduce_variant(terms, bias_type).launch(
            (triton.cdiv(m, REDUCE_BM) * triton.cdiv(rows, REDUCE_BN),), part, s0, s1, ws, b,
            y, m, rows, splits, st0, st1, wst)
    return y


__all__ = ["BIASES", "BK", "BN", "DTYPE", "HEIGHTS", "PARTIAL_SHARE", "SPLIT_PROGRAMS", "height",
           "k_split", "packed_mm_2d", "packed_mm_variant", "packed_mm_variants",
           "reduce_variant"]
