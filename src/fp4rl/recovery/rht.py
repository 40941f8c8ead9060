"""Random Hadamard transform (RHT) of the reduction axis on the rollout.

``X W^T = (X R)(W R)^T`` for the orthonormal ``R = H diag(signs)`` applied per block
of the reduction axis, so quantizing ``X R`` and ``W R`` spreads an outlier's energy
over its block before FP4 sees it. Signs are drawn once per layer (seeded), or redrawn
at every RL step with ``fresh_signs``.
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from fp4rl.errors import RecipeError
from fp4rl.gemm import Operand
from fp4rl.recovery.base import RecoveryConfig, RolloutRecovery, register_recovery
from fp4rl.recovery.hadamard import make_signs, random_hadamard


def hadamard_block(in_features: int, requested: int) -> int:
    """The requested block, or the largest power of two dividing ``in_features`` if smaller.

    SmolLM2's 576 input features, for instance, take 64-wide blocks, not 128.
    """
    return min(requested, in_features & -in_features)


class RHTConfig(RecoveryConfig):
    """block_size: Hadamard block along the reduction axis (a power of two; shrunk to the
    largest power of two dividing in_features); fresh_signs: redraw the signs every RL
    step instead of fixing them per layer."""

    block_size: int = Field(128, description="the Hadamard transform's block along "
                            "in_features")
    fresh_signs: bool = Field(False, description="draw new random signs at every step")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value <= 0 or value & (value - 1):
            raise RecipeError(f"rollout.recovery.block_size must be a power of two, "
                              f"got {value}")
        return value


class RHT(RolloutRecovery):
    config_cls = RHTConfig
    variants = (("", "RHT"),)
    config: RHTConfig
    reads_weight = True  # its weight is rotated before quantization

    def init_state(self) -> None:
        self.block = hadamard_block(self.in_features, self.config.block_size)
        self._generator = torch.Generator().manual_seed(self.seed)
        self.signs = make_signs(self.in_features, self._generator)

    def begin_step(self) -> None:
        if self.config.fresh_signs:
            self.signs = make_signs(self.in_features, self._generator)
            self.version += 1

    def state_dict(self) -> dict[str, object]:
        return {"generator": self._generator.get_state(), "signs": self.signs.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if state:
            generator, signs = state["generator"], state["signs"]
            if not isinstance(generator, torch.Tensor) or not isinstance(signs, torch.Tensor):
                raise TypeError("an RHT state holds the tensors 'generator' and 'signs' "
                                "that state_dict returns")
            self._generator.set_state(generator)
            self.signs = signs
            self.version += 1

    def transform_weight(self, w: torch.Tensor) -> torch.Tensor:
        return random_hadamard(w, self.signs, self.block)

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        return [self.quantize_act(random_hadamard(x, self.signs, self.block))]


register_recovery("rht", RHT)
