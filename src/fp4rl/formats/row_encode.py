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

import torch

from fp4rl.formats.base import BlockFormat
from fp4rl.formats.packing import PackedTensor
from fp4rl.formats.registry import get_format
from fp4rl.kernels import quantize_rows


def _element_codes(fmt: BlockFormat, blocks: torch.Tensor, q: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes: ``|q| / scale`` (exact) with the sign of ``blocks`` in bit 3,
    two per byte, the low nibble first."""
    shaped = q.abs().view(q.shape[0], scale.shape[1], -1)
    m = shaped / torch.where(scale > 0, scale, 1.0)  # a zero scale's block is all zeros
    codes = fmt.magnitude_codes(m.view(q.shape))
    codes |= torch.signbit(blocks).to(torch.uint8) << 3
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def encode_rows(fmt_name: str, rows: torch.Tensor) -> PackedTensor | None:
    """``get_format(fmt_name).encode(rows, dim=-1)`` of 2-D float32 ``rows`` (NVFP4:
    without a per-tensor scale, which the caller divides out), byte for byte; None where
    this path does not apply (a format without :meth:`BlockFormat.block_scales`, or no
    quantizer kernel on the rows' device)."""
    fmt = get_format(fmt_name)
    if not isinstance(fmt, BlockFormat) or rows.dim() != 2 or rows.dtype != torch.float32 or \
            fmt_name != fmt.name:
        return None
    rows = rows.contiguous()
    shape, length, bs = tuple(rows.shape), rows.shape[1], fmt.block_size
    pad = -length % bs
    padded = torch.nn.functional.pad(rows, (0, pad)) if pad else rows
    blocks = padded.reshape(-1, bs)
    nan = ~torch.isfinite(blocks.abs().amax(-1, keepdim=True))  # NaN and Inf reach the max
    finite = blocks.device.type != "cpu" or bool(nan.any())  # asking costs a host sync elsewhere
    if finite:
        blocks = torch.where(nan, 0.0, blocks)
    scales = fmt.block_scales(blocks)
    if scales is None:
        return None
    q = quantize_rows(fmt, rows, None)
    if q is None:
        return None
    qb = (torch.nn.functional.pad(q, (0, pad)) if pad else q).reshape(-1, bs)
    if finite:
        qb = torch.where(nan, 0.0, qb)
    fields, scale = scales
    buffers = fmt.pack(fields, nan.squeeze(-1))  # the scales; the elements are packed here
    buffers["codes"] = _element_codes(fmt, blocks, qb, scale)
    return PackedTensor(fmt.name, shape, 1, rows.dtype, buffers, None, {"length": length})


__all__ = ["encode_rows"]
