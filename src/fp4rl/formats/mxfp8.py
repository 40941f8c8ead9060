"""MXFP8 E4M3 (OCP Microscaling): 32-value blocks, E8M0 scale, FP8 E4M3 elements.

Used for the paper's W4A8 rollout ablation (4-bit weights, 8-bit activations).
"""

from __future__ import annotations

import torch

from fp4rl.formats.mxfp4 import MXFormat
from fp4rl.formats.nvfp4 import e4m3_bytes, e4m3_round, e4m3_values
from fp4rl.kernels import QUANTIZE_AND_RESQ, FormatKernels, Operation
from fp4rl.kernels.codes import FormatCode


class MXFP8(MXFormat):
    name = "mxfp8_e4m3"
    label = "MXFP8"
    bits_per_value = 8.25
    #: no packed decode kernel: MXFP8 weights are not packed for the rollout
    kernels = FormatKernels(FormatCode.MXFP8, c=QUANTIZE_AND_RESQ | {Operation.ROWS_BF16,
                                                                   Operation.BOTH},
                            triton=QUANTIZE_AND_RESQ | {Operation.ROWS_BF16, Operation.BOTH,
                                                        Operation.QMM})
    scale_offset = 8  # E4M3's largest exponent

    def round_elements(self, v: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return e4m3_round(v, noise)

    def element_codes(self, q: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return e4m3_bytes(torch.where(neg, -q, q))

    def decode_elements(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        signed = e4m3_values(codes)
        return signed.abs(), torch.signbit(signed)
