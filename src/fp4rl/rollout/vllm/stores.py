"""How an fp4rl layer of a vLLM engine keeps ``Q(W)`` between weight versions: one store
class per :class:`~fp4rl.rollout.vllm.config.WeightStorage`, which the layer's scheme
(:mod:`.method`) builds. Nothing here imports vLLM at import time.

- :class:`DequantizedStore` (the default): ``Q(W)`` once, in the compute dtype (FP4 values
  are exact in bf16); on a CPU with oneDNN that one copy is vLLM's prepacked GEMM weight,
  as in a plain bf16 engine, so the engine takes no more memory than bf16.
- :class:`PackedStore`: the format's own 4-bit codes and scales, decoded per forward (the
  memory an FP4 GEMM's operand takes; on hardware without FP4 GEMMs the decode costs
  time).
"""

from __future__ import annotations

import contextlib
import ctypes
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from fp4rl.formats import get_format
from fp4rl.gemm import (
    NMOperand,
    Operand,
    PackedCall,
    PackedOperand,
    mm,
    packed_fusion,
    packed_gemm,
)
from fp4rl.rollout.vllm.config import WeightStorage
from fp4rl.rollout.vllm.errors import VLLMError

#: a ``Q(W)`` part of a layer as it arrives: a dense operand or the format's packed fields
Part = Operand | PackedOperand
#: a GEMM the store runs: rows, ``Q(W)`` (values may be empty where a prepacked kernel
#: holds them), and the kernel ``(rows, bias) -> product`` or None
Kernel = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
Gemm = tuple[int, Operand, Kernel | None]


class WeightStore(ABC):
    """``Q(W)`` of one layer as the engine keeps it between weight versions."""

    storage: ClassVar[WeightStorage]
    dtype: torch.dtype

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a forward reads, in a fixed order."""

    @abstractmethod
    def gemms(self) -> list[Gemm]:
        """The GEMMs a forward runs, one per logical layer with its own scale."""

    def takes_nm(self) -> bool:
        """Whether :meth:`apply` multiplies an n:m term (:class:`~fp4rl.gemm.NMOperand`) as
        it is: the recovery then gives its sparse residual in that form (fewer bytes)."""
        return False

    def apply(self, acts: list[Operand | NMOperand], dtype: torch.dtype,
              bias: torch.Tensor | None) -> torch.Tensor:
        """``acts`` (the recovery's activation terms, token rows) times ``Q(W)`` plus the
        bias, in ``dtype``: one GEMM per logical layer with its own scale (NVFP4's
        per-shard scales), joined along the outputs. An n:m term is expanded first."""
        dense = [t if isinstance(t, Operand) else Operand(t.dense()) for t in acts]
        return _by_outputs([(rows, partial(_gemm, dense, qw, kernel, dtype))
                            for rows, qw, kernel in self.gemms()], bias)

    @abstractmethod
    def nbytes(self, in_features: int) -> int:
        """The bytes ``Q(W)`` takes here (a prepacked kernel's copy counted as its values)."""

    def prepacked(self) -> bool:
        """Whether a GEMM runs on a kernel holding its own copy of the weight."""
        return False

    def refilled(self, new: WeightStore, in_place: bool = False) -> WeightStore:
        """This store holding ``new``'s weights, written into its own tensors where the
        layouts (shape, dtype, device of every tensor) agree, else ``new``. ``in_place``
        (a compiled engine: its forward, and the CUDA graphs captured from it, read the
        tensors they traced, at their addresses) refuses a layout change: swapping in
        new tensors would leave the graph reading the old weights, with no error."""
        mine, theirs = self.tensors(), new.tensors()
        changed = self.storage != new.storage or len(mine) != len(theirs) or \
            any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                for a, b in zip(mine, theirs, strict=True))
        if changed and in_place:
            raise VLLMError("a refit changed the layout of a compiled engine's weights "
                            f"({_layout(mine)} -> {_layout(theirs)}); its captured forward "
                            "would keep reading the old ones: send Q(W) in the layout the "
                            "engine was built with, or build it with enforce_eager=True")
        if self.prepacked() or changed:
            return new
        with torch.no_grad():
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b)
        return self


#: one GEMM of a layer: how many of its outputs it gives, and the call, given its bias
OutputGemm = tuple[int, Callable[[torch.Tensor | None], torch.Tensor]]


def _by_outputs(gemms: list[OutputGemm], bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's output from GEMMs that each give some of its outputs (a merged layer's
    parts, or its logical layers), each with its slice of the bias, joined along the
    outputs: the one loop every store's forward runs, whatever computes a GEMM."""
    ys, start = [], 0
    for rows, gemm in gemms:
        ys.append(gemm(None if bias is None else bias[start:start + rows]))
        start += rows
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


def _gemm(acts: list[Operand], qw: Operand, kernel: Kernel | None, dtype: torch.dtype,
          bias: torch.Tensor | None) -> torch.Tensor:
    return mm(acts, qw.t(), dtype, bias, matmul=kernel)


@dataclass
class DequantizedStore(WeightStore):
    """``Q(W)``'s values in the compute dtype, its GEMMs ready (values dropped where a
    prepacked kernel holds them)."""

    storage: ClassVar[WeightStorage] = WeightStorage.DEQUANTIZED
    dtype: torch.dtype
    ready: list[Gemm]

    @classmethod
    def of(cls, parts: list[Part], dtype: torch.dtype, prepack: bool = True
           ) -> DequantizedStore:
        """``parts`` (values, or packed fields decoded here) kept in ``dtype``; with
        ``prepack``, on vLLM's prepacked GEMM weight where there is one."""
        operands = [p.to(dtype) if isinstance(p, Operand) else p.decode(dtype) for p in parts]
        return cls(dtype, _gemms(operands, prepack))

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, op, _ in self.ready for t in _part_tensors(op)]

    def gemms(self) -> list[Gemm]:
        return self.ready

    def nbytes(self, in_features: int) -> int:
        return sum(rows * in_features * self.dtype.itemsize for rows, _, _ in self.ready)

    def prepacked(self) -> bool:
        return any(kernel is not None for _, _, kernel in self.ready)


@dataclass
class PackedStore(WeightStore):
    """``Q(W)`` as the format's 4-bit codes and scales, decoded at every forward."""

    storage: ClassVar[WeightStorage] = WeightStorage.PACKED
    dtype: torch.dtype
    parts: list[PackedOperand]
    #: whether the fused packed GEMM may run (decided when the store is built: a device
    #: and formats with the kernel, bf16, not under vLLM's batch-invariant mode)
    fused: bool = False

    def __post_init__(self) -> None:
        self.calls = [PackedCall.of(p) for p in self.parts]

    @classmethod
    def of(cls, parts: list[PackedOperand], dtype: torch.dtype) -> PackedStore:
        """``parts``' codes and scales kept as they are, multiplied in ``dtype`` (through
        the fused packed GEMM where the device and formats have it)."""
        return cls(dtype, parts, fused=_fuses(parts, dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in _part_tensors(p)]

    def takes_nm(self) -> bool:
        return self.fused  # the fused kernel expands it in registers

    def apply(self, acts: list[Operand | NMOperand], dtype: torch.dtype,
              bias: torch.Tensor | None) -> torch.Tensor:
        """Where the store fuses (a GPU), each part's codes go to the ``fp4rl::packed_mm``
        operator, which decodes them in registers at every token count (split along K
        where few programs would cover the product); elsewhere (and under vLLM's
        batch-invariant mode, which replaces ``aten.mm``, the op the fused kernel would
        bypass) they are decoded into a weight of the compute dtype, then multiplied.
        Nothing here depends on the token count, so a compiled forward traces one graph for
        every batch size."""
        if not self.fused or len(acts) > 2:
            return super().apply(acts, dtype, bias)
        return _by_outputs([(call.rows, partial(packed_gemm, acts, call, dtype))
                            for call in self.calls], bias)

    def gemms(self) -> list[Gemm]:
        decoded = [p.decode(self.dtype) for p in self.parts]
        # fresh tensors each forward: a one-part weight needs no copy
        return [(rows, op, None) for rows, op in _joined(decoded, copy=False)]

    def nbytes(self, in_features: int) -> int:
        return sum(p.nbytes for p in self.parts)


def keep_packed(parts: list[Part], dtype: torch.dtype, prepack: bool = True) -> WeightStore:
    """The store of a layer that keeps ``Q(W)`` packed (``weight_storage: packed``): the
    codes as they are; where a part came as values (an unquantized layer has no codes),
    the layer's parts as values."""
    packed = [p for p in parts if isinstance(p, PackedOperand)]
    if len(packed) == len(parts):
        return PackedStore.of(packed, dtype)
    return DequantizedStore.of(parts, dtype, prepack)


def _fuses(parts: list[PackedOperand], dtype: torch.dtype) -> bool:
    """Whether a packed store of ``parts`` multiplies through the fused packed GEMM: bf16,
    every part's format and device with the kernel (any token count: the operator picks
    by it), not under vLLM's batch-invariant mode."""
    return not _vllm_batch_invariant() and all(
        packed_fusion(get_format(p.packed.format), 1, p.packed.fields["codes"].device, dtype)
        for p in parts)


def _vllm_batch_invariant() -> bool:
    """Whether vLLM runs its batch-invariant mode (``VLLM_BATCH_INVARIANT=1``), as vLLM
    reads it; False where vLLM is not installed (a report run without it)."""
    try:
        from vllm import envs
    except ImportError:
        return False
    return bool(getattr(envs, "VLLM_BATCH_INVARIANT", False))


def release_freed_memory() -> None:
    """Hand the load-time weights this process freed back to the system (glibc keeps freed
    blocks for reuse otherwise, and the engine would look as large as at its peak)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _layout(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} {t.device}"
                     for t in tensors)


def _joined(operands: list[Operand], copy: bool = True) -> list[tuple[int, Operand]]:
    """Parts without a per-tensor scale joined into one operand (one GEMM), in a tensor of
    the store's own (a part may alias what the loader or a refit sent); ``copy=False``
    leaves one part as it is (a packed store's decoded weight, fresh at every forward,
    whose copy was a second pass over it)."""
    if (copy or len(operands) > 1) and all(op.scale is None for op in operands):
        return [(sum(op.values.shape[0] for op in operands),
                 Operand(torch.cat([op.values for op in operands])))]
    return [(op.values.shape[0], op) for op in operands]


def _part_tensors(part: Part) -> list[torch.Tensor]:
    fields = [] if isinstance(part, Operand) else [part.packed.fields[n]
                                                   for n in sorted(part.packed.fields)]
    values = [part.values] if isinstance(part, Operand) else []
    return [*values, *fields, *([] if part.scale is None else [part.scale])]


def _gemms(operands: list[Operand], prepack: bool = True) -> list[Gemm]:
    """The dequantized GEMMs: with ``prepack``, each unscaled operand's values become
    vLLM's prepacked oneDNN weight where there is one (the values themselves are then
    dropped), else stay as they are. A scaled operand (NVFP4's per-tensor scale) is not
    prepacked: its GEMM scales the fp32 products, which the kernel does not return."""
    out: list[Gemm] = []
    for rows, op in _joined(operands):
        kernel = _packed_matmul(op.values) if prepack and op.scale is None else None
        if kernel is not None:
            op = Operand(op.values.new_empty(0, op.values.shape[1]), op.scale)
        out.append((rows, op, kernel))
    return out


def _packed_matmul(values: torch.Tensor
                   ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """``(rows, bias) -> rows @ values.T + bias`` on vLLM's oneDNN kernel with the weight
    prepacked once (the kernel vLLM's own bf16 linears use on CPU; the same bits as
    ``torch.addmm``, about twice as fast at decode sizes), or None where it does not
    apply."""
    if values.device.type != "cpu" or values.dtype != torch.bfloat16:
        return None
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        return None
    try:
        handle = ops.create_onednn_mm(values.t(), 32)
    except RuntimeError:  # a CPU oneDNN has no bf16 matmul for (avx2 only): torch's GEMM,
        return None       # as vLLM's own linears fall back to
    return lambda rows, bias: ops.onednn_mm(handle, rows, bias)


__all__ = ["DequantizedStore", "Gemm", "PackedStore", "Part", "WeightStore", "keep_packed",
           "release_freed_memory"]
