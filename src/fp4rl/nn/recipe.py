"""Recipes: which format each operand uses, in the training and in the rollout policy.

A recipe is plain data (frozen dataclasses), loadable from YAML or a dict and
validated with messages that name the allowed values::

    train:   {weights: hif4, activations: hif4, gradients: hif4}
    rollout: {weights: hif4, activations: hif4, recovery: {method: resq, sparsity: "2:4"}}

``"bf16"`` anywhere means "not quantized" (rounded to bfloat16, the paper's baseline).
Presets cover every cell of the paper's Table 1: ``preset("hif4:fp4/w4a8")`` is
training in HiF4 with a rollout of HiF4 weights and MXFP8 activations; a suffix such as
``"+resq-2:4"`` adds a rollout recovery method.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fp4rl.errors import UserError
from fp4rl.formats import list_formats

FP4_FORMATS = ("hif4", "mxfp4", "nvfp4")
RECOVERY_METHODS = ("none", "resq", "smoothquant", "rht", "occ")
#: rollout precision names of the paper's Table 1 -> (weights, activations) with fp4 = "{f}"
ROLLOUT_PRESETS = {
    "bf16": ("bf16", "bf16"),
    "w4a16": ("{f}", "bf16"),
    "w4a8": ("{f}", "mxfp8_e4m3"),
    "w16a4": ("bf16", "{f}"),
    "fp4": ("{f}", "{f}"),
}
TRAIN_PRESETS = ("bf16", "fp4")


class RecipeError(UserError):
    """A malformed recipe: the message says which field and what is allowed."""


def _check_format(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in list_formats():
        raise RecipeError(f"{where}: {value!r} is not a format; choose one of "
                          f"{', '.join(list_formats())}")
    return value.lower()


@dataclass(frozen=True)
class Recovery:
    """Rollout-side activation recovery and its parameters.

    method: none | resq | smoothquant | rht | occ
    sparsity: ResQ pattern ("dense", "2:4", "channel:0.5", "block:32x64:0.5", any "n:m")
    alpha: SmoothQuant migration strength (s = max|X|^a / max|W|^(1-a))
    block_size / fresh_signs: RHT block along the reduction axis; redraw signs every step
    quantile: OCC clamping quantile of |X| (the clipped outliers go through a sparse
              high-precision matmul)
    """

    method: str = "none"
    sparsity: str = "2:4"
    alpha: float = 0.5
    block_size: int = 128
    fresh_signs: bool = False
    quantile: float = 0.99

    def __post_init__(self) -> None:
        if self.method not in RECOVERY_METHODS:
            raise RecipeError(f"rollout.recovery.method: {self.method!r} is not one of "
                              f"{', '.join(RECOVERY_METHODS)}")
        from fp4rl.recovery.sparsity import parse_pattern

        parse_pattern(self.sparsity)  # raises with the accepted forms
        if not 0.0 <= self.alpha <= 1.0:
            raise RecipeError(f"rollout.recovery.alpha must be in [0, 1], got {self.alpha}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise RecipeError(f"rollout.recovery.block_size must be a power of two, "
                              f"got {self.block_size}")
        if not 0.0 < self.quantile < 1.0:
            raise RecipeError(f"rollout.recovery.quantile must be in (0, 1), got {self.quantile}")

    @property
    def label(self) -> str:
        """Short name used in tables: "resq-2:4", "smoothquant", "" for none."""
        if self.method == "none":
            return ""
        return f"resq-{self.sparsity}" if self.method == "resq" else self.method


@dataclass(frozen=True)
class TrainPrecision:
    """Formats of the training policy's three GEMM operands."""

    weights: str = "bf16"
    activations: str = "bf16"
    gradients: str = "bf16"
    stochastic_gradients: bool = False

    def __post_init__(self) -> None:
        for name in ("weights", "activations", "gradients"):
            object.__setattr__(self, name, _check_format(getattr(self, name), f"train.{name}"))


@dataclass(frozen=True)
class RolloutPrecision:
    """Formats of the rollout policy (forward only) and its activation recovery."""

    weights: str = "bf16"
    activations: str = "bf16"
    recovery: Recovery = field(default_factory=Recovery)

    def __post_init__(self) -> None:
        for name in ("weights", "activations"):
            object.__setattr__(self, name, _check_format(getattr(self, name), f"rollout.{name}"))


@dataclass(frozen=True)
class Recipe:
    """Training-side and rollout-side precision of every patched linear layer."""

    train: TrainPrecision = field(default_factory=TrainPrecision)
    rollout: RolloutPrecision = field(default_factory=RolloutPrecision)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        """Build from a mapping (as in a YAML file); unknown keys are errors."""
        if not isinstance(data, dict):
            raise RecipeError(f"a recipe must be a mapping, got {type(data).__name__}")
        _reject_unknown(data, {"train", "rollout", "model"}, "recipe")
        train = data.get("train") or {}
        rollout = dict(data.get("rollout") or {})
        _reject_unknown(train, {f.name for f in dataclasses.fields(TrainPrecision)}, "train")
        _reject_unknown(rollout, {f.name for f in dataclasses.fields(RolloutPrecision)},
                        "rollout")
        recovery = rollout.pop("recovery", None) or {}
        _reject_unknown(recovery, {f.name for f in dataclasses.fields(Recovery)},
                        "rollout.recovery")
        return cls(TrainPrecision(**train), RolloutPrecision(**rollout, recovery=Recovery(
            **recovery)))

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        """Load from a YAML file (a full training config's extra keys are ignored there)."""
        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_recovery(self, **changes: Any) -> Recipe:
        """A copy whose rollout recovery has ``changes`` applied."""
        recovery = dataclasses.replace(self.rollout.recovery, **changes)
        return dataclasses.replace(self, rollout=dataclasses.replace(self.rollout,
                                                                     recovery=recovery))


def _reject_unknown(data: dict[str, Any], allowed: set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise RecipeError(f"{where} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def preset(name: str) -> Recipe:
    """A named recipe.

    ``"bf16"``; ``"<fmt>"`` (full FP4 training and rollout); ``"<fmt>:<train>/<rollout>"``
    with train in {bf16, fp4} and rollout in {bf16, w4a16, w4a8, w16a4, fp4} (the paper's
    Table 1); any of them with a recovery suffix ``"+resq-<pattern>"``, ``"+smoothquant"``,
    ``"+rht"`` or ``"+occ"``.
    """
    base, _, recovery = name.partition("+")
    if base == "bf16":
        fmt, train, rollout = "hif4", "bf16", "bf16"
    else:
        fmt, _, cell = base.partition(":")
        train, _, rollout = (cell or "fp4/fp4").partition("/")
        if fmt not in FP4_FORMATS or train not in TRAIN_PRESETS or rollout not in ROLLOUT_PRESETS:
            raise RecipeError(
                f"unknown preset {name!r}: use 'bf16', '<fmt>' or '<fmt>:<train>/<rollout>' "
                f"with fmt in {FP4_FORMATS}, train in {TRAIN_PRESETS}, rollout in "
                f"{tuple(ROLLOUT_PRESETS)}, optionally '+resq-<pattern>', '+smoothquant', "
                f"'+rht' or '+occ'")
    t = fmt if train == "fp4" else "bf16"
    w, a = (v.format(f=fmt) for v in ROLLOUT_PRESETS[rollout])
    return Recipe(TrainPrecision(t, t, t), RolloutPrecision(w, a, _recovery(recovery)))


def _recovery(text: str) -> Recovery:
    if not text:
        return Recovery()
    method, _, pattern = text.partition("-")
    if method == "resq":
        return Recovery("resq", sparsity=pattern or "dense")
    if pattern or method not in RECOVERY_METHODS:
        raise RecipeError(f"unknown recovery {text!r}: use resq-<pattern>, smoothquant, rht, occ")
    return Recovery(method)


def table1_presets(fmt: str) -> list[str]:
    """Preset names of every row of the paper's Table 1 for one FP4 format."""
    return ["bf16"] + [f"{fmt}:{t}/{r}" for t in TRAIN_PRESETS for r in ROLLOUT_PRESETS
                       if (t, r) != ("bf16", "bf16")]
