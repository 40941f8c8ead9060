"""Triton kernel: a training GEMM that quantizes its operands as it loads them.

Quantizing an activation operand in a pass of its own reads it, writes its quantized
values (bf16) and the GEMM reads them back: 2 + 2 + 2 bytes a value on top of the GEMM's
own read of a bf16 operand, for ``X`` in the forward and along the tokens for the weight
gradient, and for ``dY`` along both of its axes. A scaled format's GEMM then wrote its
fp32 product and multiplied it by each scale in passes of their own. Here each tile of a
high-precision operand (float32 or bf16, read as it is laid out: any strides, so ``dY``
and ``X`` along the tokens are read in place, transposed by their strides) is divided by
its per-tensor or per-vector scale and quantized in registers along the GEMM's reduction
axis with the quantize kernel's own :func:`~fp4rl.kernels.triton_quant.quantize_tile`
(the same bits as ``quantize_operand``), then multiplied on the tensor cores with fp32
accumulation. The epilogue is :func:`fp4rl.gemm.mm`'s, in its order: the fp32 accumulator
times the left operand's scale (per tensor or per row), times the right one's (per tensor
or per column), plus the bias, rounded once to bf16, and stored in the output's type (a
float32 gradient gets the bf16 value exactly: no cast pass after).

An operand already quantized (the kept ``Q(W)``, in bf16, its scale outside) is read as
it is. Each program quantizes the tiles it loads, so a tile of the left operand is
quantized once per program along the output's columns (``ceil(N / BN)`` times) and one of
the right operand once per program along the rows: the bytes fall to one read of each
operand, the quantizer's arithmetic is repeated; :func:`requantized_values` counts it.

An absent scale is read as a 1.0 (``x / 1.0`` and ``x * 1.0`` are ``x``, bit for bit),
so one binary serves scaled and unscaled operands. Compiled without contraction
(:data:`~fp4rl.kernels.triton_quant.COMPILE_OPTIONS`). Only the accumulation order within
the GEMM differs from quantizing first and multiplying after (as between any two GEMM
kernels); where every partial sum is exact in fp32 the two give the same bits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.kernels.base import KernelFormat
from fp4rl.kernels.triton_quant import (
    MAX_PROGRAMS,
    Variant,
    bf16_rne,
    format_fields,
    quantize_tile,
    scale_argument,
)

#: the output tile (rows, columns) and the step along K: BK covers a whole block of every
#: format (16, 32, 64), and the tiles start at multiples of it, so a block never straddles
#: two steps. 64 x 64 tiles on 8 or 16 warps, and 32 x 32 on 4 or 8, spilled registers
#: on sm_90 or sm_100 where both operands are quantized (the SASS test checks every variant)
BM, BN, BK = 32, 64, 64
#: warps per program
WARPS = 8
#: the types a high-precision operand is read in (a float32 master's activation or
#: gradient, or a bf16 one under autocast)
SOURCE_TYPES = (torch.float32, torch.bfloat16)
#: the types of a quantized operand the kernel reads as it is (the kept Q(W))
KEPT_TYPE = torch.bfloat16
#: the output's types: the compute dtype (bf16), or a float32 gradient's (its bf16 value)
OUT_TYPES = (torch.bfloat16, torch.float32)
#: the bias types a launch takes (None: no bias)
BIASES = (None, torch.bfloat16, torch.float32)


@triton.jit
def _on_load(x, g, FMT: tl.constexpr, R: tl.constexpr, K: tl.constexpr, BS: tl.constexpr):
    """The block values ``Q(x / g)`` of an (R, K) float32 tile, blocks of BS along K, g one
    value or one a row (R, 1): what the quantize kernel writes for the same rows."""
    x = tl.math.div_rn(x, tl.zeros_like(x) + g)
    q = quantize_tile(tl.reshape(x, (R * (K // BS), BS)), 0.0, FMT, R * (K // BS), False)
    return tl.reshape(q, (R, K))


# sizes and strides vary with the batch: one binary for every shape
@triton.jit(do_not_specialize=("m", "n", "k", "sam", "sak", "sbk", "sbn", "sas", "sbs"))
def _qmm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, y_ptr, m, n, k, sam, sak, sbk, sbn,
                sas, sbs, FMT_A: tl.constexpr, BS_A: tl.constexpr, QA: tl.constexpr,
                FMT_B: tl.constexpr, BS_B: tl.constexpr, QB: tl.constexpr,
                HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, F32_DOT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(n, BN)
    rows = (pid // n_tiles) * BM + tl.arange(0, BM).to(tl.int64)[:, None]  # (BM, 1)
    cols = (pid % n_tiles) * BN + tl.arange(0, BN).to(tl.int64)[None, :]  # (1, BN)
    in_m = rows < m
    in_n = cols < n
    ga = tl.load(sa_ptr + rows * sas, mask=in_m, other=1.0)  # (BM, 1)
    gb = tl.load(sb_ptr + cols * sbs, mask=in_n, other=1.0)  # (1, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k, BK):
        ka = k0 + tl.arange(0, BK).to(tl.int64)[None, :]  # (1, BK)
        a = tl.load(a_ptr + rows * sam + ka * sak, mask=in_m & (ka < k), other=0.0)
        if QA:
            a = _on_load(a.to(tl.float32), ga, FMT_A, BM, BK, BS_A)
            # past K the product must add nothing (a NaN block's padding would add NaN)
            a = tl.where(ka < k, a, 0.0)
        kb = k0 + tl.arange(0, BK).to(tl.int64)[:, None]  # (BK, 1)
        b = tl.load(b_ptr + kb * sbk + cols * sbn, mask=(kb < k) & in_n, other=0.0)
        if QB:  # blocks along K, the tile's columns: quantized as the rows of its transpose
            b = tl.trans(_on_load(tl.trans(b.to(tl.float32)), tl.trans(gb), FMT_B, BN, BK,
                                  BS_B))
            b = tl.where(kb < k, b, 0.0)
        a = a.to(tl.bfloat16)  # exact: every block value is a bf16
        b = b.to(tl.bfloat16)
        if F32_DOT:  # the interpreter: the same exact products, in float32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    y = acc * ga
    y = y * gb
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=in_n, other=0.0).to(tl.float32)
    # rounded to bf16 here, once, so that the store's conversion (to bf16 or float32) is
    # exact (the interpreter's truncates; a GPU's rounds to nearest even, as this does)
    tl.store(y_ptr + rows * n + cols, bf16_rne(y).to(y_ptr.dtype.element_ty),
             mask=in_m & in_n)


@dataclass(frozen=True)
class Side:
    """One operand of a launch as the variant sees it: quantized on load (``code`` and
    ``block`` the format's, as :func:`~fp4rl.kernels.triton_quant.format_fields` gives
    them) from a ``source`` type, or a quantized operand read as it is (``code`` None)."""

    code: int | None
    block: int = 16
    source: torch.dtype = KEPT_TYPE

    @classmethod
    def of(cls, fmt: KernelFormat | None, source: torch.dtype = KEPT_TYPE) -> Side:
        if fmt is None:
            return cls(None, 16, source)
        code, block = format_fields(fmt)
        return cls(code, block, source)

    def constants(self, name: str) -> tuple[tuple[str, int | bool], ...]:
        return ((f"FMT_{name}", self.code or 0), (f"BS_{name}", self.block),
                (f"Q{name}", self.code is not None))


def qmm_variant(a: Side, b: Side, bias: torch.dtype | None, out: torch.dtype,
                f32_dot: bool = False) -> Variant:
    """The fused GEMM for two operand sides, a bias of type ``bias`` (or none) and an
    output of type ``out``; the scales are float32 (an absent one is a 1.0).
    ``f32_dot``: the tile products in float32 (the interpreter's ``tl.dot`` on bf16
    multiplies the raw bits; bf16 values and their products are exact in float32)."""
    return Variant(_qmm_kernel,
                   (a.source, b.source, torch.float32, torch.float32, bias or out, out),
                   (*a.constants("A"), *b.constants("B"), ("HAS_BIAS", bias is not None),
                    ("BM", BM), ("BN", BN), ("BK", BK), ("F32_DOT", f32_dot)),
                   num_warps=WARPS)


def qmm_variants(fmt: KernelFormat) -> Iterator[Variant]:
    """What :func:`qmm_2d` launches for a linear whose activations and output gradients are
    in ``fmt``: the forward (``X`` on load times the kept weight, each bias), the input
    gradient (``dY`` on load times the kept weight, into each gradient type) and the weight
    gradient (``dY`` and ``X`` on load along the tokens), from float32 and bf16 sources
    (under autocast with FP32 masters ``X`` is float32 and ``dY`` bf16)."""
    kept = Side.of(None)
    for source in SOURCE_TYPES:
        for bias in BIASES:
            yield qmm_variant(Side.of(fmt, source), kept, bias, torch.bfloat16)
        for out in OUT_TYPES:
            yield qmm_variant(Side.of(fmt, source), kept, None, out)
            for other in SOURCE_TYPES:
                yield qmm_variant(Side.of(fmt, source), Side.of(fmt, other), None, out)


def qmm_representatives(fmt: KernelFormat) -> list[Variant]:
    """One variant of each of a linear's three GEMMs for ``fmt``, as autocast with FP32
    masters launches them: the others differ from these only in a pointer's element type
    (a bias, the output, a bf16 or float32 source), not in the code between the loads and
    the stores that decides registers and float64."""
    kept, f32, bf16 = Side.of(None), torch.float32, torch.bfloat16
    return [qmm_variant(Side.of(fmt, f32), kept, f32, bf16),
            qmm_variant(Side.of(fmt, bf16), kept, None, f32),
            qmm_variant(Side.of(fmt, bf16), Side.of(fmt, f32), None, f32)]


def qmm_2d(a: torch.Tensor, a_side: Side, a_scale: torch.Tensor | None, b: torch.Tensor,
           b_side: Side, b_scale: torch.Tensor | None, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """``(Qa(a / sa) * sa) @ (Qb(b / sb) * sb) + bias`` in bf16 (stored in ``out_dtype``):
    ``a`` (M, K) and ``b`` (K, N) of any strides, each quantized along K on load where its
    side has a format (its scale a 0-dim tensor, or one a row of ``a`` / a column of
    ``b``), or read as it is (bf16 block values, its scale applied in the epilogue only)."""
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"qmm_2d: ({m}, {k}) times ({k2}, {n})")
    for x, side in ((a, a_side), (b, b_side)):
        allowed = SOURCE_TYPES if side.code is not None else (KEPT_TYPE,)
        if x.dtype not in allowed:
            what = "a source" if side.code is not None else "a kept operand"
            raise ValueError(f"qmm_2d reads {what} in {allowed}, got {x.dtype}")
    if out_dtype not in OUT_TYPES:
        raise ValueError(f"qmm_2d writes {OUT_TYPES}, got {out_dtype}")
    sa, sas = scale_argument(a_scale, m, a.device)
    sb, sbs = scale_argument(b_scale, n, a.device)
    if bias is not None and bias.dtype not in BIASES:
        bias = bias.float()  # exact: a bias joins the float32 accumulator
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    programs = triton.cdiv(m, BM) * triton.cdiv(n, BN)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"a ({m}, {n}) product needs {programs} programs, over CUDA's "
                         f"{MAX_PROGRAMS}")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    variant = qmm_variant(Side(a_side.code, a_side.block, a.dtype),
                          Side(b_side.code, b_side.block, b.dtype),
                          None if bias is None else bias.dtype, out_dtype, interpreted)
    variant.launch((programs,), a, b, sa, sb, y if bias is None else bias.contiguous(), y,
                   m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), sas, sbs)
    return y


@torch.library.custom_op("fp4rl::qmm", mutates_args=())
def _qmm(a: torch.Tensor, a_code: int, a_block: int, a_scale: torch.Tensor | None,
         b: torch.Tensor, b_code: int, b_block: int, b_scale: torch.Tensor | None,
         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`qmm_2d` as an operator (a code of -1: the operand is read as it is), so that
    ``torch.compile`` traces one opaque op and a dispatch mode sees the launch's tensors."""
    return qmm_2d(a, Side(None if a_code < 0 else a_code, a_block), a_scale,
                  b, Side(None if b_code < 0 else b_code, b_block), b_scale, bias, out_dtype)


@_qmm.register_fake
def _(a: torch.Tensor, a_code: int, a_block: int, a_scale: torch.Tensor | None,
      b: torch.Tensor, b_code: int, b_block: int, b_scale: torch.Tensor | None,
      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def qmm(a: torch.Tensor, a_fmt: KernelFormat | None, a_scale: torch.Tensor | None,
        b: torch.Tensor, b_fmt: KernelFormat | None, b_scale: torch.Tensor | None,
        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`qmm_2d` through the ``fp4rl::qmm`` operator, the formats given as objects
    (None: that operand is read as it is)."""
    sa, sb = Side.of(a_fmt), Side.of(b_fmt)
    y: torch.Tensor = torch.ops.fp4rl.qmm(a, -1 if sa.code is None else sa.code, sa.block,
                                          a_scale, b, -1 if sb.code is None else sb.code,
                                          sb.block, b_scale, bias, out_dtype)
    return y


def requantized_values(m: int, k: int, n: int, a_on_load: bool, b_on_load: bool) -> int:
    """How many operand values the launch quantizes: each left tile once per program along
    N, each right tile once per program along M (a quantize pass would do ``m*k`` and
    ``k*n``): the arithmetic the saved bytes cost."""
    return (a_on_load * m * k * triton.cdiv(n, BN)) + (b_on_load * k * n * triton.cdiv(m, BM))


__all__ = ["BIASES", "BK", "BM", "BN", "OUT_TYPES", "SOURCE_TYPES", "Side", "qmm",
           "qmm_2d", "qmm_representatives", "qmm_variant", "qmm_variants",
           "requantized_values"]
