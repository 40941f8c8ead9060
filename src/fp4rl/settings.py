"""How fp4rl describes a setting: one pydantic field each, with its description (what
``fp4rl train --help-config`` prints) and its type; where the allowed values come from a
registry (formats, recovery methods, rollout engines), a :class:`Choices` marker names
that registry; a field whose model a sibling chooses, :class:`Variants`; a model whose
extra keys are sections of their own (the rollout engines') names them with a class
attribute ``extra_sections``. The training config, the recipe's parts, each recovery
method's parameters and each rollout engine's settings are all such models, so one
generator prints them all and one function words their refusals (:func:`problem`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

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


def marker(metadata: list[Any], kind: type[Choices] | type[Variants]) -> Any:
    """The marker of ``kind`` among a field's metadata, if any."""
    return next((m for m in metadata if isinstance(m, kind)), None)


def problem(section: str, schema: type[BaseModel], err: ValidationError) -> str:
    """The first problem of ``err`` as one line: what the model's own validator said, the
    unknown key and the keys there are, or ``section.key must be ..., got ...`` (the
    field's own ``must`` where it has one)."""
    e = err.errors()[0]
    loc = [str(p) for p in e["loc"]]
    key = loc[0] if loc else ""
    if e["type"] == "value_error":  # the models' validators word their refusals
        return str(e["ctx"]["error"])
    if e["type"] == "extra_forbidden":
        return (f"{section}: unknown key(s) {[key]}; allowed: "
                f"{', '.join(schema.model_fields)}")
    if key not in schema.model_fields:
        return f"{section} must be a mapping of settings, got {e['input']!r}"
    field = schema.model_fields[key]
    extra = field.json_schema_extra
    must = extra.get("must") if isinstance(extra, dict) else None
    where = f"{section}.{key}"  # not the branch of a union pydantic tried last
    if must:
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

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise self.error(problem(self.section, type(self), err)) from None

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated as a new one is (``model_copy`` is not)."""
        return type(self)(**{**dict(self), **changes})


__all__ = ["Choices", "Settings", "Variants", "marker", "problem"]
