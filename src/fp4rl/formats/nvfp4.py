"""NVFP4: 16-value blocks, E4M3 block scale, E2M1 elements, optional FP32 tensor scale.

The per-tensor scale (on by default, as in NVIDIA's training recipe) maps the
tensor's largest magnitude to the top of the E4M3 x E2M1 range, 6 * 448, so
block scales use E4M3's precision instead of saturating or underflowing.
``nvfp4_per_token`` takes that FP32 scale per vector along the quantized axis (per
token, for activations) instead, so that a token's values do not depend on its batch.

``nvfp4_4o6`` and ``nvfp4_per_token_4o6`` choose each block's scale by Four Over Six
(Cook et al., arXiv 2512.02010; Miles's and TransformerEngine's NVFP4 recipes): the block
is scaled so that its largest magnitude maps to 6 (NVFP4's rule) or to 4, whichever
leaves the smaller squared error over the block (6 on a tie). E2M1 steps from 4 to 6, so a
block whose near-maximal values would round across that gap loses less scaled to 4. Their
tensor scale maps the largest magnitude to ``6 * 256`` instead of ``6 * 448``, so that a
block scale of ``max / 4`` still fits E4M3 (at most 384). The codes and scales are
NVFP4's: any NVFP4 decoder reads them.

The FP32 second-level scale follows a :class:`ScaleRule`. ``dynamic`` (the field's
definition) is ``amax / range``, a continuous function of the input: one ulp more in a
row's amax changes every value's scale, and the GEMM multiplies it into every output, so
float noise upstream never stops at an NVFP4 GEMM (a power-of-two scale erases it).
``pow2`` rounds that scale up to a power of two (the blocks then see a largest magnitude
in ``(range / 2, range]``); ``static`` takes one scale a caller fixed (a layer's, per
weight version: :func:`static_scale`) and computes the dynamic one only where none is
fixed. Each rule is a format of its own (``nvfp4_pow2``, ``nvfp4_static``, ...,
:func:`scale_variants`), so that it travels with the data as the formats do.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from enum import StrEnum
from typing import ClassVar, Unpack

import torch

from fp4rl.formats._exact import divide, nonfinite_blocks, round_minifloat
from fp4rl.formats.base import (
    BlockFormat,
    QuantizeKwargs,
    QuantOptions,
    check_tensor,
    to_rows,
)
from fp4rl.formats.mxfp4 import (
    e2m1_codes,
    e2m1_decode,
    e2m1_magnitude_codes,
    e2m1_round,
    e2m1_table_decode,
)
from fp4rl.formats.packing import PackedTensor, pack_nibbles, unpack_nibbles
from fp4rl.formats.tables import DeviceTable
from fp4rl.kernels import QUANTIZE, FormatKernels, Operation, has_kernel
from fp4rl.kernels import finite_amax as kernel_amax
from fp4rl.kernels import vector_amax as kernel_vector_amax
from fp4rl.kernels import vector_amax_both as kernel_amax_both
from fp4rl.kernels.codes import FormatCode

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
TENSOR_RANGE = 6.0 * E4M3_MAX
#: the tensor scale's range under Four Over Six: a block scale of max / 4 stays within E4M3
FOUR_OVER_SIX_RANGE = 6.0 * 256.0


class ScaleRule(StrEnum):
    """How an NVFP4 format's FP32 second-level scale follows its input (module
    docstring); a member equals its spelling in configs."""

    DYNAMIC = "dynamic"
    POW2 = "pow2"
    STATIC = "static"


#: :func:`static_scale`'s scale, per thread: ``torch.compile`` reads a ``threading.local``
#: in its graph (and guards on it), where a ``ContextVar.get`` breaks the graph; a forward
#: awaits nothing, so a thread's scope is also its task's
_static = threading.local()


def current_static_scale() -> torch.Tensor | None:
    """The scale :func:`static_scale` set in this thread, or None."""
    scale: torch.Tensor | None = getattr(_static, "scale", None)
    return scale



@contextlib.contextmanager
def static_scale(scale: torch.Tensor | None) -> Iterator[None]:
    """Within the block, a ``static`` NVFP4 format's second-level scale is ``scale`` (a
    0-dim float32 tensor; None: the dynamic one)."""
    outer = current_static_scale()
    _static.scale = scale
    try:
        yield
    finally:
        _static.scale = outer


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
    #: the C kernel lacks the ResQ and bf16 row passes, as the per-tensor scale needs a
    #: pass over the whole tensor first (its block values along both axes take the scale
    #: the caller computed); ResQ composes quantizer passes on either backend (its
    #: residual has a scale of its own)
    kernels: ClassVar[FormatKernels | None] = FormatKernels(
        FormatCode.NVFP4, c=QUANTIZE | {Operation.BOTH},
        triton=QUANTIZE | {Operation.ROWS_BF16, Operation.DECODE, Operation.PACKED_MM,
                           Operation.BOTH, Operation.QMM})
    extra_options = ("per_tensor_scale",)
    has_tensor_scale = True
    #: the magnitude the tensor scale maps the largest value to (what the blocks then see)
    tensor_range: float = TENSOR_RANGE
    #: how the second-level scale follows the input (:class:`ScaleRule`)
    scale_rule: ClassVar[ScaleRule] = ScaleRule.DYNAMIC

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        s, q = _scaled_to(blocks.abs(), 6.0, noise)
        return {"scale": s, "q": q, "neg": torch.signbit(blocks)}

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

    def block_scales(self, blocks: torch.Tensor
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """Of blocks already divided by the per-tensor scale."""
        s = e4m3_round(torch.clamp(divide(blocks.abs().amax(-1, keepdim=True).double(), 6.0),
                                   max=E4M3_MAX))
        empty = blocks[:, :0]
        return {"scale": s, "q": empty.double(), "neg": empty.bool()}, s.float().unsqueeze(-1)

    def magnitude_codes(self, m: torch.Tensor) -> torch.Tensor:
        return e2m1_magnitude_codes(m)

    def tensor_scale(self, x: torch.Tensor, dim: int = -1, **options: Unpack[QuantizeKwargs]
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
        if self.scale_rule is ScaleRule.STATIC:
            fixed = current_static_scale()
            if fixed is not None:
                return fixed
        return _scale_of(finite_amax(rows), self.tensor_range, self.scale_rule)


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

    def tensor_scales(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each row's scale and each column's, from one read of ``x`` where a GPU kernel
        finds both maxima (the rows' and the columns' amax of one pass)."""
        both = kernel_amax_both(x) if x.dim() == 2 else None
        if both is None:
            return super().tensor_scales(x)
        return tuple(_scale_of(a, self.tensor_range, self.scale_rule)  # type: ignore[return-value]
                     for a in both)

    def _scale_along(self, x: torch.Tensor, dim: int,
                     opts: QuantOptions) -> torch.Tensor | None:
        """Each vector's ``amax / (6 * 448)`` over its finite values, the reduced axis
        kept (size 1), so that it broadcasts against ``x`` (1 for a vector with no finite
        non-zero value)."""
        if not opts.per_tensor_scale:
            return None
        if x.dim() == 0:
            return _scale_of(finite_amax(x), self.tensor_range, self.scale_rule)
        amax = kernel_vector_amax(x, dim) if x.dim() == 2 else None  # a GPU: one pass
        if amax is None:
            amax = torch.where(torch.isfinite(x), x.abs(), 0).amax(dim, keepdim=True)
        return _scale_of(amax.float(), self.tensor_range, self.scale_rule)


class NVFP4FourOverSix(NVFP4):
    """NVFP4 with Four Over Six block scales (see the module docstring): each block scaled
    to a largest magnitude of 6 or of 4, whichever errs less, under a tensor scale of
    range ``6 * 256``. The two squared errors are compared exactly
    (:func:`four_errs_less`), as both kernels compare them, so a tie is a tie on every
    path.
    The C kernel (CPU) and Triton quantize it; the fast row encoder implements NVFP4's
    rule alone."""

    name = "nvfp4_4o6"
    label = "NVFP4 4/6"
    tensor_range = FOUR_OVER_SIX_RANGE
    kernels = FormatKernels(FormatCode.NVFP4_4O6, c=QUANTIZE, triton=QUANTIZE)

    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        a = blocks.abs()
        s6, q6 = _scaled_to(a, 6.0, noise)
        s4, q4 = _scaled_to(a, 4.0, noise)
        four = four_errs_less(a, q4 * s4, q6 * s6, s6)
        return {"scale": torch.where(four, s4, s6), "q": torch.where(four, q4, q6),
                "neg": torch.signbit(blocks)}

    def block_scales(self, blocks: torch.Tensor
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """No fast encoder: its block scales follow NVFP4's rule alone."""
        return None


class NVFP4PerTokenFourOverSix(NVFP4FourOverSix, NVFP4PerToken):
    """Per-token NVFP4 with Four Over Six block scales (Miles's activations); a weight
    takes ``nvfp4_4o6``."""

    name = "nvfp4_per_token_4o6"
    label = "NVFP4/token 4/6"
    weight_format = "nvfp4_4o6"


class NVFP4Tiles(NVFP4):
    """NVFP4 whose block is a 16 x 16 tile of a matrix instead of 16 values along one
    axis (torchao's and NVIDIA's NVFP4 training recipes for weights): one E4M3 scale per
    tile, under NVFP4's per-tensor scale. A matrix then quantizes to the same values along
    either axis, so ``Q(W)`` in the forward and ``Q(W^T)`` in the input-gradient GEMM
    agree. A tensor of more dimensions is tiled over its vectors along the quantized axis
    (16 of them) and 16 values along it. Stored in NVFP4's layout (each tile's scale
    repeated on its 16 rows), which any NVFP4 decoder reads. The C kernel (CPU) and
    Triton quantize it (each C task and each Triton program starts at a tile, and the
    tile's 16 rows share their largest); the fast row encoder implements 1-D blocks alone."""

    name = "nvfp4_2d"
    label = "NVFP4 16x16"
    kernels = FormatKernels(FormatCode.NVFP4_TILES, c=QUANTIZE, triton=QUANTIZE)

    def block_scales(self, blocks: torch.Tensor
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """No fast encoder: its blocks are tiles, not runs along a row."""
        return None

    def _quantize(self, x: torch.Tensor, dim: int, opts: QuantOptions, fast: bool
                  ) -> torch.Tensor:
        d = check_tensor(x, dim)
        if fast and has_kernel(self, x.device):  # the kernel's row blocks make the tiles
            return super()._quantize(x, dim, opts, fast)
        if x.numel() == 0:
            return x.clone()
        rows, restore = to_rows(x, d)
        scale = self._tensor_scale(rows, opts)
        fields, nan = self._tile_fields(rows if scale is None else rows / scale, opts)
        values = torch.where(nan, torch.nan, self.assemble(fields))
        out = _untile(values, rows.shape).to(torch.float32)
        return restore(out if scale is None else out * scale)

    def encode(self, x: torch.Tensor, dim: int = -1,
               **options: Unpack[QuantizeKwargs]) -> PackedTensor:
        opts = self.options(**options)
        d = check_tensor(x, dim)
        rows, _ = to_rows(x, d)
        scale = self._tensor_scale(rows, opts)
        fields, nan = self._tile_fields(rows if scale is None else rows / scale, opts)
        bs = self.block_size
        runs = {k: _untile(v.expand(-1, bs * bs), rows.shape, pad_cols=True).reshape(-1, bs)
                for k, v in fields.items()}  # each tile as its 16 runs along the rows
        runs["scale"] = runs["scale"][:, :1]
        nan_runs = _untile(nan.expand(-1, bs * bs), rows.shape, pad_cols=True)
        buffers = self.pack(runs, nan_runs.reshape(-1, bs)[:, 0])
        return PackedTensor(self.name, tuple(x.shape), d, x.dtype, buffers,
                            tensor_scale=scale, options={"length": rows.shape[-1]})

    def _tile_fields(self, rows: torch.Tensor, opts: QuantOptions
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """NVFP4's fields of each ``(16 * 16)``-value tile of float32 ``rows`` (zero
        padded), and the tiles holding a NaN or an Inf."""
        bs = self.block_size
        tiles = _tiles(rows, bs).to(torch.float64)
        noise = self._noise(rows.shape[0], rows.shape[1], rows.device, opts)
        if noise is not None:
            noise = _tiles(torch.nn.functional.pad(
                noise, (0, 0, 0, -rows.shape[0] % bs)), bs).to(torch.float64)
        nan = nonfinite_blocks(tiles)
        return self.fields(torch.where(nan, 0.0, tiles), noise), nan


def _tiles(rows: torch.Tensor, bs: int) -> torch.Tensor:
    """``(tiles, bs * bs)``: the zero-padded ``(N, L)`` rows cut into ``bs x bs`` tiles."""
    n, length = rows.shape
    padded = torch.nn.functional.pad(rows, (0, -length % bs, 0, -n % bs))
    r, c = padded.shape
    return padded.reshape(r // bs, bs, c // bs, bs).permute(0, 2, 1, 3).reshape(-1, bs * bs)


def _untile(tiles: torch.Tensor, shape: torch.Size, pad_cols: bool = False) -> torch.Tensor:
    """The inverse of :func:`_tiles`: ``(N, L)`` (the padded columns kept with
    ``pad_cols``, as a packed row stores them)."""
    n, length = shape
    bs = math.isqrt(tiles.shape[-1])
    r, c = n + -n % bs, length + -length % bs
    out = tiles.reshape(r // bs, c // bs, bs, bs).permute(0, 2, 1, 3).reshape(r, c)
    return out[:n] if pad_cols else out[:n, :length]


def _scaled_to(a: torch.Tensor, top: float, noise: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 scale mapping each block's largest magnitude of ``a`` (float64 blocks)
    to ``top``, saturating at E4M3's 448, and the E2M1 magnitudes of ``a`` under it."""
    s = e4m3_round(torch.clamp(divide(a.amax(-1, keepdim=True), top), max=E4M3_MAX))
    v = torch.where(s > 0, a / torch.where(s > 0, s, 1.0), 0.0)
    return s, e2m1_round(v, noise)


#: the bits of one fraction limb of :func:`four_errs_less` (two limbs: 48 bits)
_LIMB = 24


def four_errs_less(a: torch.Tensor, p4: torch.Tensor, p6: torch.Tensor, s6: torch.Tensor
                   ) -> torch.Tensor:
    """Whether each block's squared error under the scale to 4 is smaller than under the
    scale to 6, decided exactly: ``sum((p4 - a)^2) < sum((p6 - a)^2)`` for blocks ``a`` of
    float32 magnitudes (float64 tensors, ``(N, 16)``), their two quantizations ``p4`` and
    ``p6`` and the scale ``s6`` (``(N, 1)``). A float sum of squares rounds, and two
    rounded sums can order otherwise than the errors do (a near-tie); a GPU would also
    need float64 to follow it. The exact difference is an integer sum instead, so the
    reference, the C kernel and the Triton kernel (in float32 and int32) decide alike.

    The difference is ``sum((p4 - p6)(p4 + p6 - 2a))``. Both quantizations lie on the
    grid ``g = 2^(E - 4)`` of the smaller scale (``s6 = m 2^(E - 3)``, E at least -6, an
    E2M1 value a multiple of 1/2), at most 384 steps; a value whose two quantizations
    differ is below 256 g and at least ``2^-25 s6`` (the least that rounds up, nearest
    or stochastic), so ``a / g`` has at most 48 fraction bits. In units of ``g^2``, the
    difference is ``sum(P4^2 - P6^2) - 2 sum(D a / g)``, ``D = P4 - P6``: ``a / g`` split
    into its integer part and two 24-bit fraction limbs, each limb's sum an exact
    integer, the limbs carried into the integer part, whose sign is the difference's.
    Where both quantizations agree (every value, when both scales saturate at 448) the
    value adds nothing and is left out."""
    e = torch.where(s6 > 0, torch.frexp(s6)[1] - 1, -6).clamp(min=-6)
    inv_g = torch.ldexp(torch.ones_like(s6), 4 - e)  # 1 / g, exact
    big4, big6 = p4 * inv_g, p6 * inv_g  # integers below 2^9
    d = big4 - big6
    r = torch.where(d != 0, a, 0.0) * inv_g  # below 2^8, 48 fraction bits
    c0 = r.floor()
    f = (r - c0) * 2.0**_LIMB
    c1 = f.floor()
    c2 = (f - c1) * 2.0**_LIMB
    di = d.long()
    l0 = (big4.square() - big6.square()).long() - 2 * di * c0.long()
    l1 = -2 * di * c1.long()
    l2 = -2 * di * c2.long()
    low = l2.sum(-1, keepdim=True)
    mid = l1.sum(-1, keepdim=True) + torch.div(low, 2**_LIMB, rounding_mode="floor")
    top = l0.sum(-1, keepdim=True) + torch.div(mid, 2**_LIMB, rounding_mode="floor")
    return top < 0


def _scale_of(amax: torch.Tensor, tensor_range: float = TENSOR_RANGE,
              rule: ScaleRule = ScaleRule.DYNAMIC) -> torch.Tensor:
    """``amax / tensor_range`` in float32, 1 where ``amax`` is 0; under ``pow2`` rounded up
    to a power of two (exactly: the exponent of its float32 bits, one up unless the
    mantissa is bare)."""
    g = divide(amax, tensor_range)
    if rule is ScaleRule.POW2:
        mantissa, exponent = torch.frexp(g)  # g = mantissa * 2^exponent, mantissa in [0.5, 1)
        g = torch.where(mantissa == 0.5, g, torch.ldexp(torch.ones_like(g), exponent))
    return torch.where(g > 0, g, torch.ones_like(g))


#: the scale rules each NVFP4 activation format takes beyond ``dynamic`` (``static``
#: needs one scale per tensor: a per-token scale is the token's own already)
_RULES_OF = {NVFP4: (ScaleRule.POW2, ScaleRule.STATIC), NVFP4PerToken: (ScaleRule.POW2,),
             NVFP4PerTokenFourOverSix: (ScaleRule.POW2,)}


def scale_variants() -> list[NVFP4]:
    """One format object per NVFP4 format and non-dynamic scale rule it takes: the same
    blocks, codes and kernels, named ``<base>_<rule>`` (``nvfp4_pow2``)."""
    out: list[NVFP4] = []
    for base, rules in _RULES_OF.items():
        for rule in rules:
            variant = type(f"{base.__name__}{rule.value.capitalize()}", (base,), {
                "name": f"{base.name}_{rule.value}",
                "label": f"{base.label or base.name.upper()} {rule.value}",
                "scale_rule": rule, "__module__": __name__,
                # the rule is an activation's: a weight's amax does not depend on a batch
                "weight_format": base.weight_format or base.name,
                "__doc__": f"{base.name} with the {rule.value} second-level scale "
                           "(:class:`ScaleRule`)."})
            out.append(variant())
    return out


def scale_rule_name(fmt: NVFP4, rule: ScaleRule) -> str:
    """The registered name of ``fmt`` under ``rule`` (``nvfp4`` -> ``nvfp4_pow2``; the
    base's own name for ``dynamic``)."""
    base = fmt.name if fmt.scale_rule is ScaleRule.DYNAMIC else \
        fmt.name.removesuffix(f"_{fmt.scale_rule.value}")
    return base if rule is ScaleRule.DYNAMIC else f"{base}_{rule.value}"


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of ``x`` (0 if none) as a 0-dim float32 tensor. On a GPU
    one Triton pass (:func:`fp4rl.kernels.finite_amax`); on the CPU one ``aminmax`` pass,
    and a second only where a NaN or Inf got into it (asking is free there); elsewhere one
    masked pass, with no host sync."""
    if x.numel() == 0:
        return x.new_zeros((), dtype=torch.float32)
    fast = kernel_amax(x)  # a GPU: one Triton pass
    if fast is not None:
        return fast
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        # (a compiled graph takes the masked pass below: reading a value breaks it)
        low, high = torch.aminmax(x)  # one pass, no |x| temporary
        amax = torch.maximum(-low, high).float()  # a max is exact in x's own dtype
        if bool(torch.isfinite(amax)):
            return amax
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax().float()
