"""verl's checkpoints where a model directory goes (``fp4rl eval --model``, ``load_model``).

verl 0.9.1's trainer saves the actor every ``trainer.save_freq`` steps under
``trainer.default_local_dir`` (``checkpoints/PROJECT/EXPERIMENT`` by default)::

    latest_checkpointed_iteration.txt      N, the newest complete save
    global_step_N/
        data.pt                            the dataloader's position
        actor/
            fsdp_config.json               FSDP version and world size W
            model_world_size_W_rank_R.pt   FSDP shards of the weights ("model")
            optim_world_size_W_rank_R.pt   AdamW's state ("optimizer")
            extra_state_world_size_W_rank_R.pt   scheduler and RNG ("extra")
            huggingface/                   config, generation config and tokenizer, always;
                                           the whole model as safetensors only when
                                           ``actor.checkpoint.save_contents`` has "hf_model"

The shards are torch pickles of one rank's slice each (DTensors); transformers cannot read
them. With "hf_model" verl gathers the full state dict (the FP32 masters, as the actor
trains them with ``param_dtype=fp32``) and writes it into ``huggingface/``, which is then
an ordinary Hugging Face directory. Without it, ``python -m verl.model_merger merge
--backend fsdp`` joins the shards into one (cast to bf16 on the way).

:func:`resolve_verl_dir` turns any of these paths (the checkpoint root, a
``global_step_N``, its ``actor`` or ``actor/huggingface``) into the directory to load, or
refuses one whose weights exist only as shards in one line naming the merge command. It
reads file names only, so verl need not be installed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from fp4rl.errors import UserError

#: the file verl's trainer writes last in its checkpoint root
LATEST = "latest_checkpointed_iteration.txt"
#: the folder verl's checkpoint manager writes the Hugging Face files into
HF_FOLDER = "huggingface"
#: where the merge command the refusal names writes the joined weights
MERGED_FOLDER = "merged"
_STEP = re.compile(r"^global_step_(\d+)$")
_SHARD = "model_world_size_*_rank_*.pt"
#: the weight files transformers' ``from_pretrained`` reads
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json")


class VerlCheckpointError(UserError, FileNotFoundError):
    """A verl checkpoint that holds no Hugging Face weights; the message names the merge."""


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds weights ``from_pretrained`` reads (not only a config)."""
    return any((directory / name).is_file() for name in _WEIGHTS)


def _is_actor(directory: Path) -> bool:
    """Whether ``directory`` is one actor checkpoint written by verl's FSDP manager."""
    return (directory / "fsdp_config.json").is_file() or any(directory.glob(_SHARD))


def _actor_dir(path: Path) -> Path | None:
    """The ``actor`` folder of the verl checkpoint ``path`` names, or None if ``path``
    is not laid out as verl writes it."""
    latest = path / LATEST
    if latest.is_file():
        text = latest.read_text().strip()
        if not text.isdigit():
            raise VerlCheckpointError(f"{latest} holds {text!r}, not a step number: pass "
                                      f"one of {path}/global_step_N/actor")
        step = path / f"global_step_{int(text)}"
        if not step.is_dir():
            raise VerlCheckpointError(f"{latest} names step {int(text)}, but {step} does not "
                                      "exist: pass an existing global_step_N/actor")
        path = step
    if _STEP.match(path.name) and (path / "actor").is_dir():
        path = path / "actor"
    if path.name == HF_FOLDER and _is_actor(path.parent):
        return path.parent
    return path if _is_actor(path) else None


def is_verl_checkpoint(path: Path) -> bool:
    """Whether ``path`` is laid out as verl writes its checkpoints (any of the paths
    :func:`resolve_verl_dir` takes), whatever it holds."""
    try:
        return _actor_dir(path) is not None
    except VerlCheckpointError:  # a root whose latest step is unreadable or gone
        return True


def merge_command(actor: Path) -> str:
    """verl's command that joins the FSDP shards of ``actor`` into a Hugging Face
    directory (``actor/merged``), quoted for a shell."""
    return (f"python -m verl.model_merger merge --backend fsdp --local_dir "
            f"{shlex.quote(str(actor))} --target_dir "
            f"{shlex.quote(str(actor / MERGED_FOLDER))}")


def resolve_verl_dir(path: Path) -> Path | None:
    """The Hugging Face directory to load for ``path`` if it is part of a verl checkpoint
    (its ``huggingface/`` folder, holding the weights), None if it is not one.

    A checkpoint saved without "hf_model" in ``save_contents`` has only FSDP shards:
    refused in one line naming verl's merge command, and the save setting that writes the
    weights directly (in FP32, the masters the actor trained, where the merge casts them to
    bf16)."""
    actor = _actor_dir(path)
    if actor is None:
        return None
    hf = actor / HF_FOLDER
    if has_weights(hf):
        return hf
    merged = actor / MERGED_FOLDER
    if has_weights(merged):
        return merged
    raise VerlCheckpointError(
        f"{path} is a verl checkpoint whose weights are FSDP shards only ({actor} has no "
        f"weights in {HF_FOLDER}/): join them with `{merge_command(actor)}` (bf16), or save "
        "with actor_rollout_ref.actor.checkpoint.save_contents="
        "[model,optimizer,extra,hf_model] for the FP32 weights in "
        f"{HF_FOLDER}/; then pass the same path again")


__all__ = ["HF_FOLDER", "LATEST", "MERGED_FOLDER", "VerlCheckpointError", "has_weights",
           "is_verl_checkpoint", "merge_command", "resolve_verl_dir"]
