"""Where evaluation and export get a trained policy (``--checkpoint``), evaluation its prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from fp4rl.data import Example
from fp4rl.data.synthetic import SYNTHETIC_TASKS
from fp4rl.errors import UserError
from fp4rl.nn import quantize_model
from fp4rl.nn.recipe import Recipe, get_recipe
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.config import DataConfig, recipe_of
from fp4rl.rl.datasets import encode_examples, load_split

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """A ``--checkpoint`` path that is neither a checkpoint nor a run directory with one."""


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself if it is one, else the latest of the run
    directory ``path``. Commands that take ``--checkpoint`` share this rule."""
    from fp4rl.models.verl_dir import is_verl_checkpoint

    path = Path(path)
    if (path / ckpt.COMPLETE).is_file():
        return path
    found = ckpt.latest_checkpoint(path)
    if found is None and is_verl_checkpoint(path):
        raise CheckpointNotFoundError(
            f"{path} is a verl checkpoint, not an fp4rl run: pass it as --model {path} with "
            "--recipe RECIPE (the recipe its overrides were printed for, e.g. hif4+resq-2:4)")
    if found is None:
        raise CheckpointNotFoundError(
            f"{path} is neither a checkpoint (a directory with {ckpt.COMPLETE}) nor a run "
            f"directory with one under {ckpt.CHECKPOINTS}/")
    return found


@dataclass(frozen=True)
class TrainedPolicy:
    """A run's trained master weights on its base model, and where they came from."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    path: Path
    recipe: Recipe


def load_trained(checkpoint: str | Path, device: str | torch.device = "cpu") -> TrainedPolicy:
    """Load a checkpoint (or a run directory's latest one) onto the run's base model,
    unquantized; ``recipe`` is the run's own (formats, recovery and ``ignore``)."""
    from fp4rl.models import load_model

    path = checkpoint_dir(checkpoint)
    ckpt.verify_checkpoint(path)
    config = ckpt.read_torch(path / "state.pt")["config"]
    net, tok = load_model(config["model"], device=device)
    ckpt.load_weights(path, net)
    recipe = recipe_of(config, strict=False)
    return TrainedPolicy(net, tok, path, recipe)


def load_policy(model: str | None, checkpoint: str | None, recipe: str | None,
                device: str | torch.device = "cpu"
                ) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, str]:
    """The model to evaluate, its tokenizer and a label saying what it is.

    ``checkpoint`` (a run directory or one checkpoint) loads the trained master weights
    onto the run's base model. ``recipe`` None evaluates them unquantized, ``"run"`` under
    the run's own recipe, a recipe name (``hif4+resq-2:4``) under that recipe.
    """
    from fp4rl.models import load_model

    run_recipe = None
    if checkpoint is not None:
        trained = load_trained(checkpoint, device)
        net, tok, run_recipe = trained.model, trained.tokenizer, trained.recipe
        label = f"checkpoint {trained.path}"
    else:
        net, tok = load_model(model or "smollm2-135m", device=device)
        label = model or "smollm2-135m"
    if recipe == "run":
        if run_recipe is None:
            raise UserError("--recipe run needs --checkpoint")
        quantize_model(net, run_recipe)
        label += " (run recipe)"
    elif recipe:
        quantize_model(net, get_recipe(recipe))
        label += f" ({recipe})"
    else:
        label += " (unquantized)"
    return net, tok, label


def field_mapping(fields: list[str]) -> dict[str, str]:
    """``["problem=Problem"]`` as ``{"problem": "Problem"}``; a malformed entry or an
    unknown role is refused (an ignored mapping would read the wrong field)."""
    mapping = {}
    for item in fields:
        role, sep, name = item.partition("=")
        if not sep or not name or role not in ("problem", "answer"):
            raise UserError(f"--field {item!r}: give ROLE=NAME with ROLE problem or answer, "
                            "e.g. problem=Problem")
        mapping[role] = name
    return mapping


def eval_examples(spec: str, tokenizer: PreTrainedTokenizerBase, n: int, levels: list[int],
                  seed: int = 0,
                  fields: list[str] | None = None,
                  max_prompt_length: int = 4096, template: str | None = None
                  ) -> tuple[list[Example], list[list[int]]]:
    """Test examples and their prompts (``template``: a prompt template name, default the
    layout's): ``synthetic``, ``synthetic-words`` or ``LAYOUT:PATH``."""
    return encode_examples(eval_split(spec, n, levels, seed, fields), tokenizer,
                           max_prompt_length, template)


def eval_split(spec: str, n: int, levels: list[int], seed: int = 0,
               fields: list[str] | None = None) -> list[Example]:
    """The test examples ``--data spec`` names, read before any model is loaded so that a
    mistake in them costs no wait."""
    source, _, path = spec.partition(":")
    if source not in SYNTHETIC_TASKS and not path:
        raise UserError(f"--data {spec!r}: give synthetic, synthetic-words or LAYOUT:PATH, "
                        "e.g. gsm8k:data/test.jsonl")
    if source in SYNTHETIC_TASKS and path:
        raise UserError(f"--data {spec!r}: {source} generates its prompts and reads no file")
    mapping = field_mapping(fields or [])
    try:
        cfg = DataConfig(source=source, test_path=path or None, levels=levels, test_size=n,
                         fields=mapping or None)
    except ValidationError as err:
        raise UserError(f"--data {spec} --levels {' '.join(map(str, levels))}: "
                        + "; ".join(str(e.get("ctx", {}).get("error", e["msg"]))
                                    for e in err.errors())) from None
    return load_split(cfg, "test", seed)
