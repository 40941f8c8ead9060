"""How fp4rl describes a setting: one pydantic field each, with its description (what
``fp4rl train --help-config`` prints) and its type; where the allowed values come from a
registry (formats, recovery methods, rollout engines), a :class:`Choices` marker names
that registry; a field whose model a sibling chooses, :class:`Variants`; a model whose
extra keys are sections of their own (engines registered at run time) names them with a class
attribute ``extra_sections``. The training config, the recipe's parts, each recovery
method's parameters and each rollout engine's settings are all such models, so one
generator prints them all and one function words their refusals (:func:`problem`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import UnionType
from typing import ClassVar, Self, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from fp4rl.errors import UserError


@dataclass(frozen=True)
class Choices:
    """``Annotated[str, Choices(list_formats)]``: a value named from a registry, whose
    names (and, where given, a line on each) the help reads when it prints the setting."""

    names: Callable[[], list[str]]
    described: Callable[[], dict[str, str]] | None = None


@dataclass(frozen=True)
class Variants:
    """``Annotated[Base, Variants(...)]``: a field whose model is one of several,
    chosen by a sibling setting (a recovery method's parameters by ``method``), written
    flat beside it; ``models`` gives each choice's model, which the help prints."""

    models: Callable[[], dict[str, type[BaseModel]]]


_Marker = TypeVar("_Marker", Choices, Variants)


def marker(metadata: list[object], kind: type[_Marker]) -> _Marker | None:
    """The marker of ``kind`` among a field's metadata, if any."""
    return next((m for m in metadata if isinstance(m, kind)), None)


def section_model(annotation: object) -> type[BaseModel] | None:
    """The model of a field that is a section of settings: ``Model`` or ``Model | None``
    (a section that may be absent, as ``rollout.vllm``); None for a plain setting."""
    if isinstance(annotation, type):
        return annotation if issubclass(annotation, BaseModel) else None
    if get_origin(annotation) in (Union, UnionType):
        models = [a for a in get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return section_model(models[0])
    return None


def problem(section: str, schema: type[BaseModel], err: ValidationError) -> str:
    """The first problem of ``err`` as one line: what the model's own validator said, the
    unknown key and the keys there are, or ``section.key must be ..., got ...`` (the
    field's own ``must`` where it has one), in the innermost section it concerns."""
    return _problem(section, schema, err.errors()[0], 0)


def _problem(section: str, schema: type[BaseModel], e: ErrorDetails, depth: int) -> str:
    loc = [str(p) for p in e["loc"]][depth:]
    key = loc[0] if loc else ""
    if e["type"] == "value_error":  # the models' validators word their refusals
        return str(e["ctx"]["error"])
    field = schema.model_fields.get(key)
    inner = section_model(field.annotation) if field is not None else None
    where = f"{section}.{key}" if section else key
    if inner is not None and len(loc) > 1:  # a section's own setting
        return _problem(where, inner, e, depth + 1)
    if inner is not None and e["type"] != "extra_forbidden":
        return f"{where} must be a mapping of settings, got {e['input']!r}"
    if e["type"] == "extra_forbidden":
        return (f"{section}: unknown key(s) {[key]}; allowed: "
                f"{', '.join(schema.model_fields)}")
    if field is None:
        return f"{section} must be a mapping of settings, got {e['input']!r}"
    extra = field.json_schema_extra
    must = extra.get("must") if isinstance(extra, dict) else None
    if must:  # not the branch of a union pydantic tried last
        return f"{where} must be {must}, got {e['input']!r}"
    if isinstance(field.annotation, type) and len(loc) == 1:
        return f"{where}: expected {field.annotation.__name__}, got {e['input']!r}"
    return f"{where}: {e['msg'][:1].lower()}{e['msg'][1:]}, got {e['input']!r}"


class Settings(BaseModel):
    """A frozen, closed group of settings that refuses a bad value in one line, as the
    :class:`~fp4rl.errors.UserError` subclass ``error`` (direct construction as well as
    validation inside a larger model, where pydantic reports the whole path)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: where these settings sit in a training config (``train``, ``rollout.recovery``)
    section: ClassVar[str] = ""
    #: what a bad value raises when the model is built directly
    error: ClassVar[type[UserError]] = UserError

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise self.error(problem(self.section, type(self), err)) from None

    def replace(self, **changes: object) -> Self:
        """A copy with ``changes``, validated as a new one is (``model_copy`` is not)."""
        return type(self)(**{**dict(self), **changes})


__all__ = ["Choices", "Settings", "Variants", "marker", "problem", "section_model"]
