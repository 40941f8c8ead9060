"""The recovery part of a recipe: a registered method's name and its parameters.

In YAML it is one flat mapping, the method's name next to its own parameters::

    rollout: {recovery: {method: resq, sparsity: "2:4"}}

and in a recipe string the suffix after ``+``: ``"hif4+resq-2:4"``, ``"hif4+smoothquant"``
(``<method>[-<argument>]``, the argument read by the method's config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fp4rl.errors import RecipeError
from fp4rl.recovery.base import RecoveryConfig, RolloutRecovery, get_recovery, method_config


@dataclass(frozen=True)
class Recovery:
    """Which recovery method the rollout policy uses, with its parameters.

    ``config`` defaults to the method's own defaults; :meth:`make` builds one from
    keyword parameters (``Recovery.make("resq", sparsity="2:4")``).
    """

    method: str = "none"
    config: RecoveryConfig | None = None

    def __post_init__(self) -> None:
        cls = get_recovery(self.method)
        config = cls.config_cls() if self.config is None else self.config
        if not isinstance(config, cls.config_cls):
            raise RecipeError(f"rollout.recovery: method {self.method!r} takes a "
                              f"{cls.config_cls.__name__}, got {type(config).__name__}")
        object.__setattr__(self, "config", config)

    @classmethod
    def make(cls, method: str = "none", **params: Any) -> Recovery:
        return cls(method, method_config(method, params))

    @classmethod
    def from_dict(cls, data: dict[str, Any], strict: bool = True) -> Recovery:
        """From ``{method: ..., <its parameters>}``. ``strict=False`` drops parameters the
        method does not have (records written when every method's parameters were saved
        together); a user's mapping is strict, so a misplaced parameter is an error."""
        if not isinstance(data, dict):
            raise RecipeError(f"rollout.recovery must be a mapping, got {type(data).__name__}")
        params = {k: v for k, v in data.items() if v is not None}  # None: unset
        method = params.pop("method", "none")
        if not strict:
            fields = {f.name for f in dataclasses.fields(get_recovery(method).config_cls)}
            params = {k: v for k, v in params.items() if k in fields}
        return cls(method, method_config(method, params))

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

    def to_dict(self) -> dict[str, Any]:
        assert self.config is not None  # __post_init__ fills it in
        return {"method": self.method, **dataclasses.asdict(self.config)}

    def replace(self, **changes: Any) -> Recovery:
        """A copy with ``changes``; a new ``method`` starts from that method's defaults."""
        method = changes.pop("method", self.method)
        params = self.to_dict() if method == self.method else {}
        params.pop("method", None)
        return Recovery.make(method, **{**params, **changes})

    @property
    def label(self) -> str:
        """Short name used in tables and recipe strings: "resq-2:4", "smoothquant", "" for
        none."""
        if self.method == "none":
            return ""
        assert self.config is not None  # __post_init__ fills it in
        arg = self.config.text()
        return f"{self.method}-{arg}" if arg else self.method


def make_recovery(recovery: Recovery, act_format: str, in_features: int,
                  seed: int, weight_format: str | None = None) -> RolloutRecovery:
    """The configured method's instance for one layer (``weight_format``: the rollout
    weight format, default ``act_format``)."""
    assert recovery.config is not None  # Recovery.__post_init__ fills it in
    return get_recovery(recovery.method)(recovery.config, act_format, in_features, seed,
                                       weight_format=weight_format)


__all__ = ["Recovery", "make_recovery"]
