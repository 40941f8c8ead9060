"""``fp4rl train --help-config``: every setting of the training config by dotted key,
read from the schema that validates it (:mod:`.schema`, the recipe's dataclasses, the
recovery methods' and the rollout engines' registered models), so what is printed is
what is validated."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import Enum
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from fp4rl.nn.recipe import RolloutPrecision, TrainPrecision
from fp4rl.recovery import get_recovery, list_recoveries
from fp4rl.rl.config.schema import TrainConfig
from fp4rl.rollout.registry import AUTO, AUTO_PICKS, DEFAULT_ENGINE, get_engine, list_engines


@dataclass(frozen=True)
class ConfigField:
    """One setting of the training config as ``fp4rl train --help-config`` prints it."""

    key: str
    type: str
    default: str
    description: str
    #: the recovery methods that take this parameter (``rollout.recovery.<param>`` rows)
    methods: tuple[str, ...] = ()


def config_fields(schema: type[BaseModel] = TrainConfig, prefix: str = ""
                  ) -> list[ConfigField]:
    """Every setting of ``schema`` by dotted key, read from its fields (sections, then
    their settings; ``rollout`` with its engine and the vLLM engine's settings), so that
    what is printed is what is validated."""
    rows = []
    for name, field in schema.model_fields.items():
        key, annotation = f"{prefix}{name}", field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append(ConfigField(key, "section", "", field.description or ""))
            rows += config_fields(annotation, f"{key}.")
            continue
        rows.append(ConfigField(key, type_name(annotation), default_text(field),
                                field.description or ""))
        if key == "train":
            rows += recipe_fields(TrainPrecision, "train.")
        if key == "rollout":
            rows += recipe_fields(RolloutPrecision, "rollout.") + engine_fields()
    return rows


def engine_fields() -> list[ConfigField]:
    """``rollout.engine`` with every registered engine's summary, then each engine's own
    settings under ``rollout.<engine>.``, from the models the engines registered."""
    engines = [get_engine(name) for name in list_engines()]
    described = "; ".join(f"{e.name}: {e.summary}" for e in engines)
    rows = [ConfigField("rollout.engine", " | ".join([*list_engines(), AUTO]), DEFAULT_ENGINE,
                        f"where the rollout runs ({described}; {AUTO}: {AUTO_PICKS})")]
    for engine in engines:
        if engine.settings is not None:
            rows += config_fields(engine.settings, f"rollout.{engine.name}.")
    return rows


def recipe_fields(part: type, prefix: str) -> list[ConfigField]:
    """The settings of one part of the recipe (its dataclass fields' ``help``); the
    recovery as its method's name and every registered method's parameters."""
    rows = []
    for f in dataclasses.fields(part):
        if f.name != "recovery":
            choices = f.metadata.get("choices")
            kind = " | ".join(choices()) if choices else str(f.type)
            rows.append(ConfigField(f"{prefix}{f.name}", kind, default_text(f),
                                    f.metadata["help"]))
            continue
        rows.append(ConfigField(f"{prefix}recovery.method", " | ".join(list_recoveries()),
                                "none", f.metadata["help"]))
        params: dict[str, tuple[dataclasses.Field[Any], list[str]]] = {}
        for method in list_recoveries():
            for p in dataclasses.fields(get_recovery(method).config_cls):
                params.setdefault(p.name, (p, []))[1].append(method)
        rows += [ConfigField(f"{prefix}recovery.{name}", str(p.type), default_text(p),
                             f"{p.metadata['help']} ({', '.join(methods)})", tuple(methods))
                 for name, (p, methods) in params.items()]
    return rows


def type_name(annotation: Any) -> str:
    """``auto | none | ddp`` for a Literal or an enum, ``int | None``, ``list[int]``,
    ``str``."""
    if get_origin(annotation) is Annotated:  # a strict type: what it annotates
        return type_name(get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " | ".join(str(member.value) for member in annotation)
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if args and get_origin(annotation) in (Union, UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if args:
        return f"{annotation.__origin__.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo | dataclasses.Field[Any]) -> str:
    """The default as a ``key=value`` override writes it."""
    if isinstance(field, FieldInfo):
        value = field.get_default(call_default_factory=True)
    else:
        value = field.default
    if isinstance(value, Enum):
        return str(value.value)
    return value if isinstance(value, str) else json.dumps(value)


__all__ = ["ConfigField", "config_fields", "default_text", "engine_fields", "recipe_fields",
           "type_name"]
