"""What a host process (fp4rl's trainer, verl's workers, TRL) sets up for an engine it
drives: the worker extension a refit calls, and the actor's recipe, which the engine's
own ``quantization_config`` must roll out. Nothing here imports vLLM."""

from __future__ import annotations

import os

from fp4rl.nn.recipe import Recipe, get_recipe
from fp4rl.rollout.vllm.errors import VLLMError

#: the worker extension a refit calls (:mod:`fp4rl.rollout.vllm.worker`)
WORKER_EXTENSION = "fp4rl.rollout.vllm.worker.FP4RLWorkerExtension"
#: the environment variable naming the recipe of the actor a host trains beside the engine
#: (verl's workers read it; ``fp4rl.integrations.verl``): where it is set, the engine's
#: recipe must be its rollout policy
RECIPE_ENV = "FP4RL_RECIPE"


def check_actor_recipe(recipe: Recipe) -> None:
    """Refuse, in one line, an engine whose rollout policy is not the one of the actor's
    recipe (:data:`RECIPE_ENV`, where a host sets it): given twice, once to the trainer
    and once in the engine's ``hf_overrides``, the two could differ silently."""
    name = os.environ.get(RECIPE_ENV)
    if not name:
        return
    actor = get_recipe(name)
    if actor.rollout != recipe.rollout or tuple(actor.ignore) != tuple(recipe.ignore):
        raise VLLMError(f"the engine's quantization_config rolls out "
                        f"{recipe.to_dict()['rollout']} (ignore {list(recipe.ignore)}), but "
                        f"{RECIPE_ENV}={name!r} rolls out {actor.to_dict()['rollout']} "
                        f"(ignore {list(actor.ignore)}): print both from one recipe with "
                        f"`python -m fp4rl.integrations.verl --recipe {name}`")


__all__ = ["RECIPE_ENV", "WORKER_EXTENSION", "check_actor_recipe"]
