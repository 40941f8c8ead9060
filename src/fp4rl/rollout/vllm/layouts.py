"""The weight layouts of the ``fp4rl`` method: how a layer makes ``Q(W)`` from a loaded
weight, what ready-made parts it may keep, which store keeps them, one per
:class:`~fp4rl.rollout.vllm.config.WeightStorage`.

:mod:`.loading` asks a layer's layout these three things and nothing here calls back:
the scheme (:mod:`.method`) hands vLLM's calls to the loading code, which asks the
layout, so each call runs one way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from fp4rl.formats import NumberFormat
from fp4rl.gemm import Operand
from fp4rl.rollout.vllm.config import WeightStorage
from fp4rl.rollout.vllm.errors import VLLMError
from fp4rl.rollout.vllm.stores import DequantizedStore, Part, WeightStore, keep_packed

if TYPE_CHECKING:
    from fp4rl.rollout.vllm.loading import LayerState


class Layout(ABC):
    """What the layouts share: ``Q(W)`` made by the layer's recovery (as values, or as
    codes where the layout packs), and any ready-made part accepted."""

    #: the ``weight_storage`` this layout serves
    storage: ClassVar[WeightStorage]
    #: whether ``Q(W)`` made from a loaded weight is kept as the format's codes
    packs: ClassVar[bool] = False

    def quantize(self, state: LayerState, shard: torch.Tensor,
                 tensor_scale: torch.Tensor | None) -> Part:
        """``Q(W)`` of one logical layer's loaded weight ``shard``, as the layout keeps it."""
        return state.recovery.weight_operand(shard, packed=self.packs,
                                             tensor_scale=tensor_scale)

    def accept(self, state: LayerState, parts: list[Part]) -> None:  # noqa: B027
        """Either wire's parts: values are kept as they are, codes decoded once (a
        layout that cannot keep one refuses it here, in one line)."""

    @abstractmethod
    def keep(self, state: LayerState, parts: list[Part]) -> WeightStore:
        """The store holding ``parts``."""


class DequantizedLayout(Layout):
    """``Q(W)``'s values in the compute dtype, multiplied by vLLM's own GEMM (its prepacked
    oneDNN weight on a CPU): a bf16 engine's memory, a bf16 GEMM's speed."""

    storage: ClassVar[WeightStorage] = WeightStorage.DEQUANTIZED

    def keep(self, state: LayerState, parts: list[Part]) -> WeightStore:
        return DequantizedStore.of(parts, state.dtype, state.prepack)


class PackedLayout(Layout):
    """``Q(W)`` as the format's 4-bit codes and scales, decoded at each forward (in
    registers, by the fused packed GEMM, at decode sizes on a GPU)."""

    storage: ClassVar[WeightStorage] = WeightStorage.PACKED
    packs: ClassVar[bool] = True

    def accept(self, state: LayerState, parts: list[Part]) -> None:
        if isinstance(state.fmt, NumberFormat) and any(isinstance(p, Operand) for p in parts):
            raise VLLMError("an engine with weight_storage=packed keeps the 4-bit codes it is "
                            "sent: refit it with the packed wire (refit(..., packed=True), "
                            "rollout.vllm.refit_wire=packed)")

    def keep(self, state: LayerState, parts: list[Part]) -> WeightStore:
        return keep_packed(parts, state.dtype, state.prepack)


#: the layout of each weight storage
LAYOUTS: dict[WeightStorage, Layout] = {
    layout.storage: layout for layout in (DequantizedLayout(), PackedLayout())}


__all__ = ["LAYOUTS", "DequantizedLayout", "Layout", "PackedLayout"]
