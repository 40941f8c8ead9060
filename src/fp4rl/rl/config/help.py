"""``fp4rl train --help-config``: every setting of the training config by dotted key,
generated from the one schema that validates it (:class:`~.schema.TrainConfig`, whose
``train`` and ``rollout`` are the recipe's models, the recovery methods' registered
parameter models and the rollout engines' registered settings models), so what is printed
is what is validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from types import UnionType
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from fp4rl.rl.config.schema import TrainConfig
from fp4rl.settings import Choices, Variants, marker, section_model


@dataclass(frozen=True)
class ConfigField:
    """One setting of the training config as ``fp4rl train --help-config`` prints it."""

    key: str
    type: str
    default: str
    description: str
    #: the choices of a variant setting that take this one (``rollout.recovery.<param>``
    #: rows: the recovery methods)
    methods: tuple[str, ...] = ()


def config_fields(schema: type[BaseModel] = TrainConfig, prefix: str = ""
                  ) -> list[ConfigField]:
    """Every setting of ``schema`` by dotted key, read from its fields: a section's row,
    then its settings; a variant field's parameters for each variant; the sections of a
    model's extra keys (``rollout.<engine>`` of an engine registered at run time)."""
    rows = []
    for name, field in schema.model_fields.items():
        key, annotation = f"{prefix}{name}", field.annotation
        variants = marker(field.metadata, Variants)
        if variants is not None:
            rows += _variant_fields(variants, prefix)
        elif (section := section_model(annotation)) is not None:
            rows.append(ConfigField(key, "section", "", field.description or ""))
            rows += config_fields(section, f"{key}.")
        else:
            rows.append(ConfigField(key, type_name(annotation, field.metadata),
                                    default_text(field), describe(field)))
    sections = getattr(schema, "extra_sections", None)
    for section, model in (sections() if sections else {}).items():
        rows += config_fields(model, f"{prefix}{section}.")
    return rows


def _variant_fields(variants: Variants, prefix: str) -> list[ConfigField]:
    """The parameters of every variant, once each, with the variants that take it."""
    params: dict[str, tuple[FieldInfo, list[str]]] = {}
    for choice, model in variants.models().items():
        for name, field in model.model_fields.items():
            params.setdefault(name, (field, []))[1].append(choice)
    return [ConfigField(f"{prefix}{name}", type_name(field.annotation, field.metadata),
                        default_text(field), f"{describe(field)} ({', '.join(takers)})",
                        tuple(takers))
            for name, (field, takers) in params.items()]


def describe(field: FieldInfo) -> str:
    """The field's description, with a line on each of its choices where it has them."""
    choices = marker(field.metadata, Choices)
    text = field.description or ""
    if choices is None or choices.described is None:
        return text
    each = "; ".join(f"{name}: {line}" for name, line in choices.described().items())
    return f"{text} ({each})"


def type_name(annotation: object, metadata: list[object] | None = None) -> str:
    """``hif4 | mxfp4 | ...`` for a registry's names, ``auto | none | ddp`` for a Literal
    or an enum, ``int | None``, ``list[int]``, ``str``."""
    choices = marker(metadata or [], Choices)
    if choices is not None:
        return " | ".join(choices.names())
    if get_origin(annotation) is Annotated:  # a strict or named type: what it annotates
        base, *meta = get_args(annotation)
        return type_name(base, meta)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " | ".join(str(member.value) for member in annotation)
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if args and get_origin(annotation) in (Union, UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if args:
        origin = getattr(get_origin(annotation), "__name__", "")  # list, dict, tuple
        return f"{origin}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """The default as a ``key=value`` override writes it."""
    # an enum by its value, an object a name stands for (a format) by its name
    value = to_jsonable_python(field.get_default(call_default_factory=True), fallback=str)
    return value if isinstance(value, str) else json.dumps(value)


__all__ = ["ConfigField", "config_fields", "default_text", "describe", "type_name"]
