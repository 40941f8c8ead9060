"""Loading a training config: a YAML file or a preset name, ``key=value`` overrides and
changes, validated into a :class:`~fp4rl.rl.config.schema.TrainConfig` whose problems are
one line."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fp4rl.errors import ConfigError
from fp4rl.presets import preset_path
from fp4rl.rl.config.overrides import apply_override, set_path
from fp4rl.rl.config.schema import TrainConfig
from fp4rl.rl.config.yaml12 import Loader


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                changes: dict[str, Any] | None = None) -> TrainConfig:
    """Read ``path`` (a YAML file or a preset name, see :mod:`fp4rl.presets`), apply
    ``overrides`` (``key=value``) and ``changes`` (``{"run.steps": 3}``), then validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = preset_path(path)
        try:
            data = yaml.load(p.read_text(), Loader=Loader) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{p} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p} must hold a mapping at the top level")
    for item in overrides or []:
        apply_override(data, item)
    for key, value in (changes or {}).items():
        set_path(data, key, value)
    return validate(data)


REMOVED_KEYS = {
    "dtype": "dtype is gone: master weights are always FP32; choose the compute dtype with "
             "mixed_precision=no|bf16|auto",
}


def _suggestion(error: Any) -> str:
    """"; did you mean X?" for an unknown key close to a field of its section."""
    if error["type"] != "extra_forbidden":
        return ""
    section: Any = TrainConfig
    for part in error["loc"][:-1]:
        annotation = section.model_fields[part].annotation if part in section.model_fields \
            else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        section = annotation
    close = difflib.get_close_matches(str(error["loc"][-1]), list(section.model_fields), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def validate(data: dict[str, Any]) -> TrainConfig:
    for key, why in REMOVED_KEYS.items():
        if key in data:
            raise ConfigError(why)
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


__all__ = ["REMOVED_KEYS", "load_config", "validate"]
