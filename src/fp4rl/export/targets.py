"""Which linear layers an export quantizes, and whether their shapes allow it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fp4rl.errors import UserError
from fp4rl.nn.patch import in_transformer_block


class ExportError(UserError):
    """A model or an output that cannot be exported as asked; the message says why."""


def block_linears(model: nn.Module, ignores: Callable[[str], bool]) -> dict[str, nn.Linear]:
    """The linears ``fp4rl.quantize_model`` would patch: every linear of every transformer
    block (not the embeddings, not lm_head) that ``ignores`` does not leave out. An export
    quantizes what training quantized, and nothing else."""
    return {name: module for name, module in model.named_modules()
            if in_transformer_block(module, name) and not ignores(name)}


def check_blocks(layers: dict[str, nn.Linear], fmt: str, block_size: int) -> None:
    """Fail, naming the first layer, unless every input dimension splits into whole blocks.

    The formats quantize each weight row in blocks along in_features, and the stored layouts
    (compressed-tensors' and fp4rl's) hold whole blocks only, with no padding."""
    for name, layer in layers.items():
        if layer.in_features % block_size:
            raise ExportError(
                f"cannot export {name} in {fmt}: its in_features ({layer.in_features}) is not "
                f"a multiple of the {fmt} block size {block_size}; export this model as bf16 "
                f"or in a format whose block divides {layer.in_features}")
