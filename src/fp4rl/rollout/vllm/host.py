"""What a host process (fp4rl's trainer, verl's workers, TRL) sets up for an engine it
drives: the worker extension a refit calls, and the actor's recipe, which the engine's
own ``quantization_config`` must roll out. Nothing here imports vLLM."""

from __future__ import annotations

import json
import os
from typing import Literal, overload

from fp4rl.nn.recipe import Recipe, get_recipe
from fp4rl.rollout.vllm.errors import VLLMError

#: the worker extension a refit calls (:mod:`fp4rl.rollout.vllm.worker`)
WORKER_EXTENSION = "fp4rl.rollout.vllm.worker.FP4RLWorkerExtension"
#: the environment variable holding the recipe of the actor a host trains beside the engine
#: (verl's workers read it; ``fp4rl.integrations.verl``): a recipe name, or the recipe's
#: JSON (:func:`encode_recipe`); where it is set, the engine's recipe must be its rollout
#: policy
RECIPE_ENV = "FP4RL_RECIPE"


def encode_recipe(recipe: Recipe) -> str:
    """``recipe`` as :data:`RECIPE_ENV` carries it: the JSON of :meth:`Recipe.to_dict`, one
    line. The recipe, not its name: a recipe built in code, which has no name, travels
    whole, and a name is read into its recipe at the edge that takes it."""
    return json.dumps(recipe.to_dict(), separators=(",", ":"))


def decode_recipe(text: str) -> Recipe:
    """The recipe :data:`RECIPE_ENV`'s ``text`` holds: a recipe's JSON
    (:func:`encode_recipe`), or a recipe name; refused in one line where it is neither."""
    if not text.lstrip().startswith("{"):
        return get_recipe(text.strip())
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise VLLMError(f"{RECIPE_ENV} holds no recipe JSON ({err.msg} at character "
                        f"{err.pos}): print it with `python -m fp4rl.integrations.verl "
                        "--recipe R`") from None
    return Recipe.from_dict(data)


@overload
def actor_recipe(required: Literal[True]) -> Recipe: ...
@overload
def actor_recipe(required: bool = False) -> Recipe | None: ...
def actor_recipe(required: bool = False) -> Recipe | None:
    """The actor's recipe a host set in :data:`RECIPE_ENV`; None where it is unset, or
    refused in one line there where the host must set it (``required``: verl's actor,
    which would otherwise train in a recipe the engine never sees)."""
    text = os.environ.get(RECIPE_ENV)
    if text:
        return decode_recipe(text)
    if required:
        raise VLLMError(f"{RECIPE_ENV} is not set, so the actor would not know the recipe "
                        "the engine rolls out: pass the overrides `python -m "
                        "fp4rl.integrations.verl --recipe R` prints (or "
                        "fp4rl.integrations.verl.hydra_overrides(recipe)), which set it "
                        "and the engine's quantization_config from one recipe")
    return None


def check_actor_recipe(recipe: Recipe, required: bool = False) -> None:
    """Refuse, in one line, an engine whose rollout policy (or ``ignore`` list) is not the
    one of the actor's recipe (:data:`RECIPE_ENV`, where a host sets it), and, where the
    host must set it (``required``), a variable left unset: given twice, once to the
    trainer and once in the engine's ``hf_overrides``, the two could differ silently."""
    actor = actor_recipe(required)
    if actor is None:
        return
    if actor.rollout != recipe.rollout or tuple(actor.ignore) != tuple(recipe.ignore):
        raise VLLMError(f"the engine's quantization_config rolls out "
                        f"{recipe.to_dict()['rollout']} (ignore {list(recipe.ignore)}), but "
                        f"the actor's {RECIPE_ENV} rolls out {actor.to_dict()['rollout']} "
                        f"(ignore {list(actor.ignore)}): print both from one recipe with "
                        "`python -m fp4rl.integrations.verl --recipe R` (or "
                        "fp4rl.integrations.verl.hydra_overrides(recipe))")


__all__ = ["RECIPE_ENV", "WORKER_EXTENSION", "actor_recipe", "check_actor_recipe",
           "decode_recipe", "encode_recipe"]
