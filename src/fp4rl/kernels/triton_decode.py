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

from fp4rl.kernels import KernelFormat
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


@triton.jit(do_not_specialize=("n_rows",))  # a weight of one row: no binary of its own
def _decode_kernel(codes_ptr, scale_ptr, l2_ptr, l3_ptr, y_ptr, n_rows, length, blocks,
                   FMT: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    rows, cols, inside = tile(n_rows, length, BS, ROWS)
    block = cols // BS  # (1, BS), one block: the tile's
    within = cols % BS
    live = rows < n_rows
    byte = tl.load(codes_ptr + rows * (blocks * BS // 2) + cols // 2, mask=live,
                   other=0).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)) & 0xF
    neg = code >= 8
    s = tl.load(scale_ptr + rows * blocks + block, mask=live, other=0).to(tl.int32)
    if FMT == 0:  # HiF4: m4 * 2^(d8 + d16 - 2) * E6M2 scale
        l2 = tl.load(l2_ptr + rows * blocks + block, mask=live, other=0).to(tl.int32)
        quad = within // 4
        l3 = tl.load(l3_ptr + rows * (blocks * 2) + block * 2 + quad // 8, mask=live,
                     other=0).to(tl.int32)
        d = ((l2 >> (within // 8)) & 1) + ((l3 >> (quad % 8)) & 1)
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
    value = tl.where(nan, quiet, value)
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
    if fmt.kernels is not None and "decode" in fmt.kernels.triton:
        for dtype in DECODED:
            yield decode_variant(fmt, dtype)


def decode_2d(fmt: KernelFormat, fields: dict[str, torch.Tensor], rows: int, length: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The ``(rows, length)`` values of a weight packed along its rows, in ``dtype``
    (float32, or bf16, which holds every value exactly); None for formats this kernel
    does not decode."""
    code, bs = format_fields(fmt)
    assert fmt.kernels is not None
    if "decode" not in fmt.kernels.triton:
        return None
    blocks = -(-length // bs)
    flat = {k: v.contiguous() for k, v in fields.items()}
    codes, scale = flat["codes"], flat["scale"]
    l2, l3 = (flat["level2"], flat["level3"]) if code == FormatCode.HIF4 else (scale, scale)
    y = torch.empty(rows, length, dtype=dtype, device=codes.device)
    decode_variant(fmt, dtype).launch(grid_1d(rows, length, bs), codes, scale, l2, l3, y,
                                      rows, length, blocks)
    return y


__all__ = ["DECODED", "decode_2d", "decode_variant", "decode_variants"]
