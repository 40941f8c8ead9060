"""Export formats by name: what ``fp4rl export --format NAME`` writes.

A format turns a model into the tensors (and ``config.json`` entries) of its directory:
``bf16``, compressed-tensors ``mxfp4`` / ``nvfp4``, fp4rl's packed ``hif4``, and ``vllm``
(the packed rollout grid the fp4rl vLLM method serves). A format of one's own registers
with :func:`register_export_format` and is then accepted by ``fp4rl export`` and
:func:`fp4rl.export.export_model`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from fp4rl.export.compressed import LAYOUTS, compressed_payload, require_compressed_tensors
from fp4rl.export.directory import Payload, unquantized_tensors
from fp4rl.export.hif4 import hif4_payload
from fp4rl.export.targets import ExportError, block_linears, check_blocks
from fp4rl.export.vllm import default_vllm_recipe, vllm_payload
from fp4rl.formats import get_format
from fp4rl.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from fp4rl.nn.recipe import Recipe

#: ``payload(model, ignores, recipe)``: the directory's tensors; ``ignores(name)`` says
#: which linears stay unquantized, ``recipe`` is the rollout recipe, resolved, where a
#: format takes one (``takes_recipe``; None otherwise)
PayloadFn = Callable[["PreTrainedModel", Callable[[str], bool], "Recipe | None"], Payload]


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its name, how it builds a directory's tensors, a check of the
    packages it needs (run before any loading), and whether it takes a recipe."""

    name: str
    payload: PayloadFn
    requires: Callable[[], object] | None = None
    takes_recipe: bool = False


_EXPORTS: Registry[ExportFormat] = Registry("export format", ExportError, key=str.lower)


def register_export_format(fmt: ExportFormat, *, replace: bool = False) -> ExportFormat:
    """Make ``fmt`` available under its (lower-case) name; a name already taken is refused
    unless ``replace``."""
    return _EXPORTS.register(fmt.name, fmt, replace=replace)


def list_export_formats() -> list[str]:
    """Export format names, in registration order."""
    return _EXPORTS.names()


def get_export_format(name: str) -> ExportFormat:
    """The export format ``name`` (case-insensitive), its dependencies checked; an unknown
    name is one line with the nearest and the choices."""
    fmt = _EXPORTS.get(str(name))
    if fmt.requires is not None:
        fmt.requires()
    return fmt


def _block_linears(model: PreTrainedModel, ignores: Callable[[str], bool], fmt: str) -> dict:
    """The linears a block format quantizes, checked against its block size."""
    layers = block_linears(model, ignores)
    if not layers:
        raise ExportError(f"{type(model).__name__} has no linear layer inside a transformer "
                          f"block to quantize in {fmt}; export it as bf16")
    check_blocks(layers, fmt, get_format(fmt).block_size)
    return layers


def _bf16(model: PreTrainedModel, ignores: Callable[[str], bool],
          recipe: Recipe | None) -> Payload:
    return Payload(unquantized_tensors(model, skip=set()))


def _compressed(fmt: str) -> PayloadFn:
    def payload(model: PreTrainedModel, ignores: Callable[[str], bool],
                recipe: Recipe | None) -> Payload:
        return compressed_payload(model, _block_linears(model, ignores, fmt), fmt)
    return payload


def _hif4(model: PreTrainedModel, ignores: Callable[[str], bool],
          recipe: Recipe | None) -> Payload:
    return hif4_payload(model, _block_linears(model, ignores, "hif4"))


def _vllm(model: PreTrainedModel, ignores: Callable[[str], bool],
          recipe: Recipe | None) -> Payload:
    return vllm_payload(model, recipe or default_vllm_recipe())


register_export_format(ExportFormat("bf16", _bf16))
for _layout in LAYOUTS:
    register_export_format(ExportFormat(
        _layout, _compressed(_layout),
        requires=partial(require_compressed_tensors, _layout)))
register_export_format(ExportFormat("hif4", _hif4))
register_export_format(ExportFormat("vllm", _vllm, takes_recipe=True))

__all__ = ["ExportFormat", "PayloadFn", "get_export_format", "list_export_formats",
           "register_export_format"]
