"""Quantized GEMM operands and the matmul that multiplies them in the compute dtype.

Every FP4 value (HiF4, MXFP4, NVFP4's block-scaled part) and every MXFP8 value is exactly
representable in bfloat16, so a quantized operand loses nothing when it is cast to bf16
and multiplied on bf16 hardware with fp32 accumulation, as a tensor core (or a CPU with
avx512_bf16 / AMX) does. The one exception is NVFP4's FP32 scale on top of the blocks: its
product with a block value need not fit bf16, so an :class:`Operand` keeps that scale
outside, and :func:`mm` applies it to the fp32 result, as NVFP4 hardware does. The scale
is one per tensor, or one per vector along the operand's other axis (``nvfp4_per_token``:
a scale per token), which scales a row or a column of the product.

``"none"`` (:data:`UNQUANTIZED`) as an operand format means *not quantized*: the operand
enters the GEMM in the compute dtype unchanged (the paper's BF16 baseline, with FP32
masters; FP32 throughout under ``mixed_precision: no``). It is not the number format
``bf16``, which rounds to bfloat16 and back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Final, cast

import torch

from fp4rl.formats import NumberFormat, get_format
from fp4rl.formats.base import QuantizeKwargs
from fp4rl.formats.packing import PackedTensor
from fp4rl.formats.row_decode import decode_rows
from fp4rl.formats.row_encode import encode_rows
from fp4rl.kernels import (
    cpu_ops,
    has_packed_mm,
    has_qmm,
    packed_mm,
    qmm,
    quantize_both,
    quantize_matrix_values,
    quantize_rows_bf16,
)
from fp4rl.kernels.cpu import BI_CHUNK, BI_NO_RUNS
from fp4rl.kernels.dispatch import triton_for


class NotQuantized:
    """The operand format that leaves an operand as it is: one object,
    :data:`UNQUANTIZED`, named ``none``, which a recipe holds beside the number formats
    it quantizes with (and reads a typed ``bf16`` as). It is no number format: nothing
    rounds, and the GEMM gets the operand in the compute dtype."""

    name: Final = "none"
    #: how tables write it: the paper's BF16 baseline (the compute dtype, unquantized)
    display_name: Final = "BF16"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return "UNQUANTIZED"

    def __reduce__(self) -> str:
        return "UNQUANTIZED"  # pickles and copies as the one object of this module


#: the operand format that leaves an operand as it is (a recipe reads ``bf16`` as it)
UNQUANTIZED: Final = NotQuantized()
#: what an operand is quantized with: a number format, or :data:`UNQUANTIZED`
OperandFormat = NumberFormat | NotQuantized


def operand_format(name: str) -> OperandFormat:
    """The operand format object ``name`` names (``none``: :data:`UNQUANTIZED`; a
    registered format's name, case-insensitive): where a name is read, as a recipe reads
    its operands; the functions below take the object."""
    if name.lower() == UNQUANTIZED.name:
        return UNQUANTIZED
    return get_format(name)


def has_tensor_scale(fmt: OperandFormat) -> bool:
    """Whether operands in ``fmt`` carry a float32 scale outside their values (NVFP4's),
    which an unquantized operand never does."""
    return isinstance(fmt, NumberFormat) and fmt.has_tensor_scale


@dataclass(frozen=True)
class Operand:
    """A GEMM operand: ``values`` times an optional float32 ``scale``, 0-dim (per tensor)
    or one per vector along the axis the GEMM does not reduce (``(rows, 1)`` for a left
    operand, ``(1, cols)`` for a right one), so that it factors out of every sum."""

    values: torch.Tensor
    scale: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """``values * scale`` in float32: bit for bit what ``fp4rl.quantize`` returns."""
        if self.scale is None:
            return self.values
        return self.values.float() * self.scale

    @property
    def nbytes(self) -> int:
        """Bytes of the values (and the scales', 4 each)."""
        return self.values.numel() * self.values.element_size() + \
            (4 * self.scale.numel() if self.scale is not None else 0)

    def t(self) -> Operand:
        return Operand(self.values.t(), None if self.scale is None else self.scale.t())

    def to(self, dtype: torch.dtype) -> Operand:
        return Operand(self.values.to(dtype), self.scale)



@dataclass(frozen=True)
class NMOperand:
    """A left GEMM operand kept as n:m sparse tensor cores take one: of each ``group``
    values along a row, the ``keep`` kept ones in order (``values``, bf16,
    ``(rows, groups * keep)``) and a bit per kept position (``bits``, uint8,
    ``(rows, groups)``, bit j of a group's byte for its position j); ``cols`` is the dense
    width. ResQ's residual term takes this form where the packed GEMM expands it in
    registers (:func:`packed_gemm`), so that the pass before the GEMM writes, and the GEMM
    reads, 0.625x a dense bf16 term's bytes at 2:4. It has no scale (the ResQ kernels take
    formats without a per-tensor one)."""

    values: torch.Tensor
    bits: torch.Tensor
    keep: int
    group: int
    cols: int
    scale: None = None

    def dense(self) -> torch.Tensor:
        """The dense operand (``values``' dtype, ``(rows, cols)``): each kept value at its
        position, +0 elsewhere, bit for bit the dense term the ResQ kernel writes."""
        rows, groups = self.bits.shape
        pos = torch.arange(self.group, device=self.bits.device)
        kept = (self.bits.to(torch.int32)[..., None] >> pos) & 1  # (rows, groups, group)
        slot = (kept.cumsum(-1) - kept).clamp(max=self.keep - 1)
        picked = self.values.reshape(rows, groups, self.keep).gather(2, slot.long())
        out = torch.where(kept.bool(), picked, torch.zeros((), dtype=self.values.dtype,
                                                           device=self.values.device))
        return out.reshape(rows, groups * self.group)[:, :self.cols]

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.bits.numel()


def quantize_operand(x: torch.Tensor, fmt: OperandFormat, dim: int = -1,
                     stochastic: bool = False, generator: torch.Generator | None = None,
                     tensor_scale: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> Operand:
    """``x`` quantized along ``dim`` as a GEMM operand (:data:`UNQUANTIZED`: ``x`` itself).

    ``Operand.dense()`` equals ``fp4rl.quantize(x, fmt, dim)`` bit for bit; ``values``
    holds the block-scaled part, exact in bf16. A format with a per-tensor scale takes
    ``tensor_scale`` when given (the whole weight's, for a shard of it). ``out_dtype``:
    the values in that dtype (``quantize_operand(...).to(out_dtype)``, bit for bit), which
    a GPU kernel writes directly (a matrix, nearest rounding).
    """
    if isinstance(fmt, NotQuantized):
        return Operand(x) if out_dtype is None else Operand(x).to(out_dtype)
    scale = fmt.tensor_scale(x, dim) if tensor_scale is None else tensor_scale
    if out_dtype is not None and not stochastic and out_dtype in (torch.bfloat16,
                                                                   torch.float32):
        values = quantize_matrix_values(fmt, x, dim, scale, out_dtype)
        if values is not None:
            return Operand(values, scale)
    if out_dtype is not None:
        return quantize_operand(x, fmt, dim, stochastic, generator, scale).to(out_dtype)
    if not stochastic and x.dim() == 2 and dim in (-1, 1):
        # a bf16 engine's activations: read and written once, in bf16
        values = quantize_rows_bf16(fmt, x, scale)
        if values is not None:
            return Operand(values, scale)
    rounding = "stochastic" if stochastic else "nearest"
    if scale is None:
        return Operand(fmt.quantize(x, dim, rounding=rounding, generator=generator))
    # The same division the quantizer does internally, so values * scale is its output.
    unscaled = fmt.quantize(x.float() / scale, dim, rounding=rounding, generator=generator,
                            per_tensor_scale=False)
    return Operand(unscaled, scale)


def quantize_operand_pair(x: torch.Tensor, fmt: OperandFormat,
                          out_dtype: torch.dtype | None = None) -> tuple[Operand, Operand]:
    """``x`` (a matrix) quantized along its rows and along its columns, nearest rounding:
    ``(quantize_operand(x, fmt, -1, out_dtype=...), quantize_operand(x, fmt, 0, ...))``
    bit for bit, the values in ``out_dtype`` (default ``x``'s). Where a kernel takes both
    (Triton on a GPU; a format whose scales are per block, or one per tensor, which both
    axes share) ``x`` is read once for the two, as a GEMM operand and its backward
    GEMM's are needed together (the weight's forward and input-gradient operands, the
    activation's forward and weight-gradient ones, the output gradient's two)."""
    dtype = out_dtype or x.dtype
    if isinstance(fmt, NumberFormat) and x.dim() == 2 and not fmt.vector_scales:
        scale = fmt.tensor_scale(x, -1)
        both = quantize_both(fmt, x, scale, dtype)
        if both is not None:
            return Operand(both[0], scale), Operand(both[1], scale)
    return (quantize_operand(x, fmt, -1, out_dtype=out_dtype),
            quantize_operand(x, fmt, 0, out_dtype=out_dtype))


@dataclass(frozen=True)
class OnLoad:
    """A GEMM operand that the GEMM quantizes as it loads it (:func:`mm_on_load`): the
    high-precision ``source`` laid out as the GEMM reads it (``(rows, K)`` on the left,
    ``(K, cols)`` on the right; a transposed view is read in place), its ``fmt`` blocked
    along K, and the per-tensor or per-vector ``scale`` the source is divided by first and
    the product multiplied by after, as an :class:`Operand` keeps it. No quantized copy of
    it is ever in memory."""

    source: torch.Tensor
    fmt: NumberFormat
    scale: torch.Tensor | None = None

    def t(self) -> OnLoad:
        return OnLoad(self.source.t(), self.fmt, None if self.scale is None else self.scale.t())


def on_load(x: torch.Tensor, fmt: NumberFormat, dim: int = -1,
            tensor_scale: torch.Tensor | None = None) -> OnLoad:
    """``x`` as an operand quantized along ``dim`` on load: the same scale
    :func:`quantize_operand` computes (``tensor_scale`` when given), so that
    :func:`mm_on_load` multiplies what ``quantize_operand(x, fmt, dim)`` holds."""
    return OnLoad(x, fmt, fmt.tensor_scale(x, dim) if tensor_scale is None else tensor_scale)


def quantizes_on_load(fmt: OperandFormat, x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`mm_on_load` takes operands of ``x``'s device and type in ``fmt`` in a
    ``dtype`` GEMM: a format with the kernel (:func:`fp4rl.kernels.has_qmm`), a bf16 GEMM,
    a float32 or bf16 source, outside a batch-invariant forward (the kernel's reduction
    order is its own)."""
    return (isinstance(fmt, NumberFormat) and dtype == torch.bfloat16 and
            x.dtype in (torch.float32, torch.bfloat16) and has_qmm(fmt, x.device) and
            not fixed_order())


def mm_on_load(a: OnLoad, b: Operand | OnLoad, dtype: torch.dtype,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """``mm(quantize(a), quantize(b), dtype, bias)`` in one kernel that quantizes each tile
    of ``a`` (and of ``b`` where it is an :class:`OnLoad`) in registers as it loads it
    (:mod:`fp4rl.kernels.triton_qmm`), with :func:`mm`'s epilogue; the result stored in
    ``out_dtype`` (default ``dtype``; a float32 gradient's bf16 value exactly, without a
    cast pass). For callers that checked :func:`quantizes_on_load` for every on-load
    operand."""
    b_source, b_fmt = (b.source, b.fmt) if isinstance(b, OnLoad) else (b.values.to(dtype), None)
    if bias is not None and a.scale is None and b.scale is None:
        bias = bias.to(dtype)  # as mm's one unscaled product (nn.Linear under autocast)
    y = qmm(a.source, a.fmt, a.scale, b_source, b_fmt, b.scale, bias, out_dtype or dtype)
    if y is None:
        raise RuntimeError("mm_on_load without the kernel: check quantizes_on_load first")
    return y


@dataclass(frozen=True)
class PackedOperand:
    """A weight operand as FP4 hardware holds it: the format's packed codes and scale
    fields of ``values`` (rows along the last axis), with NVFP4's per-tensor ``scale``
    outside, as in :class:`Operand`. ``decode()`` is the :class:`Operand` that
    :func:`quantize_operand` gives for the same weight, bit for bit."""

    packed: PackedTensor
    scale: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales (and the per-tensor scale's 4)."""
        return self.packed.nbytes + (4 if self.scale is not None else 0)

    def decode(self, dtype: torch.dtype = torch.float32) -> Operand:
        """The values in ``dtype``, through the ``fp4rl::decode_rows`` operator (a
        compiled forward that decodes per call, as a packed engine does, traces it)."""
        p = self.packed
        names = sorted(p.fields)
        values = torch.ops.fp4rl.decode_rows([p.fields[n] for n in names], ",".join(names),
                                             p.format, p.shape[0], p.shape[1], p.dim, dtype)
        return Operand(values, self.scale)

    def row_fields(self) -> dict[str, torch.Tensor]:
        """Each field laid out as ``[rows, bytes per row]``: block fields run row-major,
        so row slices and row concatenations of a weight are slices and concatenations
        of these (a merged linear's parts, a tensor-parallel shard)."""
        return {k: v.reshape(self.rows, -1) for k, v in self.packed.fields.items()}

    @staticmethod
    def layout(fmt: NumberFormat, cols: int) -> PackedTensor:
        """One packed row of ``cols`` values: the fields' names and per-row shapes."""
        opts: QuantizeKwargs = {"per_tensor_scale": False} if fmt.has_tensor_scale else {}
        return fmt.encode(torch.zeros(1, cols), dim=-1, **opts)

    @classmethod
    def from_row_fields(cls, fmt: NumberFormat, shape: tuple[int, int],
                        fields: dict[str, torch.Tensor],
                        scale: torch.Tensor | None = None) -> PackedOperand:
        """The inverse of :meth:`row_fields` for a ``shape`` (rows, in_features) weight."""
        rows, cols = shape
        layout = cls.layout(fmt, cols)
        unknown = sorted(set(fields) ^ set(layout.fields))
        if unknown:
            raise ValueError(f"{fmt} packed weight fields are {sorted(layout.fields)}, got "
                             f"{sorted(fields)}")
        out = {k: fields[k].reshape(rows * one.shape[0], *one.shape[1:])
               for k, one in layout.fields.items()}
        packed = PackedTensor(fmt.name, (rows, cols), 1, torch.float32, out, None,
                              dict(layout.options))
        return cls(packed, scale)


@cache
def _row_options(fmt: str, cols: int) -> tuple[tuple[str, object], ...]:
    # an operator's arguments are names (``fp4rl::decode_rows``): read back here
    return tuple(PackedOperand.layout(get_format(fmt), cols).options.items())


@torch.library.custom_op("fp4rl::decode_rows", mutates_args=())
def _decode_rows(fields: list[torch.Tensor], names: str, fmt: str, rows: int,
                 cols: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A packed 2-D operand's values (:func:`~fp4rl.formats.row_decode.decode_rows`) in
    ``dtype``, from its fields (``names``, comma-separated, in order)."""
    by_name = dict(zip(names.split(","), fields, strict=True))
    packed = PackedTensor(fmt, (rows, cols), dim, torch.float32, by_name, None,
                          dict(_row_options(fmt, cols)))
    return decode_rows(packed, dtype)


@_decode_rows.register_fake
def _(fields: list[torch.Tensor], names: str, fmt: str, rows: int, cols: int, dim: int,
      dtype: torch.dtype) -> torch.Tensor:
    return fields[0].new_empty((rows, cols), dtype=dtype)


def pack_operand(x: torch.Tensor, fmt: NumberFormat, tensor_scale: torch.Tensor | None = None
                 ) -> PackedOperand:
    """``x`` (rows along the last axis) in the format's packed codes and scales: what
    :func:`quantize_operand` computes along the rows, stored in 4 bits. A format with a
    per-tensor scale takes ``tensor_scale`` when given (the whole weight's, for a shard
    of it), else computes it from ``x``."""
    scale = fmt.tensor_scale(x) if tensor_scale is None else tensor_scale
    rows = x.float() if scale is None else x.float() / scale
    packed = encode_rows(fmt.name, rows) if rows.dim() == 2 else None
    if packed is None:
        opts: QuantizeKwargs = {} if scale is None else {"per_tensor_scale": False}
        packed = fmt.encode(rows, dim=-1, **opts)
    return PackedOperand(packed, scale)


def mm(a: Operand | list[Operand], b: Operand, dtype: torch.dtype,
       bias: torch.Tensor | None = None,
       matmul: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
       ) -> torch.Tensor:
    """``sum_i a_i @ b (+ bias)`` computed as ``dtype`` hardware would, returned in ``dtype``.

    float32: the dense operands are multiplied in fp32 (the reference simulation). bf16:
    the operands are cast to bf16 (exact), multiplied with fp32 accumulation, and the
    per-tensor scales applied to the fp32 accumulators, which round to bf16 once (as a
    block-scaled GEMM's epilogue does: rounding the product first and scaling after would
    round twice). Several ``a`` terms share ``b`` (the two GEMMs of Rollout-ResQ): they are
    stacked along the rows so ``b`` is read once, their fp32 products summed, the sum
    rounded once. The bias joins the fp32 accumulator, as in ``F.linear`` (an unquantized
    operand pair is then bit for bit ``nn.Linear`` under autocast).

    ``matmul(rows, bias)`` replaces ``rows @ b.values (+ bias)`` for one unscaled term in a
    low-precision dtype: a serving engine's prepacked kernel for the same product, which
    must give the same bits (vLLM's oneDNN GEMM does on CPU; tests/vllm_engine checks it
    layer by layer). ``b``'s values are then not read (the kernel holds them). A scaled or
    several-term GEMM needs the fp32 products, which such a kernel does not return: it
    reads ``b``'s values.
    """
    terms = a if isinstance(a, list) else [a]
    _check_scales(terms, b)
    if dtype == torch.float32:
        # sum's stub adds its int start (0) to the type; terms are never empty
        total = terms[0].dense() if len(terms) == 1 else \
            cast(torch.Tensor, sum(t.dense() for t in terms))
        return _addmm(total.float(), b.dense().float(), bias, dtype)
    single = len(terms) == 1 and terms[0].scale is None and b.scale is None
    if single:
        lhs = terms[0].values.to(dtype)
        return _addmm(lhs, b.values.to(dtype), bias, dtype) if matmul is None \
            else matmul(lhs, bias)
    if matmul is not None and b.values.numel() == 0:
        raise ValueError("a prepacked kernel returns products rounded to "
                         f"{dtype}; a scaled or several-term GEMM needs them in fp32 "
                         "(build the store without prepacking for it)")
    stacked = stack_rows([t.values.to(dtype) for t in terms])
    # the fp32 accumulators, unrounded: each term's scale and the sum of the terms are
    # applied to them, and the result rounds to dtype once (as a GEMM epilogue does)
    products = mm_fp32(stacked, b.values.to(dtype))
    y: torch.Tensor | None = None
    start = 0
    for t in terms:  # each term's product in fp32, scaled, summed in place (one pass each)
        rows = t.values.shape[0]
        part = products[start:start + rows].float()
        if t.scale is not None:
            part.mul_(t.scale)
        y = part if y is None else y.add_(part)
        start += rows
    assert y is not None
    if b.scale is not None:
        y.mul_(b.scale)
    if bias is not None:
        y.add_(bias.float())
    return y.to(dtype)


def fuses_packed(a: Operand | list[Operand], w: PackedOperand, dtype: torch.dtype) -> bool:
    """Whether :func:`mm_packed` multiplies ``a`` by ``w`` in one kernel that decodes the
    codes in registers (:func:`packed_fusion`)."""
    terms = a if isinstance(a, list) else [a]
    rows = terms[0].values
    return packed_fusion(get_format(w.packed.format), rows.shape[0], rows.device, dtype,
                         len(terms))


def packed_fusion(fmt: NumberFormat, tokens: int, device: torch.device, dtype: torch.dtype,
                  terms: int = 1) -> bool:
    """Whether ``tokens`` rows (``terms`` activation terms) times a weight packed in
    ``fmt`` run as one fused kernel: bf16, one or two terms (ResQ's), a format and device
    with the kernel (Triton on a GPU), outside a batch-invariant forward. At any token
    count (``tokens`` does not limit it): the kernel decodes each weight tile in registers
    for a decode step and a prefill alike, and picks its tile height and its split of K by
    the token count (:func:`~fp4rl.kernels.triton_packed_mm.k_split`), which is why a
    batch-invariant forward does without it."""
    return (dtype == torch.bfloat16 and terms <= 2 and has_packed_mm(fmt, device) and
            not fixed_order())


def fixed_order() -> bool:
    """Whether a dispatch mode that fixes every GEMM's reduction order is active
    (``fixed_reduction_order`` on the mode: fp4rl's batch-invariant forward): it replaces
    ``aten.mm``, which the fused kernel would bypass; and the fused kernel's reduction order
    depends on the token count (its tile height, and the split of K it takes at a few
    tokens), so it steps aside there rather than keep it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(getattr(m, "fixed_reduction_order", False)
               for m in _get_current_dispatch_mode_stack())


def mm_packed(a: Operand | list[Operand], w: PackedOperand, dtype: torch.dtype,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``mm(a, w.decode(dtype).t(), dtype, bias)``: ``a`` times a weight kept packed
    (``(out, in)``, rows along ``in``). Where :func:`fuses_packed` holds, one kernel reads
    the 4-bit codes and scales once and decodes each weight tile in registers (a rollout's
    decode step reads about a quarter of a bf16 weight's bytes, not the codes, a bf16
    buffer written and read back); the same decoded values and the same epilogue, so only
    the GEMM's accumulation order differs. Elsewhere the weight is decoded, then
    multiplied."""
    terms = a if isinstance(a, list) else [a]
    if not fuses_packed(terms, w, dtype):
        return mm(terms, w.decode(dtype).t(), dtype, bias)
    return packed_gemm(terms, PackedCall.of(w), dtype, bias)


@dataclass(frozen=True)
class PackedCall:
    """A packed weight as the ``fp4rl::packed_mm`` operator takes it, resolved once (a
    serving engine's compiled forward then traces no name lookup or string work)."""

    fields: list[torch.Tensor]
    names: str
    fmt: str
    rows: int
    cols: int
    scale: torch.Tensor | None

    @classmethod
    def of(cls, w: PackedOperand) -> PackedCall:
        fields = w.row_fields()
        names = sorted(fields)
        return cls([fields[n] for n in names], ",".join(names), w.packed.format, w.rows,
                   w.packed.shape[1], w.scale)


def packed_gemm(terms: Sequence[Operand | NMOperand], w: PackedCall, dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``terms`` (one or two, bf16; ResQ's second may be an :class:`NMOperand`, expanded in
    registers) times ``w`` through the ``fp4rl::packed_mm`` operator, which takes the fused
    kernel at any token count where the device has it; for a caller that has checked
    :func:`packed_fusion`."""
    dense = [t for t in terms if isinstance(t, Operand)]
    nm = terms[1] if len(terms) == 2 and isinstance(terms[1], NMOperand) else None
    _check_scales(dense)
    if bias is not None and len(terms) == 1 and dense[0].scale is None and w.scale is None:
        bias = bias.to(dtype)  # as mm's one unscaled product (nn.Linear under autocast)
    y: torch.Tensor = torch.ops.fp4rl.packed_mm(
        stack_rows([t.values.to(dtype) for t in dense]), w.fields, w.names, w.fmt, w.rows,
        w.cols, len(terms), dense[0].scale, dense[1].scale if len(dense) == 2 else None,
        w.scale, bias, None if nm is None else nm.values, None if nm is None else nm.bits,
        0 if nm is None else nm.keep, 0 if nm is None else nm.group)
    return y


@torch.library.custom_op("fp4rl::packed_mm", mutates_args=())
def _packed_mm(a: torch.Tensor, fields: list[torch.Tensor], names: str, fmt: str, rows: int,
               cols: int, terms: int, s0: torch.Tensor | None, s1: torch.Tensor | None,
               ws: torch.Tensor | None, bias: torch.Tensor | None,
               r_values: torch.Tensor | None = None, r_bits: torch.Tensor | None = None,
               keep: int = 0, group: int = 0) -> torch.Tensor:
    """``terms`` bf16 activation terms stacked along the rows (scales ``s0``, ``s1``) times
    the packed ``(rows, cols)`` weight (row fields ``names``, comma-separated, in order;
    scale ``ws``), in bf16: the fused kernel (its tile height and split of K chosen by the
    token count inside, when the operator runs, so that a compiled forward traced with a
    symbolic batch size holds no branch on it), or where there is no kernel for ``a``'s
    device the decode and :func:`mm`. With ``r_values`` the second term is n:m sparse
    (:class:`NMOperand`: ``r_values``, ``r_bits``, ``keep`` of each ``group``) and ``a``
    holds the first alone."""
    by_name = dict(zip(names.split(","), fields, strict=True))
    f = get_format(fmt)
    scales = [s0, s1][:terms]
    nm = None if r_values is None or r_bits is None else \
        NMOperand(r_values, r_bits, keep, group, cols)
    y = packed_mm(f, a, terms, by_name, rows, cols, scales, ws, bias,
                  None if nm is None else (nm.values, nm.bits, keep, group))
    if y is not None:
        return y
    w = PackedOperand.from_row_fields(f, (rows, cols), by_name, ws).decode(a.dtype)
    if nm is not None:
        a = torch.cat([a, nm.dense()])
    m = a.shape[0] // terms
    ops = [Operand(a[i * m:(i + 1) * m], s) for i, s in enumerate(scales)]
    return mm(ops, w.t(), a.dtype, bias)


@_packed_mm.register_fake
def _(a: torch.Tensor, fields: list[torch.Tensor], names: str, fmt: str, rows: int,
      cols: int, terms: int, s0: torch.Tensor | None, s1: torch.Tensor | None,
      ws: torch.Tensor | None, bias: torch.Tensor | None,
      r_values: torch.Tensor | None = None, r_bits: torch.Tensor | None = None,
      keep: int = 0, group: int = 0) -> torch.Tensor:
    return a.new_empty((a.shape[0] // (terms if r_values is None else 1), rows))


def _check_scales(terms: list[Operand], b: Operand | None = None) -> None:
    """Refuse a per-vector scale along the reduction axis: it does not factor out of the
    sums (an operand quantized per token, then multiplied along its tokens)."""
    for t in terms:
        if t.scale is not None and t.scale.dim() == 2 and t.scale.shape[1] != 1:
            raise ValueError("a left GEMM operand's scale must be per tensor or per row, "
                             f"got {tuple(t.scale.shape)} for {tuple(t.values.shape)}")
    if b is not None and b.scale is not None and b.scale.dim() == 2 and b.scale.shape[0] != 1:
        raise ValueError("a right GEMM operand's scale must be per tensor or per column, "
                         f"got {tuple(b.scale.shape)} for {tuple(b.values.shape)}")


def stack_rows(values: list[torch.Tensor]) -> torch.Tensor:
    """The terms stacked along the rows. Contiguous terms that lie back to back in one
    storage (the fused ResQ kernel writes its two that way) are viewed as one tensor, not
    copied. The storage is compared rather than ``_base``: views made under
    ``torch.inference_mode`` (as in a serving engine) do not record their base. Terms that
    need a gradient are copied, so that each keeps its own path back. Under a tracer
    (``torch.compile``) storage addresses are not known: the terms are concatenated, and
    the compiler may elide the copy."""
    if len(values) == 1:
        return values[0]
    if torch.compiler.is_compiling():
        return torch.cat(values)
    first = values[0]
    storage, at = first.untyped_storage().data_ptr(), first.data_ptr()
    for v in values:
        alike = v.shape[1:] == first.shape[1:] and v.dtype == first.dtype
        if v.requires_grad or not alike or not v.is_contiguous() or \
                v.untyped_storage().data_ptr() != storage or v.data_ptr() != at:
            return torch.cat(values)
        at += v.numel() * v.element_size()
    shape = (sum(v.shape[0] for v in values), *first.shape[1:])
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return first.as_strided(shape, strides)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 (or fp16) operands with fp32 accumulation, returned in fp32
    without rounding to the operands' dtype: on a GPU (and on ``meta``, which stands for
    it) one GEMM with an fp32 output (``torch.mm(..., out_dtype=torch.float32)``); under a
    batch-invariant forward the same call, which the mode's fixed-order kernel computes
    from the bf16 operands as they are. On a CPU, which has no such GEMM in torch, fp4rl's
    C GEMM (the ``fp4rl::c_mm_fp32`` operator over :func:`fp4rl.kernels.cpu.bi_gemm`: bf16
    read as it is, the tile unit where the CPU has AMX, the weight packed once per version
    inside ``hold_weights``; one op to a compiled graph): in the batch-invariant forward
    that mode's own order (runs of 64 k's), elsewhere each output's one sum in the
    hardware's fastest order (on AMX the tiles accumulate all of K); else the fp32
    product of widened copies (bf16 values and their products are exact in fp32, so it is
    the same sum of the same products, in the library's order)."""
    tracked = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if a.dtype == b.dtype == torch.bfloat16 and a.dim() == 2 and a.device.type == "cpu" and \
            not tracked and triton_for(a.device) is None and cpu_ops.available():
        # a compiled graph runs outside the batch-invariant mode (which is eager-only)
        fixed = not torch.compiler.is_compiling() and fixed_order()
        return cpu_ops.mm_fp32(a, b, BI_CHUNK if fixed else BI_NO_RUNS)
    if a.dtype in (torch.bfloat16, torch.float16) and (
            a.device.type in ("cuda", "meta") or fixed_order()):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _addmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    return a @ b if bias is None else torch.addmm(bias.to(dtype), a, b)


__all__ = ["UNQUANTIZED", "NMOperand", "NotQuantized", "OnLoad", "Operand", "OperandFormat",
           "PackedCall", "PackedOperand", "fixed_order", "fuses_packed", "has_tensor_scale", "mm",
           "mm_fp32", "mm_on_load", "mm_packed", "on_load", "operand_format", "pack_operand",
           "packed_fusion", "packed_gemm", "quantize_operand", "quantize_operand_pair",
           "quantizes_on_load", "stack_rows"]
