"""Loading a training config: a YAML file or a preset name, ``key=value`` overrides and
changes, validated into a :class:`~fp4rl.rl.config.schema.TrainConfig` whose problems are
one line."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from fp4rl.errors import ConfigError, RecipeError
from fp4rl.nn.recipe import RolloutPrecision, get_recipe
from fp4rl.presets import preset_path
from fp4rl.rl.config.overrides import apply_override, set_path
from fp4rl.rl.config.schema import TrainConfig
from fp4rl.rl.config.yaml12 import Loader
from fp4rl.settings import section_model


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                changes: Mapping[str, object] | None = None) -> TrainConfig:
    """Read ``path`` (a YAML file or a preset name, see :mod:`fp4rl.presets`), apply
    ``overrides`` (``key=value``) and ``changes`` (``{"run.steps": 3}``), then validate.
    An override ``recipe=NAME`` replaces the file's recipe (its ``train``, rollout policy
    and ``ignore``) as a whole."""
    data: dict[str, object] = {}
    if path is not None:
        p = preset_path(path)
        try:
            data = yaml.load(p.read_text(), Loader=Loader) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{p} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p} must hold a mapping at the top level")
    if any(item.startswith("recipe=") for item in overrides or []):
        data = _without_recipe(data)
    for item in overrides or []:
        apply_override(data, item)
    for key, value in (changes or {}).items():
        set_path(data, key, value)
    return validate(data)


#: top-level keys users bring from transformers, TRL and verl, and fp4rl's key for each
OTHER_NAMES = {
    "dtype": "mixed_precision",
    "torch_dtype": "mixed_precision",
    "bf16": "mixed_precision",
}
_HINTS = {"mixed_precision": "mixed_precision=no|bf16|auto (the compute dtype; master weights "
                             "are always FP32)"}


def _suggestion(error: ErrorDetails) -> str:
    """"; did you mean X?" for an unknown key close to a field of its section, or the key
    for a setting named as another framework names it."""
    if error["type"] != "extra_forbidden":
        return ""
    if len(error["loc"]) == 1 and error["loc"][0] in OTHER_NAMES:
        ours = OTHER_NAMES[error["loc"][0]]
        return f"; fp4rl's setting for it is {_HINTS.get(ours, ours)}"
    section: type[BaseModel] | None = TrainConfig
    for part in error["loc"][:-1]:
        field = section.model_fields.get(str(part)) if section is not None else None
        section = section_model(field.annotation) if field is not None else None
    if section is None:
        return ""
    close = difflib.get_close_matches(str(error["loc"][-1]), list(section.model_fields), n=1)
    return f"; did you mean {close[0]}?" if close else ""


#: the keys of ``rollout`` that are the recipe's rollout policy (the rest say where it runs)
ROLLOUT_POLICY = tuple(RolloutPrecision.model_fields)


def _without_recipe(data: dict[str, object]) -> dict[str, object]:
    """``data`` less its recipe (``recipe``, ``train``, ``ignore``, the rollout policy),
    keeping where and how the rollout runs (``rollout.engine``, an engine's settings)."""
    rollout = data.get("rollout")
    kept = {k: v for k, v in data.items() if k not in ("recipe", "train", "ignore", "rollout")}
    if isinstance(rollout, dict):
        kept["rollout"] = {k: v for k, v in rollout.items() if k not in ROLLOUT_POLICY}
    return kept


def expand_recipe_name(data: Mapping[str, object]) -> Mapping[str, object]:
    """``recipe: NAME`` (a config key or ``recipe=NAME``) as the ``train``, rollout policy
    and ``ignore`` it names; the config may not also set them (one source for each)."""
    if "recipe" not in data:
        return data
    data = dict(data)
    name = str(data.pop("recipe"))
    rollout = data.get("rollout") or {}
    policy = [f"rollout.{k}" for k in ROLLOUT_POLICY if isinstance(rollout, dict) and k in rollout]
    clash = [k for k in ("train", "ignore") if data.get(k)] + policy
    if clash:
        raise ConfigError(f"recipe={name} sets train, rollout's policy and ignore at once: "
                          f"drop {', '.join(clash)}, or the recipe name")
    try:
        named = get_recipe(name).to_dict()
    except RecipeError as err:
        raise ConfigError(f"recipe: {err}") from None
    data["train"], data["ignore"] = named["train"], named.get("ignore", [])
    data["rollout"] = {**named["rollout"], **rollout} if isinstance(rollout, dict) else rollout
    return data


def validate(data: Mapping[str, object]) -> TrainConfig:
    data = expand_recipe_name(data)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "config"
            if e["type"] == "value_error":  # our validators name their keys themselves
                problems.append(str(e["ctx"]["error"]))
                continue
            problems.append(f"{where}: {e['msg']}{_suggestion(e)}")
        raise ConfigError("invalid training config: " + "; ".join(problems)) from None


__all__ = ["load_config", "validate"]
