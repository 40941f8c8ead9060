"""HiF4 (HiFloat4): 64-value groups with three scaling levels.

Per group: an E6M2 level-1 scale, eight 1-bit level-2 exponents (one per octet),
sixteen 1-bit level-3 exponents (one per quad) and 64 S1P2 elements, 288 bits.
The two extra octaves let small values beside an outlier survive where a single
power-of-two block scale would flush them to zero.
"""

from __future__ import annotations

import torch

from fp4rl.formats._exact import bf16_round, floor_log2, pow2, round_minifloat
from fp4rl.formats.base import BlockFormat
from fp4rl.formats.packing import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles
from fp4rl.formats.tables import DeviceTable, signed_table
from fp4rl.kernels import QUANTIZE_AND_RESQ, FormatKernels, Operation
from fp4rl.kernels.codes import FormatCode

C = 0.142578125  # bf16(1/7)
SCALE_MIN, SCALE_MAX = 2.0**-48, 49152.0  # E6M2 range; 1.75 * 2**15 is the NaN code
NAN_CODE = 0xFF


def _scale_values(code: torch.Tensor) -> torch.Tensor:
    """float64 value of E6M2 scale codes (int64): ``(4 + m) * 2^(e - 50)``."""
    return (4 + (code & 3)).to(torch.float64) * pow2((code >> 2) - 50)


#: float32 value of each E6M2 scale byte (the NaN code: NaN)
SCALES = DeviceTable(lambda: torch.where(torch.arange(256) == NAN_CODE, torch.nan,
                                         _scale_values(torch.arange(256))).float())
#: float32 values of the signed 4-bit S1P2 element codes (m4 in 0-7, sign in bit 3)
ELEMENTS = signed_table((0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0))
#: 2^(d - 2) of an element's level-2 + level-3 exponent bits d in 0-2
QUARTERS = DeviceTable(lambda: torch.tensor([0.25, 0.5, 1.0]))


class HiF4(BlockFormat):
    name = "hif4"
    label = "HiF4"
    block_size = 64
    bits_per_value = 4.5
    #: the C kernel runs every block pass; Triton also decodes packed weights
    #: and multiplies by them
    kernels = FormatKernels(FormatCode.HIF4, c=QUANTIZE_AND_RESQ | {Operation.ROWS_BF16,
                                                                   Operation.BOTH},
                            triton=QUANTIZE_AND_RESQ | {Operation.ROWS_BF16, Operation.DECODE,
                                                        Operation.PACKED_MM, Operation.BOTH,
                                                        Operation.QMM})

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        a = blocks.abs()
        s, r, d8, d16 = self.hierarchy(a.unflatten(-1, (16, 4)).amax(-1))
        d = d8.repeat_interleave(8, -1) + d16.repeat_interleave(4, -1)
        t = a * r * pow2(2 - d)
        m4 = torch.floor(t + (0.5 if noise is None else noise))
        m4 = torch.where(m4 >= 8, 7.0, m4).to(torch.int64)
        return {"scale": s, "d8": d8, "d16": d16, "m4": m4, "neg": torch.signbit(blocks)}

    @staticmethod
    def hierarchy(v16: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The block's scales from the largest magnitude of each group of 4 (``(N, 16)``
        float64): the E6M2 scale ``s``, its bf16 reciprocal ``r`` and the level-2 and
        level-3 exponent bits ``d8`` ``(N, 8)`` and ``d16`` ``(N, 16)``."""
        v8 = v16.unflatten(-1, (8, 2)).amax(-1)
        vmax = v8.amax(-1, keepdim=True)
        s = bf16_round(vmax * C).clamp(SCALE_MIN, SCALE_MAX)
        s = round_minifloat(s, 2)
        r = bf16_round(1.0 / s)
        d8 = (v8 * r >= 4).to(torch.int64)
        halved = torch.where(d8.repeat_interleave(2, -1) == 1, 0.5, 1.0)  # 2^-d8, exactly
        d16 = (v16 * r * halved >= 2).to(torch.int64)
        return s, r, d8, d16

    def assemble(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        d = fields["d8"].repeat_interleave(8, -1) + fields["d16"].repeat_interleave(4, -1)
        mag = fields["m4"].to(torch.float64) * pow2(d - 2) * fields["scale"]
        return torch.where(fields["neg"], -mag, mag)

    def pack(self, fields: dict[str, torch.Tensor], nan: torch.Tensor) -> dict[str, torch.Tensor]:
        s = fields["scale"].squeeze(-1)
        e = floor_log2(s)
        code = (e + 48) * 4 + (s * pow2(2 - e)).to(torch.int64) - 4
        code = torch.where(nan, NAN_CODE, code).to(torch.uint8)
        elements = fields["neg"].to(torch.int64) * 8 + fields["m4"]
        return {
            "scale": code,
            "level2": pack_bits(fields["d8"]).squeeze(-1),
            "level3": pack_bits(fields["d16"]),
            "codes": pack_nibbles(elements),
        }

    def unpack(self, buffers: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                               torch.Tensor]:
        code = buffers["scale"].to(torch.int64)
        nan = code == NAN_CODE
        s = _scale_values(code)
        elements = unpack_nibbles(buffers["codes"]).to(torch.int64)
        fields = {
            "scale": s.unsqueeze(-1),
            "d8": unpack_bits(buffers["level2"].unsqueeze(-1)).to(torch.int64),
            "d16": unpack_bits(buffers["level3"]).to(torch.int64),
            "m4": elements & 7,
            "neg": elements >= 8,
        }
        return fields, nan

    def table_decode(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Element ``m4 * 2^(d8 + d16 - 2) * s``: one factor per group of 4 (its level-2 bit
        covers 8 values, its level-3 bit 4), broadcast over the group's elements."""
        blocks = buffers["scale"].shape[0]
        elements = ELEMENTS[unpack_nibbles(buffers["codes"]).long()].view(blocks, 16, 4)
        d = (unpack_bits(buffers["level2"].unsqueeze(-1)).repeat_interleave(2, -1)
             + unpack_bits(buffers["level3"]))
        factor = QUARTERS[d.long()] * SCALES[buffers["scale"].long()].unsqueeze(-1)
        return (elements * factor.unsqueeze(-1)).view(blocks, 64)

    def block_scales(self, blocks: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        v16 = blocks.abs().unflatten(-1, (16, 4)).amax(-1).double()
        s, _, d8, d16 = self.hierarchy(v16)
        factor = QUARTERS[d8.repeat_interleave(2, -1) + d16] * s.float()  # 2^(d - 2) * s
        empty = blocks[:, :0]
        fields = {"scale": s, "d8": d8, "d16": d16, "m4": empty.long(), "neg": empty.bool()}
        return fields, factor.unsqueeze(-1)

    def magnitude_codes(self, m: torch.Tensor) -> torch.Tensor:
        """S1P2 magnitudes are the integers 0-7, their own codes."""
        return m.round().to(torch.uint8)
