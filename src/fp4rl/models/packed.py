"""fp4rl's packed checkpoint directory: block linears kept in a block format's real codes.

``fp4rl export --format hif4`` writes one; :func:`fp4rl.models.load_model` reads it back.
Beside the usual Hugging Face files (config.json, tokenizer, generation config) it holds:

- ``fp4rl-packed.json`` (:data:`DESCRIPTION`): the format, its block size, the dtype of the
  tensors left unquantized, and each packed module's weight shape;
- ``fp4rl-weights.safetensors`` (or numbered shards, :data:`WEIGHTS_PATTERN`): for a packed
  module ``M`` with an ``[out, in]`` weight, one uint8 tensor ``M.weight_<field>`` per
  field of :meth:`fp4rl.formats.NumberFormat.encode` (blocks of ``in`` along each row, the
  row's blocks in order, each block's bytes together: shape ``[out, in / block * bytes]``);
  every other tensor under its state-dict name.

The weights file has a name transformers does not look for, so loading the directory with
plain ``AutoModelForCausalLM.from_pretrained`` fails loudly instead of filling the packed
layers with random values. The byte layout of each field is specified in
``docs/integrations.md`` (section "Export") so that other runtimes can read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from fp4rl.errors import UserError
from fp4rl.formats import PackedTensor, get_format

DESCRIPTION = "fp4rl-packed.json"
WEIGHTS_PATTERN = "fp4rl-weights{suffix}.safetensors"
VERSION = 1
FIELD_PREFIX = ".weight_"


class PackedCheckpointError(UserError):
    """A packed directory that cannot be read: a missing file, tensor or newer layout."""


def is_packed(directory: Path) -> bool:
    """Whether ``directory`` is a packed checkpoint (it has a :data:`DESCRIPTION`)."""
    return (directory / DESCRIPTION).is_file()


def field_tensors(module: str, packed: PackedTensor) -> dict[str, torch.Tensor]:
    """The stored tensors of one encoded ``[out, in]`` weight, row-major by block."""
    out_features = packed.shape[0]
    return {f"{module}{FIELD_PREFIX}{name}": buffer.reshape(out_features, -1).contiguous()
            for name, buffer in packed.fields.items()}


class PackedModule(TypedDict):
    """A packed weight's entry in :data:`DESCRIPTION`: its shape (out, in features)."""

    shape: list[int]


class PackedDescription(TypedDict):
    """:data:`DESCRIPTION` of a packed directory: the layout's version, the format, where
    the weights are, the dtype of the tensors not packed, and each packed weight."""

    fp4rl_packed_version: int
    format: str
    block_size: int
    bits_per_value: float
    weights: str
    unquantized_dtype: str
    modules: dict[str, PackedModule]


def describe(fmt: str, modules: dict[str, tuple[int, int]], dtype: torch.dtype
             ) -> PackedDescription:
    """The :data:`DESCRIPTION` of a directory whose ``modules`` (name: weight shape) are
    packed in ``fmt`` and whose other tensors are stored in ``dtype``."""
    spec = get_format(fmt)
    return PackedDescription(
        fp4rl_packed_version=VERSION,
        format=spec.name,
        block_size=spec.block_size,
        bits_per_value=spec.bits_per_value,
        weights=WEIGHTS_PATTERN.format(suffix="*"),
        unquantized_dtype=str(dtype).removeprefix("torch."),
        modules={name: PackedModule(shape=list(shape)) for name, shape in modules.items()},
    )


def load_packed_model(directory: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The model of a packed directory in ``dtype``, each packed weight decoded exactly as
    ``fp4rl.quantize`` of the exported weight would give it."""
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = packed_state_dict(directory)
    missing, unexpected = model.load_state_dict(state, strict=False)
    _check_complete(model, state, missing, unexpected, directory)
    return model


def packed_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict a packed directory stores, packed weights decoded to float32."""
    description = _read_description(directory)
    fmt = get_format(description["format"])
    files = sorted(directory.glob(WEIGHTS_PATTERN.format(suffix="*")))
    if not files:
        raise PackedCheckpointError(f"{directory} has {DESCRIPTION} but no weights file "
                                    f"({WEIGHTS_PATTERN.format(suffix='')})")
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        stored.update(load_file(file))
    state = {}
    for module, entry in description["modules"].items():
        shape = tuple(entry["shape"])
        fields = _pop_fields(stored, module, shape, fmt.block_size, directory)
        packed = PackedTensor(fmt.name, shape, 1, torch.float32, fields,
                              options={"length": shape[1]})
        state[f"{module}.weight"] = fmt.decode(packed)
    return {**stored, **state}


def _read_description(directory: Path) -> PackedDescription:
    description: PackedDescription = json.loads((directory / DESCRIPTION).read_text())
    version = description.get("fp4rl_packed_version")
    if version != VERSION:
        raise PackedCheckpointError(f"{directory / DESCRIPTION}: layout version {version!r}; "
                                    f"this fp4rl reads version {VERSION} (upgrade fp4rl)")
    return description


def _pop_fields(stored: dict[str, torch.Tensor], module: str, shape: tuple[int, ...],
                block: int, directory: Path) -> dict[str, torch.Tensor]:
    """Remove ``module``'s field tensors from ``stored``, one row per block."""
    prefix = module + FIELD_PREFIX
    names = [key for key in stored if key.startswith(prefix)]
    if not names:
        raise PackedCheckpointError(f"{directory}: no packed tensors {prefix}* for {module}")
    blocks = shape[0] * shape[1] // block
    fields = {}
    for key in names:
        per_block = stored.pop(key).reshape(blocks, -1)
        fields[key.removeprefix(prefix)] = per_block.squeeze(-1) if per_block.shape[1] == 1 \
            else per_block
    return fields


def _check_complete(model: PreTrainedModel, state: dict[str, torch.Tensor], missing: list[str],
                    unexpected: list[str], directory: Path) -> None:
    """Every parameter came from the directory: a missing one may only be tied to a loaded
    one (lm_head to the embeddings), and nothing stored may go unused."""
    params = model.state_dict()
    loaded = {params[name].data_ptr() for name in state if name in params}
    untied = [name for name in missing if params[name].data_ptr() not in loaded]
    if untied or unexpected:
        raise PackedCheckpointError(f"{directory} does not match its config: missing "
                                    f"{untied or 'nothing'}, unexpected {unexpected or 'nothing'}")
