"""MXFP8 E4M3 (OCP Microscaling): 32-value blocks, E8M0 scale, FP8 E4M3 elements.

Used for the paper's W4A8 rollout ablation (4-bit weights, 8-bit activations).
"""

from __future__ import annotations

import torch

from fp4rl.formats._exact import pow2
from fp4rl.formats.base import BlockFormat
from fp4rl.formats.mxfp4 import E8M0_NAN, shared_exponent
from fp4rl.formats.nvfp4 import e4m3_bytes, e4m3_round, e4m3_values


class MXFP8(BlockFormat):
    name = "mxfp8_e4m3"
    block_size = 32
    bits_per_value = 8.25
    kernel_id = 3

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        e = shared_exponent(blocks, 8)
        q = e4m3_round(blocks.abs() * pow2(-e), noise)
        return {"exponent": e, "q": q, "neg": torch.signbit(blocks)}

    def assemble(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        mag = fields["q"] * pow2(fields["exponent"])
        return torch.where(fields["neg"], -mag, mag)

    def pack(self, fields: dict[str, torch.Tensor], nan: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = torch.where(nan, E8M0_NAN, fields["exponent"].squeeze(-1) + 127)
        signed = torch.where(fields["neg"], -fields["q"], fields["q"])
        return {"scale": scale.to(torch.uint8), "codes": e4m3_bytes(signed)}

    def unpack(self, buffers: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                               torch.Tensor]:
        scale = buffers["scale"].to(torch.int64)
        signed = e4m3_values(buffers["codes"])
        fields = {"exponent": (scale - 127).unsqueeze(-1), "q": signed.abs(),
                  "neg": torch.signbit(signed)}
        return fields, scale == E8M0_NAN
