"""Triton kernel: packed 4-bit weights (HiF4, MXFP4, NVFP4) back to their values.

A serving engine that keeps ``Q(W)`` as the format's codes and scales decodes them on
every forward; on a GPU that must be one pass over the codes, not the reference decoder's
float64 tensors. Each value is formed from its bit fields in float32, where every
product of an element and its scale(s) is exact (a few significant bits each; MXFP4's
2^E is applied in two halves so that a subnormal value rounds once), so the output is
the reference's float64 value rounded to float32, bit for bit (tests compare them under
``TRITON_INTERPRET=1``), with no float64 instruction. The fields are laid out as
:meth:`fp4rl.gemm.PackedOperand.row_fields` gives them: per row, the blocks' bytes in
order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from fp4rl.kernels.base import KernelFormat, Operation
from fp4rl.kernels.codes import FormatCode
from fp4rl.kernels.triton_quant import Variant, format_fields, grid_1d, pow2, rows_per_program, tile


@triton.jit
def _e2m1(i):
    """E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 of 3-bit indices, as float32."""
    f = i.to(tl.float32)
    return tl.where(i < 4, 0.5 * f, tl.where(i < 6, f - 2.0, 2.0 * f - 8.0))


@triton.jit
def _e4m3(b):
    """float32 value of E4M3 (fn) bytes (the NaN codes are masked by the caller)."""
    e = (b >> 3) & 0xF
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * pow2(e - 10))  # 2^-9 subnormals
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _value(code, s, l2, l3, within, FMT: tl.constexpr):
    """A value from its 4-bit ``code`` and its block's fields (int32: the scale byte ``s``,
    HiF4's level-2 byte ``l2`` and the level-3 byte ``l3`` of its 32 values), ``within``
    its index in the block; the one formula every decode path uses."""
    neg = code >= 8
    if FMT == 0:  # HiF4: m4 * 2^(d8 + d16 - 2) * E6M2 scale
        d = ((l2 >> (within // 8)) & 1) + ((l3 >> ((within // 4) % 8)) & 1)
        scale = (4.0 + (s & 3).to(tl.float32)) * pow2((s >> 2) - 50)
        mag = (code & 7).to(tl.float32) * pow2(d - 2) * scale
        nan = s == 0xFF
    elif FMT == 1:  # MXFP4: E2M1 * 2^(e - 127)
        e = s - 127
        half = e >> 1  # 2^e in two normal halves: 2^-127 itself is subnormal
        mag = (_e2m1(code & 7) * pow2(half)) * pow2(e - half)
        nan = s == 0xFF
    else:  # NVFP4: E2M1 * E4M3 block scale (the per-tensor scale stays outside)
        nan = (s & 0x7F) == 0x7F
        mag = _e2m1(code & 7) * _e4m3(tl.where(nan, 0, s))
    value = tl.where(neg, -mag, mag)
    quiet = tl.full(value.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(nan, quiet, value)


@triton.jit
def decode_values(codes_ptr, scale_ptr, l2_ptr, l3_ptr, rows, cols, live, blocks,
                  FMT: tl.constexpr, BS: tl.constexpr):
    """float32 values of a weight packed along its rows at ``rows`` x ``cols`` (int64
    index tensors that broadcast; ``live`` masks the reads), ``blocks`` blocks a row:
    every field read per value (any tile shape)."""
    block = cols // BS
    within = cols % BS
    byte = tl.load(codes_ptr + rows * (blocks * BS // 2) + cols // 2, mask=live,
                   other=0).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)) & 0xF
    s = tl.load(scale_ptr + rows * blocks + block, mask=live, other=0).to(tl.int32)
    l2 = s
    l3 = s
    if FMT == 0:
        l2 = tl.load(l2_ptr + rows * blocks + block, mask=live, other=0).to(tl.int32)
        l3 = tl.load(l3_ptr + rows * (blocks * 2) + block * 2 + within // 32, mask=live,
                     other=0).to(tl.int32)
    return _value(code, s, l2, l3, within, FMT)


@triton.jit
def _per_group(ptr, rows, live, per_row, first, G: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    """The bytes of a field holding one byte per ``G`` values (``per_row`` a row), for a
    tile of ``BK`` values from the row's group ``first``: each read once, as (BN, BK)."""
    NG: tl.constexpr = BK // G if BK >= G else 1
    group = first + tl.arange(0, NG).to(tl.int64)[None, :]
    b = tl.load(ptr + rows * per_row + group, mask=live & (group < per_row),
                other=0).to(tl.int32)  # (BN, NG)
    return tl.reshape(tl.broadcast_to(b[:, :, None], (BN, NG, BK // NG)), (BN, BK))


@triton.jit
def decode_tile(codes_ptr, scale_ptr, l2_ptr, l3_ptr, rows, live, k0, blocks,
                FMT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """float32 values of the ``(BN, BK)`` tile at ``rows`` (int64, (BN, 1)) and columns
    ``k0 .. k0 + BK`` of a weight packed along its rows: each byte read once (a code byte
    holds two values, a scale byte a block), which keeps a GEMM's decode in registers.
    ``k0`` a multiple of ``BK``, ``BK`` a power of two; the values past a row's last block
    are garbage for the caller to mask."""
    half: tl.constexpr = BK // 2
    j = k0 // 2 + tl.arange(0, half).to(tl.int64)[None, :]
    per_row = blocks * BS // 2
    byte = tl.load(codes_ptr + rows * per_row + j, mask=live & (j < per_row),
                   other=0).to(tl.int32)  # (BN, BK / 2)
    code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BN, BK))  # low nibble first
    s = _per_group(scale_ptr, rows, live, blocks, k0 // BS, BS, BN, BK)
    l2 = s
    l3 = s
    if FMT == 0:
        l2 = _per_group(l2_ptr, rows, live, blocks, k0 // BS, BS, BN, BK)
        l3 = _per_group(l3_ptr, rows, live, blocks * 2, k0 // 32, 32, BN, BK)
    within = (k0 + tl.arange(0, BK)[None, :]) % BS
    return _value(code, s, l2, l3, within, FMT)


@triton.jit(do_not_specialize=("n_rows",))  # a weight of one row: no binary of its own
def _decode_kernel(codes_ptr, scale_ptr, l2_ptr, l3_ptr, y_ptr, n_rows, length, blocks,
                   FMT: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    rows, cols, inside = tile(n_rows, length, BS, ROWS)
    value = decode_values(codes_ptr, scale_ptr, l2_ptr, l3_ptr, rows, cols, rows < n_rows,
                          blocks, FMT, BS)
    tl.store(y_ptr + rows * length + cols, value.to(y_ptr.dtype.element_ty),
             mask=inside)


#: the value types a decode writes: float32, or bf16, which holds every value exactly
DECODED = (torch.float32, torch.bfloat16)


def decode_variant(fmt: KernelFormat, dtype: torch.dtype) -> Variant:
    """The decode kernel for ``fmt`` writing ``dtype``; the fields are bytes (a format
    without HiF4's two levels passes its scale in their place)."""
    code, bs = format_fields(fmt)
    return Variant(_decode_kernel, (torch.uint8,) * 4 + (dtype,),
                   (("FMT", code), ("BS", bs), ("ROWS", rows_per_program(bs))))


def decode_variants(fmt: KernelFormat) -> Iterator[Variant]:
    """What :func:`decode_2d` can launch for ``fmt``."""
    if fmt.kernels is not None and Operation.DECODE in fmt.kernels.triton:
        for dtype in DECODED:
            yield decode_variant(fmt, dtype)


def decode_2d(fmt: KernelFormat, fields: dict[str, torch.Tensor], rows: int, length: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The ``(rows, length)`` values of a weight packed along its rows, in ``dtype``
    (float32, or bf16, which holds every value exactly); None for formats this kernel
    does not decode."""
    code, bs = format_fields(fmt)
    assert fmt.kernels is not None
    if Operation.DECODE not in fmt.kernels.triton:
        return None
    blocks = -(-length // bs)
    flat = {k: v.contiguous() for k, v in fields.items()}
    codes, scale = flat["codes"], flat["scale"]
    l2, l3 = (flat["level2"], flat["level3"]) if code == FormatCode.HIF4 else (scale, scale)
    y = torch.empty(rows, length, dtype=dtype, device=codes.device)
    decode_variant(fmt, dtype).launch(grid_1d(rows, length, bs), codes, scale, l2, l3, y,
                                      rows, length, blocks)
    return y


__all__ = ["DECODED", "decode_2d", "decode_tile", "decode_values", "decode_variant",
           "decode_variants"]
