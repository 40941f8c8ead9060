"""NVFP4: 16-value blocks, E4M3 block scale, E2M1 elements, optional FP32 tensor scale.

The per-tensor scale (on by default, as in NVIDIA's training recipe) maps the
tensor's largest magnitude to the top of the E4M3 x E2M1 range, 6 * 448, so
block scales use E4M3's precision instead of saturating or underflowing.
``nvfp4_per_token`` takes that FP32 scale per vector along the quantized axis (per
token, for activations) instead, so that a token's values do not depend on its batch.
"""

from __future__ import annotations

from typing import Any

import torch

from fp4rl.formats._exact import divide, round_minifloat
from fp4rl.formats.base import BlockFormat, QuantOptions, check_tensor
from fp4rl.formats.mxfp4 import (
    e2m1_codes,
    e2m1_decode,
    e2m1_magnitude_codes,
    e2m1_round,
    e2m1_table_decode,
)
from fp4rl.formats.packing import pack_nibbles, unpack_nibbles
from fp4rl.formats.tables import DeviceTable
from fp4rl.kernels import QUANTIZE, FormatKernels
from fp4rl.kernels.codes import FormatCode

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
TENSOR_RANGE = 6.0 * E4M3_MAX


def e4m3_round(v: torch.Tensor, noise: torch.Tensor | None = None,
               max_value: float = E4M3_MAX) -> torch.Tensor:
    """Round magnitudes onto the FP8 E4M3 grid (subnormals below 2**-6), saturating."""
    return round_minifloat(v, 3, min_exp=-6, max_value=max_value, noise=noise)


def e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) byte codes of values already on the E4M3 grid (exact conversion)."""
    return values.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of E4M3 (fn) byte codes."""
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


def _e4m3_scales() -> torch.Tensor:
    code = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    return torch.where((code & 0x7F) == E4M3_NAN, torch.nan, e4m3_values(code).float())


#: float32 value of each E4M3 scale byte (NaN codes: NaN)
E4M3_SCALES = DeviceTable(_e4m3_scales)


class NVFP4(BlockFormat):
    name = "nvfp4"
    block_size = 16
    bits_per_value = 4.5
    #: the C kernel lacks the ResQ and bf16 passes, as the per-tensor scale needs a pass
    #: over the whole tensor first; ResQ composes quantizer passes on either backend (its
    #: residual has a scale of its own)
    kernels = FormatKernels(FormatCode.NVFP4, c=QUANTIZE, triton=QUANTIZE | {"rows_bf16", "decode"},
                            tensor_scale=True)
    extra_options = ("per_tensor_scale",)
    has_tensor_scale = True

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        a = blocks.abs()
        s = e4m3_round(torch.clamp(divide(a.amax(-1, keepdim=True), 6.0), max=E4M3_MAX))
        v = torch.where(s > 0, a / torch.where(s > 0, s, 1.0), 0.0)
        return {"scale": s, "q": e2m1_round(v, noise), "neg": torch.signbit(blocks)}

    def assemble(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        mag = fields["q"] * fields["scale"]
        return torch.where(fields["neg"], -mag, mag)

    def pack(self, fields: dict[str, torch.Tensor], nan: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = torch.where(nan, E4M3_NAN, e4m3_bytes(fields["scale"].squeeze(-1)))
        return {"scale": scale.to(torch.uint8),
                "codes": pack_nibbles(e2m1_codes(fields["q"], fields["neg"]))}

    def unpack(self, buffers: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                               torch.Tensor]:
        scale = buffers["scale"]
        nan = (scale & 0x7F) == E4M3_NAN
        q, neg = e2m1_decode(unpack_nibbles(buffers["codes"]))
        s = e4m3_values(torch.where(nan, 0, scale).to(torch.uint8)).unsqueeze(-1)
        return {"scale": s, "q": q, "neg": neg}, nan

    def table_decode(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The block values alone: the per-tensor scale stays with the caller."""
        return e2m1_table_decode(buffers, E4M3_SCALES)

    def block_scales(self, blocks: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Of blocks already divided by the per-tensor scale."""
        s = e4m3_round(torch.clamp(divide(blocks.abs().amax(-1, keepdim=True).double(), 6.0),
                                   max=E4M3_MAX))
        empty = blocks[:, :0]
        return {"scale": s, "q": empty.double(), "neg": empty.bool()}, s.float().unsqueeze(-1)

    def magnitude_codes(self, m: torch.Tensor) -> torch.Tensor:
        return e2m1_magnitude_codes(m)

    def tensor_scale(self, x: torch.Tensor, dim: int = -1, **options: Any
                     ) -> torch.Tensor | None:
        """``amax / (6 * 448)`` of ``x`` as a 0-dim float32 tensor on its device (1 where
        ``x`` has no finite non-zero value), or None where switched off."""
        return self._scale_along(x, check_tensor(x, dim), self.options(**options))

    def _tensor_scale(self, rows: torch.Tensor, opts: QuantOptions) -> torch.Tensor | None:
        """``g = amax / (6 * 448)`` in FP32 over the finite values, a 0-dim tensor on the
        device of ``rows``; 1 where no finite value is non-zero (blocks then see ``x``
        itself, as without the scale). Never read back to the host: a GPU stream does not
        stall on it and a CUDA graph captures it."""
        if not opts.per_tensor_scale:
            return None
        return _scale_of(finite_amax(rows))


class NVFP4PerToken(NVFP4):
    """NVFP4 whose FP32 second-level scale belongs to each vector along the quantized
    axis (each token's row of activations) instead of the whole tensor, as in vLLM's
    ``nvfp4_per_token``, NeMo-RL's and Miles' recipes. A token's values then depend on
    that token alone: a serving engine that pads its batch with stale rows (CUDA graphs)
    scores each token as an eager one does. The scales lie along the GEMM's other axis,
    so they stay outside the product as the per-tensor one does; a weight keeps NVFP4's
    one per-tensor scale (:attr:`weight_format`)."""

    name = "nvfp4_per_token"
    label = "NVFP4/token"
    vector_scales = True
    weight_format = "nvfp4"

    def _tensor_scale(self, rows: torch.Tensor, opts: QuantOptions) -> torch.Tensor | None:
        """One scale per row of ``rows``, ``(rows, 1)``."""
        return self._scale_along(rows, rows.dim() - 1, opts)

    def _scale_along(self, x: torch.Tensor, dim: int,
                     opts: QuantOptions) -> torch.Tensor | None:
        """Each vector's ``amax / (6 * 448)`` over its finite values, the reduced axis
        kept (size 1), so that it broadcasts against ``x`` (1 for a vector with no finite
        non-zero value)."""
        if not opts.per_tensor_scale:
            return None
        if x.dim() == 0:
            return _scale_of(finite_amax(x))
        amax = torch.where(torch.isfinite(x), x.abs(), 0).amax(dim, keepdim=True)
        return _scale_of(amax.float())


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``amax / (6 * 448)`` in float32, 1 where ``amax`` is 0."""
    g = divide(amax, TENSOR_RANGE)
    return torch.where(g > 0, g, torch.ones_like(g))


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of ``x`` (0 if none) as a 0-dim float32 tensor. On the
    CPU one ``aminmax`` pass, and a second only where a NaN or Inf got into it (asking is
    free there); elsewhere one masked pass, with no host sync."""
    if x.numel() == 0:
        return x.new_zeros((), dtype=torch.float32)
    if x.device.type == "cpu":
        low, high = torch.aminmax(x)  # one pass, no |x| temporary
        amax = torch.maximum(-low, high).float()  # a max is exact in x's own dtype
        if bool(torch.isfinite(amax)):
            return amax
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax().float()
