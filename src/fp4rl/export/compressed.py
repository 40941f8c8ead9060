"""MXFP4 and NVFP4 exports as compressed-tensors checkpoints (W4A16).

The codes and block scales are fp4rl's own (``get_format(fmt).encode``), copied into
compressed-tensors' ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized`` layouts, which
store 4-bit E2M1 codes the same way (element 2i in the low nibble, sign bit 0x8 over an
index into {0, .5, 1, 1.5, 2, 3, 4, 6}). The ``quantization_config`` is built with
compressed-tensors' own classes, so it is exactly what its loaders parse.

Scales: MXFP4's E8M0 byte is the block exponent + 127 in both. NVFP4's block scale is the
same E4M3 byte; the per-tensor scale is the reciprocal: fp4rl quantizes ``x / g`` with
``g = amax / (6 * 448)`` and multiplies by ``g``, compressed-tensors divides the block
scales by ``weight_global_scale``, so that tensor holds ``1 / g`` rounded to float32
(which is compressed-tensors' own ``6 * 448 / amax`` convention).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
from pydantic import JsonValue
from torch import nn

from fp4rl.export.directory import Payload, unquantized_tensors
from fp4rl.export.targets import ExportError
from fp4rl.formats import PackedTensor, get_format

#: fp4rl is installed already where this is read; the export extra's one package, from PyPI
INSTALL = 'pip install "compressed-tensors==0.20.0"'


@dataclass(frozen=True)
class Layout:
    """How compressed-tensors names and stores one fp4rl format."""

    compression_format: str
    strategy: str
    scale_dtype: torch.dtype


LAYOUTS = {
    "mxfp4": Layout("mxfp4-pack-quantized", "group", torch.uint8),
    "nvfp4": Layout("nvfp4-pack-quantized", "tensor_group", torch.float8_e4m3fn),
}


def require_compressed_tensors(fmt: str) -> ModuleType:
    """The compressed-tensors package, or one line saying how to install it."""
    try:
        return importlib.import_module("compressed_tensors")
    except ImportError:
        raise ExportError(f"exporting {fmt} needs the package compressed-tensors; install it "
                          f"with: {INSTALL}") from None


def compressed_payload(model: nn.Module, layers: dict[str, nn.Linear], fmt: str) -> Payload:
    """The tensors and ``quantization_config`` of a compressed-tensors export in ``fmt``:
    ``layers`` packed, every other tensor in bf16 (and every other linear in ``ignore``)."""
    tensors = unquantized_tensors(model, skip=set(layers))
    for name, layer in layers.items():
        tensors.update(layer_tensors(name, get_format(fmt).encode(layer.weight.detach())))
    ignore = [name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and name not in layers]
    return Payload(tensors, quantization_config=compressed_tensors_config(fmt, ignore))


def layer_tensors(name: str, packed: PackedTensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' tensors of one weight fp4rl encoded along in_features."""
    out_features, in_features = packed.shape
    layout = LAYOUTS[packed.format]
    scale = packed.fields["scale"].reshape(out_features, -1).contiguous()
    tensors = {
        f"{name}.weight_packed": packed.fields["codes"].reshape(out_features,
                                                                 in_features // 2).contiguous(),
        f"{name}.weight_scale": scale.view(layout.scale_dtype),
    }
    if layout.strategy == "tensor_group":
        g = packed.tensor_scale  # None: an all-zero weight, blocks scaled as they are
        tensors[f"{name}.weight_global_scale"] = torch.tensor(
            [1.0 if g is None else 1.0 / g], dtype=torch.float32)
    return tensors


def compressed_tensors_config(fmt: str, ignore: list[str]) -> dict[str, JsonValue]:
    """config.json's ``quantization_config``: one group of every Linear not in ``ignore``,
    weights only (activations stay in the runtime's dtype), already compressed."""
    ct = require_compressed_tensors(fmt)
    layout = LAYOUTS[fmt]
    weights = ct.quantization.QuantizationArgs(
        num_bits=4, type="float", symmetric=True, dynamic=False, strategy=layout.strategy,
        group_size=get_format(fmt).block_size, scale_dtype=layout.scale_dtype)
    scheme = ct.quantization.QuantizationScheme(
        targets=["Linear"], weights=weights, format=layout.compression_format)
    config = ct.quantization.QuantizationConfig(
        config_groups={"group_0": scheme}, format=layout.compression_format,
        quantization_status="compressed", ignore=ignore)
    return config.model_dump(mode="json")
