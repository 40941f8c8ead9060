"""Quantized GEMM operands and the matmul that multiplies them in the compute dtype.

Every FP4 value (HiF4, MXFP4, NVFP4's block-scaled part) and every MXFP8 value is exactly
representable in bfloat16, so a quantized operand loses nothing when it is cast to bf16
and multiplied on bf16 hardware with fp32 accumulation, as a tensor core (or a CPU with
avx512_bf16 / AMX) does. The one exception is NVFP4's per-tensor FP32 scale: its product
with a block value need not fit bf16, so an :class:`Operand` keeps that scale outside,
and :func:`mm` applies it to the fp32 result, as NVFP4 hardware does.

``"bf16"`` as an operand format means *not quantized*: the operand enters the GEMM in
the compute dtype unchanged (the paper's BF16 baseline, with FP32 masters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp4rl.formats import get_format
from fp4rl.kernels import quantize_rows_bf16

UNQUANTIZED = "bf16"


@dataclass(frozen=True)
class Operand:
    """A GEMM operand: ``values`` times an optional per-tensor float32 ``scale``."""

    values: torch.Tensor
    scale: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """``values * scale`` in float32: bit for bit what ``fp4rl.quantize`` returns."""
        if self.scale is None:
            return self.values
        return self.values.float() * self.scale

    def t(self) -> Operand:
        return Operand(self.values.t(), self.scale)

    def to(self, dtype: torch.dtype) -> Operand:
        return Operand(self.values.to(dtype), self.scale)


def quantize_operand(x: torch.Tensor, fmt: str, dim: int = -1, stochastic: bool = False,
                     generator: torch.Generator | None = None) -> Operand:
    """``x`` quantized along ``dim`` as a GEMM operand (``"bf16"``: ``x`` itself).

    ``Operand.dense()`` equals ``fp4rl.quantize(x, fmt, dim)`` bit for bit; ``values``
    holds the block-scaled part, exact in bf16.
    """
    if fmt == UNQUANTIZED:
        return Operand(x)
    f = get_format(fmt)
    if not stochastic and x.dim() == 2 and dim in (-1, 1):
        values = quantize_rows_bf16(f.name, x)  # a bf16 engine's activations, one pass
        if values is not None:
            return Operand(values)
    rounding = "stochastic" if stochastic else "nearest"
    scale = f.tensor_scale(x)
    if scale is None:
        return Operand(f.quantize(x, dim, rounding=rounding, generator=generator))
    # The same division the quantizer does internally, so values * scale is its output.
    unscaled = f.quantize(x.float() / scale, dim, rounding=rounding, generator=generator,
                          per_tensor_scale=False)
    return Operand(unscaled, scale)


def mm(a: Operand | list[Operand], b: Operand, dtype: torch.dtype,
       bias: torch.Tensor | None = None,
       matmul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``sum_i a_i @ b (+ bias)`` computed as ``dtype`` hardware would, returned in ``dtype``.

    float32: the dense operands are multiplied in fp32 (the reference simulation). bf16:
    the operands are cast to bf16 (exact), multiplied with fp32 accumulation, and the
    per-tensor scales applied to the fp32 result. Several ``a`` terms share ``b`` (the two
    GEMMs of Rollout-ResQ): they are stacked along the rows so ``b`` is read once, and
    their products summed in fp32. The bias joins the fp32 accumulator, as in ``F.linear``
    (an unquantized operand pair is then bit for bit ``nn.Linear`` under autocast).

    ``matmul`` replaces ``rows @ b.values`` in a low-precision dtype (without a bias): a
    serving engine's prepacked kernel for the same product, which must give the same bits
    (vLLM's oneDNN GEMM does on CPU; tests/vllm_engine checks it layer by layer).
    """
    terms = a if isinstance(a, list) else [a]
    if dtype == torch.float32:
        total = terms[0].dense() if len(terms) == 1 else sum(t.dense() for t in terms)
        return _addmm(total.float(), b.dense().float(), bias, dtype)
    bv = b.values.to(dtype)
    if len(terms) == 1 and terms[0].scale is None and b.scale is None and \
            (matmul is None or bias is not None):
        return _addmm(terms[0].values.to(dtype), bv, bias, dtype)
    stacked = _stack([t.values.to(dtype) for t in terms])
    products = stacked @ bv if matmul is None else matmul(stacked)
    unscaled = b.scale is None and all(t.scale is None for t in terms)
    if len(terms) == 1 and unscaled:
        return products  # no bias here: a prepacked product is already the answer
    if len(terms) == 2 and unscaled and bias is None and dtype == torch.bfloat16:
        # bf16 addition upcasts both, adds in fp32 and rounds once: the same bits as the
        # loop below, in one pass instead of four
        rows = terms[0].values.shape[0]
        return torch.add(products[:rows], products[rows:])
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


def _stack(values: list[torch.Tensor]) -> torch.Tensor:
    """The terms stacked along the rows. Contiguous terms that lie back to back in one
    storage (the fused ResQ kernel writes its two that way) are viewed as one tensor, not
    copied. The storage is compared rather than ``_base``: views made under
    ``torch.inference_mode`` (as in a serving engine) do not record their base. Terms that
    need a gradient are copied, so that each keeps its own path back."""
    if len(values) == 1:
        return values[0]
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


def _addmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    return a @ b if bias is None else torch.addmm(bias.to(dtype), a, b)


__all__ = ["UNQUANTIZED", "Operand", "mm", "quantize_operand"]
