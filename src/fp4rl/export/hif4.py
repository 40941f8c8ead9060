"""HiF4 export: fp4rl's packed directory, the real 4.5-bit codes of every block linear.

No serving stack reads HiF4 yet, so the layout is fp4rl's own (``fp4rl.models.packed``):
``fp4rl.models.load_model(DIR)`` decodes it, and ``docs/integrations.md`` specifies it
byte by byte for other runtimes.
"""

from __future__ import annotations

from torch import nn

from fp4rl.export.directory import UNQUANTIZED_DTYPE, Payload, unquantized_tensors
from fp4rl.formats import get_format
from fp4rl.models.packed import DESCRIPTION, WEIGHTS_PATTERN, describe, field_tensors

FORMAT = "hif4"


def hif4_payload(model: nn.Module, layers: dict[str, nn.Linear]) -> Payload:
    """``layers`` as HiF4 codes and scales along in_features, every other tensor in bf16."""
    fmt = get_format(FORMAT)
    tensors = unquantized_tensors(model, skip=set(layers))
    for name, layer in layers.items():
        tensors.update(field_tensors(name, fmt.encode(layer.weight.detach())))
    shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
    return Payload(tensors, weights_pattern=WEIGHTS_PATTERN,
                   side_files={DESCRIPTION: describe(FORMAT, shapes, UNQUANTIZED_DTYPE)})
