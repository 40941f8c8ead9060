"""The block-format interface shared by HiF4, MXFP4, NVFP4 and MXFP8.

A format describes one block of values as a handful of integer *fields*
(scale exponents, element codes, sign). The plain reference path computes the
fields straight from ``formats.md`` in exact float64 arithmetic and assembles
the dequantized values from them; ``encode``/``decode`` pack and unpack the
same fields, so ``decode(encode(x))`` equals ``quantize(x)`` by construction.
The fast path (a fused C kernel, see :mod:`fp4rl.kernels`) must match the
reference bit for bit; tests hold it to that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Self, TypedDict, Unpack

import torch

from fp4rl.errors import UserError
from fp4rl.formats._exact import nonfinite_blocks
from fp4rl.formats.packing import PackedTensor
from fp4rl.kernels import FormatKernels, has_matrix_kernel, quantize_matrix, quantize_rows

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the scale rule under which a caller fixes the FP32 scale on top of the blocks
#: (``ScaleRule.STATIC``'s spelling: :attr:`NumberFormat.fixed_scale`)
FIXED_SCALE_RULE = "static"


class Rounding(StrEnum):
    """How the element step rounds: to nearest (the spec) or stochastically (gradients)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


class FormatError(UserError):
    """Bad input to a quantizer: a wrong option, dtype, dim or value."""


@dataclass(frozen=True)
class QuantOptions:
    """Validated options of one quantize/encode call."""

    rounding: Rounding = Rounding.NEAREST
    generator: torch.Generator | None = None
    per_tensor_scale: bool = True


class QuantizeKwargs(TypedDict, total=False):
    """The keyword options a quantize, encode or tensor-scale call takes (every format
    takes the first two; :attr:`NumberFormat.extra_options` names those beyond);
    :meth:`NumberFormat.options` checks them at run time as well."""

    rounding: str | Rounding
    generator: torch.Generator | None
    per_tensor_scale: bool


def check_tensor(x: object, dim: int) -> int:
    """Validate a quantizer input and return ``dim`` normalized to ``[0, x.ndim)``."""
    if not isinstance(x, torch.Tensor):
        raise FormatError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        hint = " (convert with x.float())" if not x.dtype.is_floating_point else ""
        raise FormatError(f"cannot quantize a {x.dtype} tensor{hint}; allowed dtypes: {allowed}")
    ndim = max(x.ndim, 1)
    if not -ndim <= dim < ndim:
        raise FormatError(f"dim={dim} is out of range for a {x.ndim}-d tensor "
                          f"(allowed: {-ndim} .. {ndim - 1})")
    return dim % ndim


class NumberFormat(ABC):
    """What every format offers: option checking, quantize, encode and decode."""

    name: ClassVar[str]
    block_size: ClassVar[int]
    bits_per_value: ClassVar[float]
    #: options beyond ``rounding`` and ``generator`` that this format accepts
    extra_options: ClassVar[tuple[str, ...]] = ()
    #: how tables and reports write the name (default: upper case)
    label: ClassVar[str] = ""
    #: the compiled kernels this format has (None: the reference path only)
    kernels: ClassVar[FormatKernels | None] = None
    #: whether the format scales values by an FP32 scale on top of its blocks (NVFP4's
    #: per-tensor amax scale), which GEMMs keep outside the product
    has_tensor_scale: ClassVar[bool] = False
    #: whether the FP32 scale on top of the blocks is one per vector along the quantized
    #: axis (a token's, say) instead of one per tensor: a GEMM keeps such scales outside
    #: the product only along its other axis, so a weight cannot take them
    vector_scales: ClassVar[bool] = False
    #: the format a weight takes in a recipe named after this one (None: this one)
    weight_format: ClassVar[str | None] = None
    #: how the FP32 scale on top of the blocks follows the input: the spelling of one
    #: :class:`fp4rl.formats.nvfp4.ScaleRule` (a ``StrEnum``, equal to it) for a format
    #: with such a scale (``dynamic``: from each input), None for one without. A format
    #: under another rule is a registered format of its own (``nvfp4_pow2``), found by
    #: :func:`fp4rl.formats.registry.with_scale_rule`
    scale_rule: ClassVar[str | None] = None

    @property
    def fixed_scale(self) -> bool:
        """Whether the FP32 scale on top of the blocks is one a caller fixes (one per layer
        and RL step: the ``static`` rule), not one computed from each input. Such a
        format needs its layer to calibrate the scale, cannot be a weight's (whose scale
        is its own amax), cannot share the scale with a recovery method's residual, and
        runs only in an engine that keeps the layer's scale: the recipe, the layers and
        the engines ask this, not the format's class."""
        return self.scale_rule == FIXED_SCALE_RULE

    @property
    def display_name(self) -> str:
        """The name as tables and reports write it (``HiF4``, ``MXFP4``)."""
        return self.label or self.name.upper()

    def options(self, rounding: str | Rounding = "nearest",
                generator: torch.Generator | None = None, **extra: object) -> QuantOptions:
        """Validate keyword options, naming the allowed values on error."""
        unknown = sorted(set(extra) - set(self.extra_options))
        if unknown:
            allowed = ", ".join(("rounding", "generator", *self.extra_options))
            raise FormatError(f"format '{self.name}' does not take option(s) {unknown}; "
                              f"allowed: {allowed}")
        try:
            mode = Rounding(rounding)
        except ValueError:
            raise FormatError(f"rounding={rounding!r} is not one of "
                              f"{[r.value for r in Rounding]}") from None
        if generator is not None and not isinstance(generator, torch.Generator):
            raise FormatError("generator must be a torch.Generator")
        per_tensor = extra.get("per_tensor_scale", True)
        if not isinstance(per_tensor, bool):
            raise FormatError("per_tensor_scale must be True or False")
        return QuantOptions(mode, generator, per_tensor)

    @abstractmethod
    def quantize(self, x: torch.Tensor, dim: int = -1,
                 **options: Unpack[QuantizeKwargs]) -> torch.Tensor:
        """Fake-quantize ``x`` along ``dim`` (fast path); output keeps shape and dtype."""

    def tensor_scale(self, x: torch.Tensor, dim: int = -1, **options: Unpack[QuantizeKwargs]
                     ) -> torch.Tensor | None:
        """The float32 scale ``quantize`` divides ``x`` by along ``dim`` on top of the
        blocks, on ``x``'s device, or None (only NVFP4 has one): a 0-dim tensor, or with
        :attr:`vector_scales` one per vector, the shape of ``x`` with ``dim`` reduced to 1.
        GEMMs keep it outside the product (see ``fp4rl.gemm``)."""
        return None

    def tensor_scales(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A matrix's scales along its rows and along its columns (``tensor_scale(x, -1)``
        and ``tensor_scale(x, 0)``), as a GEMM operand and its backward GEMM's need them:
        one scale serves both where it is one per tensor."""
        rows = self.tensor_scale(x, -1)
        return rows, (self.tensor_scale(x, 0) if self.vector_scales else rows)

    @abstractmethod
    def quantize_reference(self, x: torch.Tensor, dim: int = -1,
                           **options: Unpack[QuantizeKwargs]) -> torch.Tensor:
        """The plain path written from the spec; slow, kept as the test oracle."""

    @abstractmethod
    def encode(self, x: torch.Tensor, dim: int = -1,
               **options: Unpack[QuantizeKwargs]) -> PackedTensor:
        """Store ``x`` in the format's real bit layout."""

    @abstractmethod
    def decode(self, packed: PackedTensor) -> torch.Tensor:
        """Rebuild the fake-quantized tensor from a :class:`PackedTensor`."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size}, "
                f"bits_per_value={self.bits_per_value})")

    def __str__(self) -> str:
        """The registered name: what configs, messages and file names write."""
        return self.name

    # A format holds no state: a recipe that holds one is copied with the object itself, so
    # that recipes compare by identity after a copy; a registered format also pickles as its
    # name (the registry installs that reduction: fp4rl.formats.registry.register_format).
    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Self:
        return self


class BlockFormat(NumberFormat):
    """A block-scaled format described by per-block integer fields.

    The fast path runs the kernels the format declares in ``kernels`` (see
    :mod:`fp4rl.kernels`); a format without them quantizes through the reference path,
    so a new format needs only the four methods below.
    """

    # ----- what each format defines -------------------------------------------------
    @abstractmethod
    def fields(self, blocks: torch.Tensor, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Fields of ``(N, block_size)`` float64 blocks (finite values; ``noise`` in [0, 1))."""

    @abstractmethod
    def assemble(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        """Dequantized ``(N, block_size)`` float64 values from the fields."""

    @abstractmethod
    def pack(self, fields: dict[str, torch.Tensor], nan: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 storage buffers for the fields; ``nan`` marks blocks to store as NaN."""

    @abstractmethod
    def unpack(self, buffers: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                               torch.Tensor]:
        """Fields and the NaN-block mask back from the storage buffers."""

    # ----- fast paths a format may offer (None: the reference serves) ----------------
    def table_decode(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``(N, block_size)`` float32 values of packed blocks by look-ups in the format's
        tables on the buffers' device, the reference's values bit for bit (NaN blocks
        included); None where the format has no such tables (see
        :mod:`fp4rl.formats.row_decode`)."""
        return None

    def block_scales(self, blocks: torch.Tensor
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """For the fast encoder of 4-bit sign-magnitude codes (see
        :mod:`fp4rl.formats.row_encode`): the fields :meth:`pack` takes besides the
        elements, of finite ``(N, block_size)`` float32 blocks, with empty element fields,
        and each element group's float32 scale ``(N, groups, 1)``; None where the format
        has no fast encoder."""
        return None

    def magnitude_codes(self, m: torch.Tensor) -> torch.Tensor:
        """3-bit uint8 codes of element magnitudes ``m`` (float32 values on the element
        grid); a format that offers :meth:`block_scales` defines it."""
        raise NotImplementedError(f"format {self.name!r} has no fast encoder")

    # ----- public API ----------------------------------------------------------------
    def quantize(self, x: torch.Tensor, dim: int = -1,
                 **options: Unpack[QuantizeKwargs]) -> torch.Tensor:
        """Fake-quantize ``x`` along ``dim`` (fast path); output keeps shape and dtype."""
        return self._quantize(x, dim, self.options(**options), fast=True)

    def quantize_reference(self, x: torch.Tensor, dim: int = -1,
                           **options: Unpack[QuantizeKwargs]) -> torch.Tensor:
        """The plain path written from the spec; slow, kept as the test oracle."""
        return self._quantize(x, dim, self.options(**options), fast=False)

    def encode(self, x: torch.Tensor, dim: int = -1,
               **options: Unpack[QuantizeKwargs]) -> PackedTensor:
        """Store ``x`` in the format: packed 4-bit codes plus the scale fields."""
        opts = self.options(**options)
        d = check_tensor(x, dim)
        rows, _ = to_rows(x, d)
        scale = self._tensor_scale(rows, opts)
        if scale is not None:
            rows = rows / scale
        blocks, noise = self._to_blocks(
            rows, self._noise(rows.shape[0], rows.shape[1], rows.device, opts))
        nan = nonfinite_blocks(blocks)
        fields = self.fields(torch.where(nan, 0.0, blocks), noise)
        buffers = self.pack(fields, nan.squeeze(-1))
        return PackedTensor(self.name, tuple(x.shape), d, x.dtype, buffers,
                            tensor_scale=scale, options={"length": rows.shape[-1]})

    def decode(self, packed: PackedTensor) -> torch.Tensor:
        """Rebuild the fake-quantized tensor from a :class:`PackedTensor`."""
        if packed.format != self.name:
            raise FormatError(f"cannot decode a '{packed.format}' tensor with '{self.name}'")
        fields, nan = self.unpack(packed.fields)
        values = torch.where(nan.unsqueeze(-1), torch.nan, self.assemble(fields))
        length = packed.options.get("length")
        if not isinstance(length, int):
            raise FormatError(f"a packed {self.name} tensor needs its row length (options "
                              f"'length', an int), got {length!r}")
        rows = values.to(torch.float32).reshape(-1, _padded(length, self.block_size))
        rows = rows[:, :length]
        if packed.tensor_scale is not None:
            rows = rows * packed.tensor_scale
        if not packed.shape:
            return rows.reshape(()).to(packed.dtype)
        moved = list(packed.shape)
        moved.append(moved.pop(packed.dim))
        return rows.reshape(moved).movedim(-1, packed.dim).to(packed.dtype)

    # ----- internals -----------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, dim: int, opts: QuantOptions, fast: bool) -> torch.Tensor:
        d = check_tensor(x, dim)
        if x.numel() == 0:
            return x.clone()
        if fast and x.dim() == 2 and has_matrix_kernel(self, x):
            return self._quantize_matrix(x, d, opts)
        rows, restore = to_rows(x, d)
        scale = self._tensor_scale(rows, opts)
        noise = self._noise(rows.shape[0], rows.shape[1], rows.device, opts)
        out = quantize_rows(self, rows, noise, scale) if fast else None
        if out is None:
            out = self._reference_rows(rows if scale is None else rows / scale, noise)
            if scale is not None:
                out = out * scale
        return restore(out)

    def _quantize_matrix(self, x: torch.Tensor, dim: int, opts: QuantOptions) -> torch.Tensor:
        """A matrix quantized along either axis by a strided kernel (no transposed copy),
        with the same scale and noise draws as the row path; only where
        :func:`has_matrix_kernel` holds."""
        scale = self._scale_along(x, dim, opts)
        noise = self._noise(x.shape[1 - dim], x.shape[dim], x.device, opts)
        out = quantize_matrix(self, x, dim, noise, scale)  # widens x where it must
        if out is None:
            raise RuntimeError(f"no matrix kernel for {self.name!r} (check has_matrix_kernel)")
        return out.to(x.dtype)

    def _reference_rows(self, rows: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        length = rows.shape[-1]
        blocks, u = self._to_blocks(rows, noise)
        nan = nonfinite_blocks(blocks)
        values = self.assemble(self.fields(torch.where(nan, 0.0, blocks), u))
        values = torch.where(nan, torch.nan, values)
        return values.to(torch.float32).reshape(rows.shape[0], -1)[:, :length]

    def _to_blocks(self, rows: torch.Tensor,
                   noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zero-padded ``(N, block_size)`` float64 blocks (and noise) of float32 rows."""
        blocks = _pad_rows(rows, self.block_size).to(torch.float64).reshape(-1, self.block_size)
        u = None if noise is None else noise.to(torch.float64).reshape(-1, self.block_size)
        return blocks, u

    def _noise(self, n_rows: int, length: int, device: torch.device,
               opts: QuantOptions) -> torch.Tensor | None:
        """Uniform [0, 1) draws over ``n_rows`` zero-padded rows, shared by every path."""
        if opts.rounding is Rounding.NEAREST:
            return None
        shape = (n_rows, _padded(length, self.block_size))
        return torch.rand(shape, generator=opts.generator, dtype=torch.float32, device=device)

    def _tensor_scale(self, rows: torch.Tensor, opts: QuantOptions) -> torch.Tensor | None:
        """The float32 scale g of ``(N, L)`` rows (blocks see ``rows / g``) on their
        device: a 0-dim tensor, or ``(N, 1)`` with :attr:`vector_scales`; None where
        the format has none (only NVFP4 has one)."""
        return None

    def _scale_along(self, x: torch.Tensor, dim: int,
                     opts: QuantOptions) -> torch.Tensor | None:
        """:meth:`_tensor_scale` of ``x`` quantized along ``dim``, in ``x``'s layout (a
        per-tensor scale does not depend on it)."""
        return self._tensor_scale(x, opts)


def _padded(length: int, block: int) -> int:
    return -(-length // block) * block


def _pad_rows(rows: torch.Tensor, block: int) -> torch.Tensor:
    pad = _padded(rows.shape[-1], block) - rows.shape[-1]
    return torch.nn.functional.pad(rows, (0, pad)) if pad else rows


def to_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, Callable[[torch.Tensor],
                                                                        torch.Tensor]]:
    """View ``x`` as contiguous float32 rows along ``dim``; return the inverse mapping."""
    moved = x.movedim(dim, -1) if x.ndim else x.reshape(1)
    shape = moved.shape
    rows = moved.reshape(-1, shape[-1]).to(torch.float32).contiguous()

    def restore(out: torch.Tensor) -> torch.Tensor:
        y = out.reshape(shape)
        y = y.movedim(-1, dim) if x.ndim else y.reshape(())
        return y.to(x.dtype)

    return rows, restore
