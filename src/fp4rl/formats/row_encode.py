"""Fast encoding of 2-D weights into the formats' packed codes and scales.

The reference encoders run every element through float64 rounding in Python-level torch
ops, about half a second per million values: too slow to pack a model's weights for every
refit. Here the elements come from the fused quantizer instead (``Q(x)``, bit for bit the
reference's values), and only the scales are computed the reference's way, from the
maxima of the blocks (HiF4: of its groups of 4), a sixteenth of the data or less. Each
element code is then ``|Q(x)|`` divided by its group's scale: an exact quotient, since
``Q(x)`` is that code's value times that scale; the codes are packed in uint8 arithmetic.
The buffers are the reference encoder's,
byte for byte (tests compare them); formats or inputs outside this path return None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp4rl.formats import get_format
from fp4rl.formats._exact import pow2
from fp4rl.formats.base import BlockFormat
from fp4rl.formats.hif4 import QUARTERS
from fp4rl.formats.mxfp4 import shared_exponent
from fp4rl.formats.nvfp4 import E4M3_MAX, e4m3_round
from fp4rl.formats.packing import PackedTensor
from fp4rl.kernels import quantize_rows

#: the scale fields of ``(N, block)`` blocks (zeroed where non-finite), and each
#: element's scale as float32 ``(N, groups, 1)`` (HiF4: 16 groups of 4; else 1 group)
Scales = Callable[[BlockFormat, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _hif4(fmt: BlockFormat, blocks: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                          torch.Tensor]:
    v16 = blocks.abs().unflatten(-1, (16, 4)).amax(-1).double()
    s, _, d8, d16 = fmt.hierarchy(v16)  # type: ignore[attr-defined]
    factor = QUARTERS[d8.repeat_interleave(2, -1) + d16] * s.float()  # 2^(d - 2) * s
    return {"scale": s, "d8": d8, "d16": d16}, factor.unsqueeze(-1)


def _mxfp4(fmt: BlockFormat, blocks: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                           torch.Tensor]:
    e = shared_exponent(blocks.abs().amax(-1, keepdim=True).double(),
                        fmt.scale_offset)  # type: ignore[attr-defined]
    return {"exponent": e}, pow2(e).float().unsqueeze(-1)


def _nvfp4(fmt: BlockFormat, blocks: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                           torch.Tensor]:
    amax = blocks.abs().amax(-1, keepdim=True).double()
    s = e4m3_round(torch.clamp(amax / 6.0, max=E4M3_MAX))
    return {"scale": s}, s.float().unsqueeze(-1)


_SCALES: dict[str, Scales] = {"hif4": _hif4, "mxfp4": _mxfp4, "nvfp4": _nvfp4}


def _magnitude_codes(fmt_name: str, m: torch.Tensor) -> torch.Tensor:
    """3-bit codes of element magnitudes ``m`` (float32): HiF4's are the integers 0-7
    themselves; E2M1's 0, .5, 1, 1.5, 2, 3, 4, 6 are its grid indices 0-7."""
    if fmt_name != "hif4":
        m = torch.where(m <= 2, 2 * m, torch.where(m <= 4, m + 2, 7.0))
    return m.round_().to(torch.uint8)


def _element_codes(fmt_name: str, blocks: torch.Tensor, q: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes: ``|q| / scale`` (exact) with the sign of ``blocks`` in bit 3,
    two per byte, the low nibble first."""
    shaped = q.abs().view(q.shape[0], scale.shape[1], -1)
    m = shaped / torch.where(scale > 0, scale, 1.0)  # a zero scale's block is all zeros
    codes = _magnitude_codes(fmt_name, m.view(q.shape))
    codes |= torch.signbit(blocks).to(torch.uint8) << 3
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def encode_rows(fmt_name: str, rows: torch.Tensor) -> PackedTensor | None:
    """``get_format(fmt_name).encode(rows, dim=-1)`` of 2-D float32 ``rows`` (NVFP4:
    without a per-tensor scale, which the caller divides out), byte for byte; None where
    this path does not apply."""
    fmt = get_format(fmt_name)
    scales_of = _SCALES.get(fmt.name)
    if scales_of is None or rows.dim() != 2 or rows.dtype != torch.float32 or \
            fmt_name != fmt.name:
        return None
    rows = rows.contiguous()
    q = quantize_rows(fmt.name, rows, None)
    if q is None:
        return None
    shape, length, bs = tuple(rows.shape), rows.shape[1], fmt.block_size
    pad = -length % bs
    if pad:
        rows, q = (torch.nn.functional.pad(t, (0, pad)) for t in (rows, q))
    blocks, qb = rows.reshape(-1, bs), q.reshape(-1, bs)
    nan = ~torch.isfinite(blocks.abs().amax(-1, keepdim=True))  # NaN and Inf reach the max
    if blocks.device.type != "cpu" or bool(nan.any()):  # asking costs a host sync elsewhere
        blocks, qb = torch.where(nan, 0.0, blocks), torch.where(nan, 0.0, qb)
    fields, scale = scales_of(fmt, blocks)
    empty = blocks[:, :0]  # the elements are packed below; the format packs its scales
    element_fields = {"m4": empty.long(), "neg": empty.bool()} if fmt.name == "hif4" else \
        {"q": empty.double(), "neg": empty.bool()}
    buffers = fmt.pack({**fields, **element_fields}, nan.squeeze(-1))
    buffers["codes"] = _element_codes(fmt.name, blocks, qb, scale)
    return PackedTensor(fmt.name, shape, 1, rows.dtype, buffers, None, {"length": length})


__all__ = ["encode_rows"]
