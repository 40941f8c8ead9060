"""The recovery part of a recipe: a registered method's name and its parameters.

In YAML it is one flat mapping, the method's name next to its own parameters::

    rollout: {recovery: {method: resq, sparsity: "2:4"}}

and in a recipe string the suffix after ``+``: ``"hif4+resq-2:4"``, ``"hif4+smoothquant"``
(``<method>[-<argument>]``, the argument read by the method's config).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializeAsAny,
    ValidationError,
    model_serializer,
    model_validator,
)

from fp4rl.errors import RecipeError
from fp4rl.gemm import OperandFormat
from fp4rl.recovery.base import (
    RecoveryConfig,
    RolloutRecovery,
    get_recovery,
    list_recoveries,
    method_config,
)
from fp4rl.settings import Choices, Variants, problem


def _configs() -> dict[str, type[RecoveryConfig]]:
    """Each registered method's parameters model."""
    return {name: get_recovery(name).config_cls for name in list_recoveries()}


class Recovery(BaseModel):
    """Which recovery method the rollout policy uses, with its parameters: the method's
    own :class:`~fp4rl.recovery.base.RecoveryConfig` model.

    Built from the flat mapping a config holds (``Recovery.model_validate({"method":
    "resq", "sparsity": "2:4"})``, strict: a parameter of another method is an error),
    or with :meth:`make` (``Recovery.make("resq", sparsity="2:4")``); ``Recovery()`` is
    no recovery. It dumps back to the flat mapping.
    """

    model_config = ConfigDict(frozen=True)

    method: Annotated[str, Choices(list_recoveries)] = Field(
        "none", description="the method, by its registered name (its parameters: below)")
    config: Annotated[SerializeAsAny[RecoveryConfig], Variants(_configs)]

    @model_validator(mode="before")
    @classmethod
    def _from_mapping(cls, data: object) -> object:
        """The flat ``{method, <its parameters>}`` as the method and its config model."""
        if isinstance(data, Recovery):
            return data
        if not isinstance(data, dict):
            raise RecipeError(f"rollout.recovery must be a mapping, got {type(data).__name__}")
        if isinstance(data.get("config"), RecoveryConfig):
            method, config = data.get("method", "none"), data["config"]
            expected = get_recovery(method).config_cls
            if type(config) is not expected:
                raise RecipeError(f"rollout.recovery: method {method!r} takes a "
                                  f"{expected.__name__}, got {type(config).__name__}")
            return {"method": method, "config": config}
        params = {k: v for k, v in data.items() if v is not None}  # None: unset
        method = params.pop("method", "none")
        return {"method": method, "config": method_config(method, params)}

    @model_serializer
    def _flat(self) -> dict[str, object]:
        return {"method": self.method, **self.config.model_dump()}

    def __init__(self, method: str = "none", config: RecoveryConfig | None = None,
                 **params: object) -> None:
        data: dict[str, object] = {"method": method, "config": config} if config is not None else \
            {"method": method, **params}
        try:
            super().__init__(**data)
        except ValidationError as err:  # the validators' own words, one line
            raise RecipeError(problem("rollout.recovery", Recovery, err)) from None

    @classmethod
    def make(cls, method: str = "none", **params: object) -> Recovery:
        return cls(method, method_config(method, params))

    @classmethod
    def from_dict(cls, data: object, strict: bool = True) -> Recovery:
        """From ``{method: ..., <its parameters>}``. ``strict=False`` drops parameters the
        method does not have (records written when every method's parameters were saved
        together); a user's mapping is strict, so a misplaced parameter is an error."""
        if isinstance(data, dict) and not strict:
            fields = get_recovery(data.get("method") or "none").config_cls.model_fields
            data = {k: v for k, v in data.items() if k == "method" or k in fields}
        if not isinstance(data, dict):
            raise RecipeError(f"rollout.recovery must be a mapping, got {type(data).__name__}")
        return cls(**data)

    @classmethod
    def parse(cls, text: str) -> Recovery:
        """From a recipe-string suffix: ``""`` (none), ``"resq-2:4"``, ``"smoothquant"``."""
        if not text:
            return cls()
        method, _, arg = text.partition("-")
        try:
            return cls(method, get_recovery(method).config_cls.from_text(arg))
        except RecipeError as err:
            raise RecipeError(f"recovery {text!r}: {err}") from None

    def to_dict(self) -> dict[str, JsonValue]:
        return self.model_dump()

    def replace(self, **changes: object) -> Recovery:
        """A copy with ``changes``; a new ``method`` starts from that method's defaults."""
        method = str(changes.pop("method", self.method))
        params = self.config.model_dump() if method == self.method else {}
        return Recovery.make(method, **{**params, **changes})

    @property
    def label(self) -> str:
        """Short name used in tables and recipe strings: "resq-2:4", "smoothquant", "" for
        none."""
        if self.method == "none":
            return ""
        arg = self.config.text()
        return f"{self.method}-{arg}" if arg else self.method


def make_recovery(recovery: Recovery, act_format: OperandFormat, in_features: int,
                  seed: int, weight_format: OperandFormat | None = None
                  ) -> RolloutRecovery:
    """The configured method's instance for one layer (``weight_format``: the rollout
    weight format, default ``act_format``), the formats as a recipe holds them."""
    return get_recovery(recovery.method)(recovery.config, act_format, in_features, seed,
                                       weight_format=weight_format)


__all__ = ["Recovery", "make_recovery"]
