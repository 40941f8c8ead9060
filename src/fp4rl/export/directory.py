"""Writing an export directory: the files every format shares, written atomically.

Each format supplies a :class:`Payload` (its tensors, and what config.json or a side file
must say about them); this module adds config.json, the tokenizer and the generation
config, writes everything into a hidden temporary directory beside the output and renames
it into place only when complete, so an interrupted export never leaves a directory that
looks loadable.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fp4rl.export.targets import ExportError
from fp4rl.paths import fsync_path, write_json

UNQUANTIZED_DTYPE = torch.bfloat16
HF_WEIGHTS_PATTERN = "model{suffix}.safetensors"


@dataclass
class Payload:
    """What one format writes besides the shared files."""

    tensors: dict[str, torch.Tensor]
    weights_pattern: str = HF_WEIGHTS_PATTERN
    #: stored as config.json's ``quantization_config`` (None: the config says nothing)
    quantization_config: Mapping[str, object] | None = None
    #: further JSON files, by file name
    side_files: dict[str, Mapping[str, object]] = field(default_factory=dict)


def unquantized_tensors(model: torch.nn.Module, skip: set[str]) -> dict[str, torch.Tensor]:
    """The state dict in bf16, minus the ``weight`` of the ``skip`` modules."""
    tensors = {}
    for name, tensor in _unique_state(model):
        module, _, leaf = name.rpartition(".")
        if not (leaf == "weight" and module in skip):
            tensors[name] = tensor.detach().to(UNQUANTIZED_DTYPE).contiguous()
    return tensors


def bf16_bytes(model: torch.nn.Module) -> int:
    """What the model's tensors take in bf16: the size of a bf16 export's weights, less
    the few kilobytes of safetensors headers."""
    return sum(t.numel() for _, t in _unique_state(model)) * UNQUANTIZED_DTYPE.itemsize


def _unique_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict with a tensor tied to an earlier one (lm_head to the embeddings) left
    out, as ``save_pretrained`` stores it: loaders tie it back from the config."""
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            yield name, tensor


def check_output(directory: Path) -> None:
    """Refuse an output that exists and is not an empty directory: an export never mixes
    its files with those of another model."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ExportError(f"{directory} already exists and is not an empty directory; "
                          "choose another --output or remove it")


def write_directory(directory: Path, model: PreTrainedModel,
                    tokenizer: PreTrainedTokenizerBase, payload: Payload) -> None:
    """Write ``payload`` and the shared files into ``directory``, atomically."""
    check_output(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        _write_files(tmp, model, tokenizer, payload)
        _share(tmp)
        for path in tmp.iterdir():
            fsync_path(path)
        if directory.exists():
            directory.rmdir()  # empty, as check_output made sure
        os.rename(tmp, directory)
        fsync_path(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _share(directory: Path) -> None:
    """Give the directory and its files the permissions the user's umask grants new ones:
    mkdtemp makes the directory private, yet an export is meant for other tools (a
    serving container's user among them) to read."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _write_files(out: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 payload: Payload) -> None:
    config = copy.deepcopy(model.config)
    config.dtype = UNQUANTIZED_DTYPE
    if payload.quantization_config is not None:
        config.quantization_config = payload.quantization_config
    config.save_pretrained(out)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_torch_state_dict(payload.tensors, out, filename_pattern=payload.weights_pattern)
    for name, content in payload.side_files.items():
        write_json(out / name, content)


def weights_bytes(directory: Path) -> int:
    """Bytes on disk of the safetensors files in ``directory`` (the weights, all shards)."""
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def total_bytes(directory: Path) -> int:
    """Bytes on disk of every file in ``directory`` (weights, config, tokenizer...)."""
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
