"""Triton kernels: block fake quantization (HiF4, MXFP4, NVFP4 with its Four Over Six and
16 x 16 tile variants, MXFP8) and fused ResQ.

The arithmetic is exact and stays in float32 and int32 (a GPU runs float64 at a
fraction of the rate, and a kernel near memory bandwidth has a budget of a few dozen
instructions per value): the values are small integers times powers of two, so
power-of-two scalings are exact, roundings of those work on the bits, a product that
does not fit 24 bits is carried as two floats (TwoProd, one ``tl.fma``), a sum as two
(TwoSum), and every decision that depends on an exact value (a rounding direction, a
level, an E4M3 scale, an E2M1 element of ``x / s``) compares the exact value with a
threshold that is itself exact, so no division is needed where its rounding could
matter. The output is bit-identical to the float64 reference in :mod:`fp4rl.formats`.
Four Over Six's choice compares two squared errors exactly, as an integer sum in units
of the block's grid (int32 limbs). Float32 divisions use ``div_rn``
(Triton's default float32 division is approximate on GPUs).

One program quantizes a tile of ``ROWS`` independent rows by one block of ``BS``
values along the quantization axis. The axis is a stride, so a matrix is quantized
along either of its axes in place, without a transposed copy. On a machine without a
GPU the same kernels run under ``TRITON_INTERPRET=1`` (how the tests check them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from fp4rl.kernels.base import QUANTIZE, KernelFormat, Operation
from fp4rl.kernels.codes import FormatCode

TILE_ELEMENTS = 2048
#: 2^23: (t + 2^23) - 2^23 rounds 0 <= t < 2^23 to nearest even in float32. A
#: ``tl.constexpr``: the compiler refuses a plain Python global inside ``@triton.jit`` (the
#: interpreter allows it).
MAGIC = tl.constexpr(8388608.0)
#: the format codes (:class:`~fp4rl.kernels.codes.FormatCode`) as the kernels compare them
#: (NVFP4 is what none of the others is)
HIF4, MXFP4, MXFP8, NVFP4_4O6, NVFP4_TILES = (
    tl.constexpr(int(c)) for c in (FormatCode.HIF4, FormatCode.MXFP4, FormatCode.MXFP8,
                                   FormatCode.NVFP4_4O6, FormatCode.NVFP4_TILES))
#: the rows of one NVFP4 tile (its block size): a tile's scale is its 16 rows' largest
TILE_ROWS = tl.constexpr(16)
#: Integer arguments that grow with the token count, which Triton must not specialize on
#: (1, multiples of 16): a specialized size would compile a new variant on the first batch
#: of that size, inside a CUDA-graph capture if that is where it first comes.
TOKEN_SIZES = ("n_rows", "length", "snr")
#: the widest n:m group the ResQ kernels rank in: a group of m ranks each value against
#: the other m - 1, so the code (and its compile time, seconds at 16) grows as m^2; wider
#: groups compose quantizer passes on the device instead
MAX_GROUP = 8
#: what the ResQ kernel reads to form its two bf16 terms
RESQ_TERMS_INPUTS = (torch.float32, torch.bfloat16)
#: How every quantize, ResQ and decode kernel is compiled: without contracting a product
#: and a sum into one fused multiply-add. The kernels' exact arithmetic (TwoProd, TwoSum,
#: threshold comparisons) needs each written operation to round as written; where a fused
#: multiply-add is wanted it is written as ``tl.fma``.
COMPILE_OPTIONS = {"enable_fp_fusion": False}
#: CUDA's limit on the programs of a one-dimensional grid
MAX_PROGRAMS = 2**31 - 1


@triton.jit
def pow2(e):
    """2^e as float32 for integer e in [-126, 127] (a normal number, formed from its bits)."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(v):
    """floor(log2 v) of a positive normal float32; -127 for zero and subnormals (every
    caller clamps its exponent at or above -127)."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _round_frac_bits(v, FRAC: tl.constexpr):
    """Round a non-negative normal float32 (or zero) to FRAC fraction bits, ties to even:
    on its bits, so that no arithmetic rounds."""
    DROP: tl.constexpr = 23 - FRAC
    u = v.to(tl.int32, bitcast=True)
    u = u + ((1 << (DROP - 1)) - 1) + ((u >> DROP) & 1)
    return ((u >> DROP) << DROP).to(tl.float32, bitcast=True)


@triton.jit
def _rint(t):
    """Nearest-even integer of float32 0 <= t < 2^23 (exact: the sum rounds once, to an
    integer, and the difference is exact)."""
    return (t + MAGIC) - MAGIC


@triton.jit
def _two_prod(a, b):
    """a * b as p + e exactly (p the rounded product, e its error, by one fused
    multiply-add), for products clear of the subnormal range."""
    p = a * b
    return p, tl.fma(a, b, -p)


@triton.jit
def _two_sum(a, b):
    """a + b as s + e exactly (Knuth's branch-free TwoSum: additions only, which the
    compiler neither reassociates nor fuses)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@triton.jit
def _at_least(p, e, c):
    """Whether the exact value p + e (p = RN(p + e)) is >= the float32 c: RN is
    monotone, so p decides unless p == c, where the sign of e does."""
    return (p > c) | ((p == c) & (e >= 0.0))


@triton.jit
def _below(p, e, c):
    """Whether the exact value p + e (p = RN(p + e)) is < the float32 c."""
    return (p < c) | ((p == c) & (e < 0.0))


@triton.jit
def _floor_half_up(p, e):
    """floor(p + e + 0.5) of the exact value p + e >= 0 (p = RN(p + e), below 2^22). The
    float32 candidate k = floor(RN(p + 0.5)) is never too small (an integer below p + 0.5
    is below its rounding too, and p + e >= n + 1/2 makes p >= n + 1/2), and at most one
    too large, which one exact comparison finds."""
    k = tl.floor(p + 0.5)
    return k - _below(p, e, k - 0.5).to(tl.float32)


@triton.jit
def _floor_plus_noise(p, e, u):
    """floor(p + e + u) exactly: p + e >= 0 exact (p = RN(p + e), below 2^22), u in [0, 1).
    Two TwoSums carry the whole sum as s + d + dl; floor(s) is off by at most one, and
    the comparison of d + dl with the distance from s to each integer is exact."""
    s, es = _two_sum(p, u)
    d, dl = _two_sum(es, e)
    n = tl.floor(s)
    up = _at_least(d, dl, (n + 1.0) - s)  # exact where it can hold: s >= 0.5
    down = _below(d, dl, n - s)  # n - s exact (Sterbenz)
    return n + up.to(tl.float32) - down.to(tl.float32)


@triton.jit
def _round_minifloat(v, noise, MBITS: tl.constexpr, EMIN: tl.constexpr, VMAX: tl.constexpr,
                     HAS_NOISE: tl.constexpr):
    """Minifloat rounding of float32 v >= 0 with MBITS fraction bits and min normal
    exponent EMIN: v / step is exact (a power of two), so is its rounding."""
    e = tl.maximum(_floor_log2(v), EMIN)
    t = v * pow2(MBITS - e)
    if HAS_NOISE:  # noqa: SIM108 (a compile-time branch: one side is compiled)
        q = _floor_plus_noise(t, 0.0, noise)
    else:
        q = _rint(t)
    return tl.minimum(q * pow2(e - MBITS), VMAX)


@triton.jit
def _expand(v, ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """(ROWS, N) -> (ROWS, N * K), each value repeated K times."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (ROWS, N, K)), (ROWS, N * K))


@triton.jit
def _hif4_scale(amax):
    """HiF4's group scale: amax * 73/512 rounded to 8 significant bits, clamped to
    [2^-48, 49152], rounded to 3 (formats.md). The product is exact as p + e, and the
    first rounding reads e only where p lies on a tie."""
    p, e = _two_prod(amax, 0.142578125)
    u = p.to(tl.int32, bitcast=True)
    tie = (u & 0xFFFF) == 0x8000
    cut = (u >> 16) << 16
    s = tl.where(tie & (e > 0.0), cut + 0x10000,
                 tl.where(tie & (e < 0.0), cut, _round_frac_bits(p, 7).to(tl.int32, bitcast=True)))
    s = s.to(tl.float32, bitcast=True)  # below 2^-126 the product's error is not exact,
    s = tl.minimum(tl.maximum(s, 3.552713678800501e-15), 49152.0)  # but the clamp decides
    return _round_frac_bits(s, 2)


@triton.jit
def _hif4_mag(a, noise, ROWS: tl.constexpr, HAS_NOISE: tl.constexpr):
    """|Q(x)| of finite (ROWS, 64) blocks of |x| (formats.md, HiF4), in float32: every
    product of a value and the 8-bit reciprocal is carried exactly (TwoProd), and each
    comparison and rounding reads the exact value."""
    v16 = tl.max(tl.reshape(a, (ROWS, 16, 4)), axis=2)
    v8 = tl.max(tl.reshape(v16, (ROWS, 8, 2)), axis=2)
    s = _hif4_scale(tl.max(v8, axis=1))
    r = _round_frac_bits(tl.math.div_rn(tl.zeros_like(s) + 1.0, s), 7)[:, None]
    p8, e8 = _two_prod(v8, r)
    c8 = _at_least(p8, e8, 4.0).to(tl.float32)
    c8e = _expand(c8, ROWS, 8, 2)
    p16, e16 = _two_prod(v16, r)
    d = c8e + _at_least(p16, e16, 2.0 + 2.0 * c8e).to(tl.float32)
    # x * r * 2^(2 - d), and the output step s * 2^(d - 2): d = 0, 1, 2 levels down
    d4 = _expand(d, ROWS, 16, 4)
    fin = r * tl.where(d4 == 0.0, 4.0, tl.where(d4 == 1.0, 2.0, 1.0))
    fout = s[:, None] * tl.where(d4 == 0.0, 0.25, tl.where(d4 == 1.0, 0.5, 1.0))
    p, e = _two_prod(a, fin)
    if HAS_NOISE:  # noqa: SIM108 (a compile-time branch: one side is compiled)
        q = _floor_plus_noise(p, e, noise)  # stochastic: floor(t + u)
    else:
        q = _floor_half_up(p, e)  # round half away (values are >= 0)
    return tl.minimum(q, 7.0) * fout


@triton.jit
def _mx_mag(a, amax, noise, MBITS: tl.constexpr, EMIN: tl.constexpr, VMAX: tl.constexpr,
            SCALE_OFFSET: tl.constexpr, HAS_NOISE: tl.constexpr):
    """|Q(x)| of finite MX blocks: shared power-of-two scale 2^E, minifloat elements.
    x * 2^-E is exact (or far below the element grid); 2^E is applied in two exact
    halves so that a subnormal result rounds once, as the reference's cast does."""
    e = tl.maximum(_floor_log2(amax) - SCALE_OFFSET, -127)[:, None]
    v = a * pow2(-e)
    q = _round_minifloat(v, noise, MBITS, EMIN, VMAX, HAS_NOISE)
    half = e >> 1
    return (q * pow2(half)) * pow2(e - half)


@triton.jit
def _e4m3_scale(amax, TOP: tl.constexpr):
    """The E4M3 block scale min(amax / TOP, 448) rounded to nearest even, of the exact
    quotient. The float32 quotient rounds to the same E4M3 value: TOP is 4 (exact) or 6,
    and an E4M3 midpoint M has 5 significant bits, so 6M is a float32 and the float32
    amax nearest to it but not it lies an ulp of 6M (at least 4 ulps of M) away; its
    quotient is then at least 2/3 of an ulp of M from M, which the quotient's rounding
    (half an ulp) cannot reach or cross. A midpoint is hit only when it is exact."""
    m = tl.minimum(tl.math.div_rn(amax, tl.zeros_like(amax) + TOP), 448.0)
    em = tl.maximum(_floor_log2(m), -6)
    return _rint(m * pow2(3 - em)) * pow2(em - 3)


@triton.jit
def _e2m1_value(k):
    """E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 of float indices 0-7."""
    return tl.where(k <= 4.0, 0.5 * k, tl.where(k == 7.0, 6.0, k - 2.0))


@triton.jit
def _nvfp4_scaled(a, amax, noise, TOP: tl.constexpr, HAS_NOISE: tl.constexpr):
    """|Q(x)| of finite NVFP4 blocks whose E4M3 scale s maps amax to TOP, without a
    division: the E2M1 rounding of a / s compares a with grid midpoints times s (exact
    products), ties to even; stochastic rounding compares a * 2^(1 - e) + u * s, carried
    exactly, with multiples of s."""
    s = _e4m3_scale(amax, TOP)[:, None]
    if HAS_NOISE:
        e = (a >= 2.0 * s).to(tl.float32) + (a >= 4.0 * s).to(tl.float32)
        ae = a * tl.where(e == 0.0, 2.0, tl.where(e == 1.0, 1.0, 0.5))  # a * 2^(1 - e)
        pu, eu = _two_prod(noise, s)
        w, ew = _two_sum(ae, pu)
        d, dl = _two_sum(ew, eu)
        k = _at_least(d, dl, s - w).to(tl.float32)
        k += _at_least(d, dl, 2.0 * s - w).to(tl.float32)
        k += _at_least(d, dl, 3.0 * s - w).to(tl.float32)
        k += _at_least(d, dl, 4.0 * s - w).to(tl.float32)
        mag = tl.minimum(k * tl.where(e == 0.0, 0.5, tl.where(e == 1.0, 1.0, 2.0)), 6.0)
    else:
        k = (a > 0.25 * s).to(tl.float32) + (a >= 0.75 * s).to(tl.float32)
        k += (a > 1.25 * s).to(tl.float32) + (a >= 1.75 * s).to(tl.float32)
        k += (a > 2.5 * s).to(tl.float32) + (a >= 3.5 * s).to(tl.float32)
        k += (a > 5.0 * s).to(tl.float32)
        mag = _e2m1_value(k)
    return tl.where(s > 0.0, mag * s, 0.0)


@triton.jit
def _nvfp4_mag(a, amax, noise, HAS_NOISE: tl.constexpr):
    """|Q(x)| of finite NVFP4 blocks: E4M3 scale of amax / 6, E2M1 elements."""
    return _nvfp4_scaled(a, amax, noise, 6.0, HAS_NOISE)


#: 2^16: the fraction limbs of :func:`_four_errs_less` (three: 48 bits)
LIMB = tl.constexpr(65536.0)


@triton.jit
def _four_errs_less(a, p4, p6, s6):
    """Whether each (ROWS, 16) block errs less scaled to 4 (``p4``) than to 6 (``p6``),
    exactly, in float32 and int32: :func:`fp4rl.formats.nvfp4.four_errs_less` (which says
    why the difference is an integer sum in units of the grid ``g`` of ``s6``). Here
    ``a / g`` is split into its integer part and three 16-bit fraction limbs, so that
    each limb's sum over the block fits an int32 (|P4 - P6| < 2^9, 16 values)."""
    inv_g = pow2(4 - tl.maximum(_floor_log2(s6), -6))[:, None]  # 1 / g, exact
    big4 = p4 * inv_g  # integers below 2^9
    big6 = p6 * inv_g
    d = big4 - big6
    r = tl.where(d != 0.0, a, 0.0) * inv_g  # below 2^8, 48 fraction bits
    c0 = tl.floor(r)
    r = (r - c0) * LIMB
    c1 = tl.floor(r)
    r = (r - c1) * LIMB
    c2 = tl.floor(r)
    c3 = (r - c2) * LIMB  # an integer: nothing is left below 48 bits
    di = d.to(tl.int32)
    b4 = big4.to(tl.int32)
    b6 = big6.to(tl.int32)
    top = tl.sum(b4 * b4 - b6 * b6 - 2 * di * c0.to(tl.int32), axis=1)
    l1 = tl.sum(-2 * di * c1.to(tl.int32), axis=1)
    l2 = tl.sum(-2 * di * c2.to(tl.int32), axis=1)
    l3 = tl.sum(-2 * di * c3.to(tl.int32), axis=1)
    l2 += l3 >> 16  # carries, floor division (an arithmetic shift)
    l1 += l2 >> 16
    top += l1 >> 16
    return top < 0


@triton.jit
def _nvfp4_4o6_mag(a, amax, noise, HAS_NOISE: tl.constexpr):
    """|Q(x)| of finite NVFP4 blocks under Four Over Six: the block scaled to a largest
    magnitude of 4 where that errs less than 6 (6 on a tie), the same noise for both."""
    q6 = _nvfp4_scaled(a, amax, noise, 6.0, HAS_NOISE)
    q4 = _nvfp4_scaled(a, amax, noise, 4.0, HAS_NOISE)
    four = _four_errs_less(a, q4, q6, _e4m3_scale(amax, 6.0))
    return tl.where(four[:, None], q4, q6)


@triton.jit
def quantize_tile(x, noise, FMT: tl.constexpr, ROWS: tl.constexpr, HAS_NOISE: tl.constexpr):
    """Fake-quantize a (ROWS, block) float32 tile; a block holding NaN/Inf becomes NaN."""
    bits = x.to(tl.int32, bitcast=True)
    a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    top = tl.max(bits & 0x7FFFFFFF, axis=1)  # NaN and Inf sort above every finite value
    if FMT == NVFP4_TILES:  # a tile's 16 rows share its largest (rows start at a tile)
        tiles = tl.max(tl.reshape(top, (ROWS // TILE_ROWS, TILE_ROWS)), axis=1)
        top = tl.reshape(tl.broadcast_to(tiles[:, None], (ROWS // TILE_ROWS, TILE_ROWS)),
                         (ROWS,))
    # a block holding NaN/Inf is replaced below; it is quantized as zeros meanwhile, so
    # that no step computes with NaN or Inf
    bad = top >= 0x7F800000
    a = tl.where(bad[:, None], 0.0, a)
    amax = tl.where(bad, 0, top).to(tl.float32, bitcast=True)
    if FMT == HIF4:
        mag = _hif4_mag(a, noise, ROWS, HAS_NOISE)
    elif FMT == MXFP4:
        mag = _mx_mag(a, amax, noise, 1, 0, 6.0, 2, HAS_NOISE)
    elif FMT == MXFP8:
        mag = _mx_mag(a, amax, noise, 3, -6, 448.0, 8, HAS_NOISE)
    elif FMT == NVFP4_4O6:
        mag = _nvfp4_4o6_mag(a, amax, noise, HAS_NOISE)
    else:  # NVFP4, and its 16 x 16 tiles (whose amax is the tile's)
        mag = _nvfp4_mag(a, amax, noise, HAS_NOISE)
    y = (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    nan = tl.full(y.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(bad[:, None], nan, y)


@triton.jit
def tile(n_rows, length, BS: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows (ROWS, 1) and columns (1, BS), as int64 so that every offset
    product is exact past 2^31 elements, and the mask of those inside the matrix. The
    grid is one-dimensional (CUDA caps its y and z axes at 65,535 programs)."""
    tiles = tl.cdiv(length, BS)
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // tiles) * ROWS + tl.arange(0, ROWS).to(tl.int64)[:, None]
    cols = (pid % tiles) * BS + tl.arange(0, BS).to(tl.int64)[None, :]
    return rows, cols, (rows < n_rows) & (cols < length)


@triton.jit(do_not_specialize=(*TOKEN_SIZES, "sg"))
def _quantize_kernel(x_ptr, y_ptr, noise_ptr, n_rows, length, sxr, sxc, syr, syc, snr, snc,
                     g_ptr, sg, FMT: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
                     HAS_NOISE: tl.constexpr, HAS_SCALE: tl.constexpr,
                     RESCALE: tl.constexpr):
    """Q(x / g) (times g where RESCALE) of a tile; x of any float dtype (widened to
    float32 exactly), y stored in its own dtype (FP4 and FP8 block values are exact in
    bf16; a rescaled value rounds to nearest even there, as a cast of the float32 does).
    g is one value (``sg`` 0) or one per row (``sg`` 1)."""
    rows, cols, inside = tile(n_rows, length, BS, ROWS)
    x = tl.load(x_ptr + rows * sxr + cols * sxc, mask=inside, other=0.0).to(tl.float32)
    g = 1.0
    if HAS_SCALE:  # on the device: no host sync, capturable in a CUDA graph
        g = tl.load(g_ptr + rows * sg, mask=rows < n_rows, other=1.0)
        x = tl.math.div_rn(x, tl.zeros_like(x) + g)
    noise = 0.0
    if HAS_NOISE:
        noise = tl.load(noise_ptr + rows * snr + cols * snc, mask=rows < n_rows,
                        other=0.0).to(tl.float32)
    y = quantize_tile(x, noise, FMT, ROWS, HAS_NOISE)
    if HAS_SCALE and RESCALE:
        y = y * g
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_rne(y)
    tl.store(y_ptr + rows * syr + cols * syc, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=TOKEN_SIZES[:2])
def _quantize_both_kernel(x_ptr, y_ptr, z_ptr, n_rows, length, sxr, sxc, g_ptr,
                          FMT: tl.constexpr, BS: tl.constexpr, HAS_SCALE: tl.constexpr):
    """The block values Q(x / g) of a (BS, BS) tile along its rows into y and along its
    columns into z, from one read of x: a GEMM operand and its backward GEMM's, blocked
    along the two reduction axes (torchao's dim0/dim1 cast, TransformerEngine's cast-
    transpose). Both outputs are laid out as x (row-major, ``length`` a row); the tile's
    rows start at a multiple of BS, so the column blocks are the single-axis kernel's."""
    rows, cols, inside = tile(n_rows, length, BS, BS)
    x = tl.load(x_ptr + rows * sxr + cols * sxc, mask=inside, other=0.0).to(tl.float32)
    if HAS_SCALE:  # one g for the tensor: both axes see the same x / g
        g = tl.load(g_ptr)
        x = tl.math.div_rn(x, tl.zeros_like(x) + g)
    y = quantize_tile(x, 0.0, FMT, BS, False)
    z = tl.trans(quantize_tile(tl.trans(x), 0.0, FMT, BS, False))
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_rne(y)
        z = bf16_rne(z)
    tl.store(y_ptr + rows * length + cols, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(z_ptr + rows * length + cols, z.to(z_ptr.dtype.element_ty), mask=inside)


@triton.jit
def bf16_rne(y):
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32,
    so that the store's conversion is exact whatever rounding it does (Triton's
    interpreter truncates): the bits a torch cast gives. NaN and Inf pass unchanged."""
    bits = y.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded.to(tl.float32, bitcast=True), y)


@triton.jit
def _resq_tile(x, keep, FMT: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
               GROUP: tl.constexpr):
    """``Q(x)`` and ``S(Q(x - Q(x)))`` of a (ROWS, BS) float32 tile, and which positions
    ``S`` keeps: ``keep`` of every GROUP along the rows, the largest magnitudes, an equal
    one at a lower index first (0: dense, every one kept)."""
    q = quantize_tile(x, 0.0, FMT, ROWS, False)
    res = quantize_tile(x - q, 0.0, FMT, ROWS, False)
    kept = tl.full((ROWS, BS), 1, tl.int32) != 0
    if GROUP > 0:
        a = tl.reshape(tl.abs(res), (ROWS, BS // GROUP, GROUP))
        idx = tl.arange(0, GROUP)
        # rank of value i in its group: larger values, plus equal ones at lower index
        beats = (a[:, :, None, :] > a[:, :, :, None]) | (
            (a[:, :, None, :] == a[:, :, :, None]) & (idx[None, :] < idx[:, None])[None, None])
        rank = tl.reshape(tl.sum(beats.to(tl.int32), axis=3), (ROWS, BS))
        kept = rank < keep
        res = tl.where(kept, res, 0.0)
    return q, res, kept


@triton.jit(do_not_specialize=(*TOKEN_SIZES[:2], "keep"))
def _resq_kernel(x_ptr, y_ptr, r_ptr, n_rows, length, keep, FMT: tl.constexpr,
                 BS: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
                 TERMS: tl.constexpr):
    """out = Q(x) + S(Q(x - Q(x))) for one tile; S keeps ``keep`` of every GROUP (0:
    dense). TERMS: the two terms written apart instead, Q(x) to y and S(...) to r (each
    exact in bf16: a bf16 GEMM's two operands), from x of any float dtype."""
    rows, cols, inside = tile(n_rows, length, BS, ROWS)
    x = tl.load(x_ptr + rows * length + cols, mask=inside, other=0.0).to(tl.float32)
    q, res, _ = _resq_tile(x, keep, FMT, BS, ROWS, GROUP)
    if TERMS:
        tl.store(y_ptr + rows * length + cols, q.to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(r_ptr + rows * length + cols, res.to(r_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(y_ptr + rows * length + cols, q + res, mask=inside)


@triton.jit(do_not_specialize=(*TOKEN_SIZES[:2], "keep", "groups"))
def _resq_nm_kernel(x_ptr, y_ptr, r_ptr, m_ptr, n_rows, length, keep, groups,
                    FMT: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
                    GROUP: tl.constexpr):
    """ResQ's two terms with the residual kept as n:m sparse hardware keeps it: Q(x) to y
    (bf16, dense), and of each group of GROUP residual values the ``keep`` kept ones in
    order to r (bf16, ``groups * keep`` a row) and a bit per kept position to m (uint8,
    ``groups`` a row). Positions past ``length`` in a row's last group are zeros; where
    the ranking keeps one, its zero is stored too, so every group holds ``keep`` values.
    In a block holding NaN or Inf (all NaN) the first ``keep`` of each group are kept."""
    rows, cols, inside = tile(n_rows, length, BS, ROWS)
    x = tl.load(x_ptr + rows * length + cols, mask=inside, other=0.0).to(tl.float32)
    q, res, kept = _resq_tile(x, keep, FMT, BS, ROWS, GROUP)
    tl.store(y_ptr + rows * length + cols, q.to(tl.bfloat16), mask=inside)
    k3 = tl.reshape(kept.to(tl.int32), (ROWS, BS // GROUP, GROUP))
    idx = tl.arange(0, GROUP)
    # a kept value's slot: the kept positions before it in its group
    slot = tl.reshape(tl.sum(k3[:, :, None, :] * (idx[None, :] < idx[:, None])[None, None]
                             .to(tl.int32), axis=3), (ROWS, BS))
    # a NaN block's ranks are all 0 (NaN compares false), so every value would be kept:
    # its first `keep` stay, the GEMM's outputs of the row are NaN all the same (so is Q(x))
    kept = kept & (slot < keep)
    k3 = tl.reshape(kept.to(tl.int32), (ROWS, BS // GROUP, GROUP))
    group = cols // GROUP  # (1, BS)
    real = (rows < n_rows) & (group < groups)
    tl.store(r_ptr + rows * groups * keep + group * keep + slot.to(tl.int64),
             res.to(tl.bfloat16), mask=real & kept)
    bits = tl.sum(k3 << idx[None, None, :], axis=2)  # (ROWS, BS // GROUP)
    first = (tl.program_id(0).to(tl.int64) % tl.cdiv(length, BS)) * (BS // GROUP)
    each = first + tl.arange(0, BS // GROUP).to(tl.int64)[None, :]
    tl.store(m_ptr + rows * groups + each, bits.to(tl.uint8),
             mask=(rows < n_rows) & (each < groups))


@triton.jit(do_not_specialize=("n",))
def _amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The largest finite |x| of a contiguous tensor, as float32 bits, into ``out`` (an
    int32 holding 0) by an atomic max: non-negative floats order as their bits do, so the
    max of the bits is the bits of the max, exactly. One read of x, nothing written but
    one word. NaN and Inf (bits at or above 0x7F800000) are left out."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bits = tl.where(bits < 0x7F800000, bits, 0)
    tl.atomic_max(out_ptr, tl.max(bits, axis=0))


#: elements one program of the amax kernel reads
AMAX_BLOCK = 4096


def amax_variant(dtype: torch.dtype) -> Variant:
    """The finite-amax kernel reading ``dtype``."""
    return Variant(_amax_kernel, (dtype, torch.int32), (("BLOCK", AMAX_BLOCK),))


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of ``x`` (0 if none) as a 0-dim float32 tensor on its
    device, in one pass over it and with no host sync."""
    flat = x.contiguous().reshape(-1)
    out = torch.zeros((), dtype=torch.int32, device=x.device)
    programs = triton.cdiv(flat.numel(), AMAX_BLOCK)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"{flat.numel()} values need {programs} programs; reduce in parts")
    amax_variant(flat.dtype).launch((programs,), flat, out, flat.numel())
    return out.view(torch.float32)


@triton.jit(do_not_specialize=TOKEN_SIZES[:2])
def _vector_amax_kernel(x_ptr, out_ptr, c_out_ptr, n_rows, length, sxr, sxc,
                        ROWS: tl.constexpr, BS: tl.constexpr, COLS: tl.constexpr):
    """Each row's largest finite |x| (rows along the strides given: a matrix's rows or its
    columns), as float32 bits, into ``out`` (int32 zeros, one a row) by atomic maxima, as
    :func:`_amax_kernel` does for the whole tensor, and where COLS each column's into
    ``c_out``: one read of x."""
    tiles = tl.cdiv(length, BS)
    pid = tl.program_id(0).to(tl.int64)
    r = (pid // tiles) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = (pid % tiles) * BS + tl.arange(0, BS).to(tl.int64)[None, :]
    inside = (r[:, None] < n_rows) & (cols < length)
    x = tl.load(x_ptr + r[:, None] * sxr + cols * sxc, mask=inside, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bits = tl.where(bits < 0x7F800000, bits, 0)
    tl.atomic_max(out_ptr + r, tl.max(bits, axis=1), mask=r < n_rows)
    if COLS:
        c = (pid % tiles) * BS + tl.arange(0, BS).to(tl.int64)
        tl.atomic_max(c_out_ptr + c, tl.max(bits, axis=0), mask=c < length)


#: rows and columns of one program of the per-vector amax kernel
VECTOR_AMAX_TILE = (16, 256)


def vector_amax_variant(dtype: torch.dtype, cols: bool = False) -> Variant:
    """The per-vector finite-amax kernel reading ``dtype`` (``cols``: the columns' too)."""
    rows, bs = VECTOR_AMAX_TILE
    return Variant(_vector_amax_kernel, (dtype, torch.int32, torch.int32),
                   (("ROWS", rows), ("BS", bs), ("COLS", cols)))


def _vector_amax(x: torch.Tensor, along: int, cols: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows' amax bits (rows across the reduced axis ``along``) and, where ``cols``,
    the other axis's, from one launch."""
    if x.dim() != 2 or x.dtype not in FLOATS:
        raise ValueError("vector_amax takes a float matrix")
    n_rows, length = (x.shape[1], x.shape[0]) if along == 0 else x.shape
    sxr, sxc = (x.stride(1), x.stride(0)) if along == 0 else x.stride()
    out = torch.zeros(n_rows, dtype=torch.int32, device=x.device)
    c_out = torch.zeros(length, dtype=torch.int32, device=x.device) if cols else out
    rows, bs = VECTOR_AMAX_TILE
    programs = triton.cdiv(n_rows, rows) * triton.cdiv(length, bs)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"a ({n_rows}, {length}) matrix needs {programs} programs; reduce "
                         "in parts")
    if programs:
        vector_amax_variant(x.dtype, cols).launch((programs,), x, out, c_out, n_rows, length,
                                                  sxr, sxc)
    return out, (c_out if cols else None)


def vector_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Each vector's largest finite magnitude along ``dim`` of a matrix (0 where none), in
    float32, the reduced axis kept (size 1): ``where(isfinite(x), |x|, 0).amax(dim,
    keepdim=True)`` in one pass over ``x`` read in place, with no host sync."""
    if dim not in (0, 1, -1, -2):
        raise ValueError(f"vector_amax: dim {dim} of a matrix")
    along = dim % 2
    bits, _ = _vector_amax(x, along, False)
    amax = bits.view(torch.float32)
    return amax[None, :] if along == 0 else amax[:, None]


def vector_amax_both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vector_amax(x, -1), vector_amax(x, 0))`` from one read of ``x``."""
    rows, cols = _vector_amax(x, 1, True)
    assert cols is not None
    return rows.view(torch.float32)[:, None], cols.view(torch.float32)[None, :]


def rows_per_program(block: int) -> int:
    return max(1, TILE_ELEMENTS // block)


def _resq_rows(block: int, group: int) -> int:
    """The ResQ kernels' rows per program: half the quantizer's where they rank a group
    (ROWS x block x group comparisons at once): at full height the two-term kernels at the
    widest group spill registers to local memory with Triton 3.9, and the fp32 MX ones at
    2:4 spill with Triton 3.6 (torch 2.11's)."""
    return rows_per_program(block * (2 if group else 1))


#: warps of a ResQ kernel that ranks a group: on 4, the fp32 MX kernels at 2:4 still
#: spilled a few registers at half height with Triton 3.6 (on sm_90); 8 warps hold the
#: same tile without a spill on either Triton (the SASS test checks the newest)
RESQ_RANK_WARPS = 8


def grid_1d(n_rows: int, length: int, block: int, rows: int | None = None) -> tuple[int]:
    """The one-dimensional grid of :func:`tile`: a program per ``rows`` rows (default
    :func:`rows_per_program`'s) and block."""
    per = rows or rows_per_program(block)
    programs = triton.cdiv(n_rows, per) * triton.cdiv(length, block)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"a ({n_rows}, {length}) matrix needs {programs} programs, over "
                         f"CUDA's {MAX_PROGRAMS}; quantize it in parts")
    return (programs,)


def format_fields(fmt: KernelFormat) -> tuple[int, int]:
    """The ``FMT`` code the kernels branch on and the block size, both the format's own."""
    if fmt.kernels is None:
        raise ValueError(f"the Triton kernels have no format {fmt.name!r}")
    return int(fmt.kernels.code), fmt.block_size


FLOATS = (torch.float32, torch.bfloat16, torch.float16)
#: Triton's names of the element types a pointer argument carries
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                 torch.int32: "*i32",
                 torch.uint8: "*u8"}


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel. Triton compiles a kernel once for each distinct set
    of pointer element types and constants (sizes are not specialized on:
    :data:`TOKEN_SIZES`), so the variants a launcher can produce are the binaries a GPU
    compiles; :func:`variants` lists them all, for ahead-of-time compilation."""

    kernel: Any  # the @triton.jit function
    pointers: tuple[torch.dtype, ...]  # each pointer argument's element type, in order
    constants: tuple[tuple[str, int | bool], ...]
    #: warps a program runs on (Triton's default, 4, unless a kernel's tile needs more
    #: registers than 4 warps hold)
    num_warps: int = 4
    #: software-pipelining stages of its loops (None: Triton's default)
    num_stages: int | None = None

    @property
    def options(self) -> dict[str, object]:
        """The compiler options of every launch (:data:`COMPILE_OPTIONS`, the warps, the
        stages where set)."""
        stages = {} if self.num_stages is None else {"num_stages": self.num_stages}
        return {**COMPILE_OPTIONS, "num_warps": self.num_warps, **stages}

    def signature(self) -> dict[str, str]:
        """``triton.compile``'s signature: each argument's type (integers as i32, the type
        an unspecialized size below 2^31 gets)."""
        consts = dict(self.constants)
        types = iter(self.pointers)
        return {name: "constexpr" if name in consts else
                POINTER_TYPES[next(types)] if name.endswith("_ptr") else "i32"
                for name in self.kernel.arg_names}

    def launch(self, grid: tuple[int, ...], *args: object) -> None:
        """Run the kernel; the tensors must be of :attr:`pointers`' types, so that this
        variant describes the launch exactly."""
        got = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        if got != self.pointers:
            raise TypeError(f"{self.kernel.__name__} launched with {got}, declared "
                            f"{self.pointers}")
        self.kernel[grid](*args, **dict(self.constants), **self.options)


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def scale_argument(s: torch.Tensor | None, length: int, device: torch.device
                   ) -> tuple[torch.Tensor, int]:
    """A GEMM kernel's scale argument: its float32 values and its stride along the
    operand's vectors, 0 for one value for all (an absent scale reads as a float32 1.0,
    since ``x * 1.0`` and ``x / 1.0`` are ``x`` bit for bit: one binary serves scaled and
    unscaled operands), 1 for one value per vector (a row of the left operand, a column
    of the right one; of ``length`` vectors). The 1.0 is made once per device, so a
    launch adds no fill kernel of its own and a CUDA graph reads a tensor that outlives
    it (an engine's eager warm-up makes it)."""
    if s is None:
        return _one(device), 0
    flat = s.to(torch.float32).reshape(-1).contiguous()
    if flat.numel() == 1:
        return flat, 0
    if flat.numel() != length:
        raise ValueError(f"a scale of {flat.numel()} values for {length} rows or columns")
    return flat, 1


def _quantize_rows(code: int, block: int) -> int:
    """The quantize kernel's rows per program: half for NVFP4 and its 16 x 16 tiles, whose
    per-tensor scale (and a tile's amax across 16 rows) on top of the blocks spilled
    registers with Triton 3.6 at full height (the SASS test checks)."""
    half = code in (FormatCode.NVFP4, FormatCode.NVFP4_TILES)
    return rows_per_program(block * (2 if half else 1))


def quantize_variant(fmt: KernelFormat, x: torch.dtype, y: torch.dtype, noise: bool,
                     scale: bool, rescale: bool = True) -> Variant:
    """The quantize kernel for ``fmt`` reading ``x`` and writing ``y``; an absent noise or
    scale pointer is passed as ``x`` itself (never read)."""
    code, bs = format_fields(fmt)
    return Variant(_quantize_kernel, (x, y, torch.float32 if noise else x,
                                      torch.float32 if scale else x),
                   (("FMT", code), ("BS", bs), ("ROWS", _quantize_rows(code, bs)),
                    ("HAS_NOISE", noise), ("HAS_SCALE", scale),
                    ("RESCALE", scale and rescale)))


def resq_variant(fmt: KernelFormat, x: torch.dtype, group: int, terms: bool) -> Variant:
    """The ResQ kernel for ``fmt`` and an n:m ``group`` (0: dense): the sum in float32
    from float32 rows, or (``terms``) the two bf16 terms from rows of type ``x``."""
    code, bs = format_fields(fmt)
    out = torch.bfloat16 if terms else torch.float32
    return Variant(_resq_kernel, (x, out, out),
                   (("FMT", code), ("BS", bs), ("ROWS", _resq_rows(bs, group)),
                    ("GROUP", group), ("TERMS", terms)),
                   num_warps=RESQ_RANK_WARPS if group else 4)


def resq_nm_variant(fmt: KernelFormat, x: torch.dtype, group: int) -> Variant:
    """The ResQ kernel that keeps the residual as n:m sparse values and bits, for ``fmt``,
    rows of type ``x`` and an n:m ``group`` (> 0)."""
    code, bs = format_fields(fmt)
    return Variant(_resq_nm_kernel, (x, torch.bfloat16, torch.bfloat16, torch.uint8),
                   (("FMT", code), ("BS", bs), ("ROWS", _resq_nm_rows(bs, group)),
                    ("GROUP", group)), num_warps=RESQ_RANK_WARPS)


def _resq_nm_rows(block: int, group: int) -> int:
    """The n:m ResQ kernel's rows per program: half the two-term kernel's (its slots and
    bits on top of the ranking spilled registers on sm_90 for HiF4 at 1:2 from bf16)."""
    return max(1, _resq_rows(block, group) // 2)


def resq_groups(fmt: KernelFormat) -> list[int]:
    """Every n:m group the ResQ kernels take for ``fmt`` (0: dense)."""
    return [g for g in range(fmt.block_size + 1) if fuses_resq(fmt, g)]


#: the types a GEMM operand's values are written in by the quantizer (``out_dtype``)
OPERAND_TYPES = (torch.float32, torch.bfloat16)
#: (input, output) types the two-axis quantizer takes: a float32 master or gradient into
#: float32 (``mixed_precision: no``) or into the bf16 GEMM operand, bf16 into bf16
BOTH_TYPES = ((torch.float32, torch.float32), (torch.float32, torch.bfloat16),
              (torch.bfloat16, torch.bfloat16))
#: warps of the two-axis quantizer: its (BS, BS) tile quantized twice (HiF4: 4,096 values)
#: spills registers on 4
BOTH_WARPS = 8


def both_variant(fmt: KernelFormat, x: torch.dtype, y: torch.dtype, scale: bool) -> Variant:
    """The two-axis quantizer for ``fmt`` reading ``x`` and writing ``y`` (both outputs);
    an absent scale pointer is passed as ``x``."""
    code, bs = format_fields(fmt)
    return Variant(_quantize_both_kernel, (x, y, y, torch.float32 if scale else x),
                   (("FMT", code), ("BS", bs), ("HAS_SCALE", scale)), num_warps=BOTH_WARPS)


def quantize_both(fmt: KernelFormat, x: torch.Tensor, tensor_scale: torch.Tensor | None,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The block values of a matrix along its rows and along its columns, each ``x``'s
    shape in ``out_dtype``, from one read of ``x``, ``tensor_scale`` (one value) read
    and kept outside; None for a type pair the kernel does not take."""
    if x.dim() != 2 or (x.dtype, out_dtype) not in BOTH_TYPES:
        return None
    _, bs = format_fields(fmt)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    z = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    g = x if tensor_scale is None else tensor_scale.to(torch.float32).reshape(-1)
    if tensor_scale is not None and g.numel() != 1:
        raise ValueError(f"the two-axis quantizer takes one tensor scale, got {g.numel()}")
    both_variant(fmt, x.dtype, out_dtype, tensor_scale is not None).launch(
        grid_1d(x.shape[0], x.shape[1], bs, bs), x, y, z, x.shape[0], x.shape[1],
        x.stride(0), x.stride(1), g)
    return y, z


def quantize_variants(fmt: KernelFormat) -> Iterator[Variant]:
    """What :func:`quantize_2d`, :func:`fused_resq` and :func:`resq_terms` can launch for
    ``fmt``, by the operations the format declares for Triton."""
    ops = fmt.kernels.triton if fmt.kernels is not None else frozenset()
    scales = (False, True) if fmt.kernels is not None and fmt.has_tensor_scale else (False,)
    if ops & QUANTIZE:
        for dtype in FLOATS:
            for noise in (False, True):
                for scale in scales:
                    yield quantize_variant(fmt, dtype, dtype, noise, scale)
    if ops & QUANTIZE:  # a GEMM operand written in the GEMM's dtype, its scale kept outside
        for dtype in FLOATS:  # (quantize_operand's out_dtype)
            for out in OPERAND_TYPES:
                for scale in scales:
                    yield quantize_variant(fmt, dtype, out, False, scale, False)
    if Operation.ROWS_BF16 in ops:
        for scale in scales:
            yield quantize_variant(fmt, torch.bfloat16, torch.bfloat16, False, scale, False)
    for group in resq_groups(fmt) if Operation.RESQ in ops else ():
        yield resq_variant(fmt, torch.float32, group, False)
    for group in resq_groups(fmt) if Operation.RESQ_TERMS in ops else ():
        for dtype in RESQ_TERMS_INPUTS:
            yield resq_variant(fmt, dtype, group, True)
            if group:
                yield resq_nm_variant(fmt, dtype, group)
    if Operation.BOTH in ops:
        for x, y in BOTH_TYPES:
            for scale in scales:
                yield both_variant(fmt, x, y, scale)


def quantize_2d(fmt: KernelFormat, x: torch.Tensor, axis: int, noise: torch.Tensor | None = None,
                tensor_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                rescale: bool = True) -> torch.Tensor:
    """Fake-quantize a float matrix (float32, bf16 or fp16, read as it is) along ``axis``
    (0 or 1), blocks along that axis, into ``out_dtype`` (default ``x``'s).

    ``noise`` holds the stochastic-rounding draws laid out as rows along the axis:
    shape (other dim, padded length), as :class:`fp4rl.formats.base.BlockFormat` draws them.
    ``tensor_scale`` g, a float32 tensor on ``x``'s device of one value or of one per
    row along the axis (a vector's scale: ``(R, 1)`` for axis 1, ``(1, C)`` for axis 0),
    quantizes ``x / g`` and multiplies the result by g (NVFP4; ``rescale=False``: the block
    values alone, exact in bf16, as a GEMM operand keeps g outside); the kernel reads it
    there.
    """
    if x.dim() != 2 or x.dtype not in FLOATS or axis not in (0, 1):
        raise ValueError("quantize_2d takes a float matrix and axis 0 or 1")
    _, bs = format_fields(fmt)
    if not (x.is_contiguous() or x.t().is_contiguous()):
        x = x.contiguous()
    y = torch.empty_like(x, dtype=out_dtype or x.dtype)  # same strides as x
    sxr, sxc = (x.stride(1), x.stride(0)) if axis == 0 else x.stride()
    syr, syc = (y.stride(1), y.stride(0)) if axis == 0 else y.stride()
    n_rows, length = (x.shape[1], x.shape[0]) if axis == 0 else x.shape
    snr, snc = noise.stride() if noise is not None else (0, 0)
    g = x if tensor_scale is None else tensor_scale.to(torch.float32).reshape(-1).contiguous()
    if g.numel() not in (1, n_rows) and tensor_scale is not None:
        raise ValueError(f"a scale of {g.numel()} values for {n_rows} rows")
    variant = quantize_variant(fmt, x.dtype, y.dtype, noise is not None,
                               tensor_scale is not None, rescale)
    variant.launch(grid_1d(n_rows, length, bs, dict(variant.constants)["ROWS"]), x, y,
                   noise if noise is not None else x,
                   n_rows, length, sxr, sxc, syr, syc, snr, snc, g,
                   int(tensor_scale is not None and g.numel() > 1))
    return y


def fused_resq(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int) -> torch.Tensor | None:
    """Fused ``Q(x) + S_{keep:group}(Q(x - Q(x)))`` over contiguous float32 rows.

    None where the kernel does not apply: NVFP4 (its per-tensor scale needs a first pass
    over the whole tensor) or a group that is not a power of two dividing the block.
    """
    if not fuses_resq(fmt, group):
        return None
    rows = rows.contiguous()
    out = torch.empty_like(rows)
    resq_variant(fmt, rows.dtype, group, False).launch(
        grid_1d(rows.shape[0], rows.shape[1], fmt.block_size,
                _resq_rows(fmt.block_size, group)), rows, out, out, rows.shape[0],
        rows.shape[1], keep)
    return out


def fuses_resq(fmt: KernelFormat, group: int) -> bool:
    """Whether the ResQ kernels take ``fmt`` and an n:m ``group`` (0: dense): not a
    format with a per-tensor scale (NVFP4: the residual's scale needs a pass over the
    whole residual first; its ResQ composes quantizer passes, all on the device), and a
    group that is a power of two dividing the block, at most :data:`MAX_GROUP`."""
    _, bs = format_fields(fmt)
    return not fmt.has_tensor_scale and (
        group == 0 or (1 < group <= MAX_GROUP and not group & (group - 1) and not bs % group))


def resq_terms(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int
               ) -> torch.Tensor | None:
    """ResQ's two bf16 GEMM operands ``Q(x)`` and ``S_{keep:group}(Q(x - Q(x)))`` of float32
    or bf16 rows in one pass, stacked in one (2 * rows, len) bf16 tensor, ``Q(x)`` first (each
    written once); None where :func:`fuses_resq` does not hold."""
    if not fuses_resq(fmt, group) or rows.dtype not in RESQ_TERMS_INPUTS:
        return None
    rows = rows.contiguous()
    n = rows.shape[0]
    out = torch.empty(2 * n, rows.shape[1], dtype=torch.bfloat16, device=rows.device)
    resq_variant(fmt, rows.dtype, group, True).launch(
        grid_1d(n, rows.shape[1], fmt.block_size, _resq_rows(fmt.block_size, group)), rows,
        out, out[n:], n, rows.shape[1], keep)
    return out


def resq_terms_nm(fmt: KernelFormat, rows: torch.Tensor, keep: int, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """ResQ's two GEMM operands of float32 or bf16 rows in one pass, the residual kept as n:m
    sparse hardware keeps it: ``Q(x)`` (bf16, the rows' shape), the residual's kept values
    (bf16, ``keep`` of each ``group`` along a row, in order: ``(rows, ceil(len / group) *
    keep)``) and its bits (uint8, bit j of a group's byte set where position j is kept:
    ``(rows, ceil(len / group))``). At 2:4 the residual's bytes are 0.625x a dense bf16
    one's. None where :func:`fuses_resq` does not hold or ``group`` is 0 (dense)."""
    if not group or not fuses_resq(fmt, group) or rows.dtype not in RESQ_TERMS_INPUTS:
        return None
    rows = rows.contiguous()
    n, length = rows.shape
    groups = -(-length // group)
    q = torch.empty(n, length, dtype=torch.bfloat16, device=rows.device)
    kept = torch.empty(n, groups * keep, dtype=torch.bfloat16, device=rows.device)
    bits = torch.empty(n, groups, dtype=torch.uint8, device=rows.device)
    resq_nm_variant(fmt, rows.dtype, group).launch(
        grid_1d(n, length, fmt.block_size, _resq_nm_rows(fmt.block_size, group)), rows, q, kept,
        bits, n, length, keep, groups)
    return q, kept, bits
