"""Recipes: which format each operand uses, in the training and in the rollout policy.

A recipe is plain data (frozen pydantic models), loadable from YAML or a dict and
validated against the format and recovery-method registries, with messages that name
the allowed values::

    train:   {weights: hif4, activations: hif4, gradients: hif4}
    rollout: {weights: hif4, activations: hif4, recovery: {method: resq, sparsity: "2:4"}}
    ignore:  ["re:.*mlp\\.down_proj"]     # modules left unquantized (optional)

``"none"`` anywhere means "not quantized" (computed in the run's compute dtype, the
paper's baseline); ``"bf16"`` is read as ``"none"`` there, as the paper writes it.
Recipe names cover every cell of the paper's Table 1:
``get_recipe("hif4:fp4/w4a8")`` is training in HiF4 with a rollout of HiF4 weights and
MXFP8 activations; a suffix ``"+<method>[-<argument>]"`` (``"+resq-2:4"``) adds a
registered rollout recovery method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NotRequired, TypedDict

import yaml
from pydantic import (
    ConfigDict,
    Field,
    JsonValue,
    PlainSerializer,
    PrivateAttr,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fp4rl.errors import RecipeError, did_you_mean
from fp4rl.formats import NumberFormat, get_format, list_formats
from fp4rl.formats.nvfp4 import ScaleRule
from fp4rl.formats.registry import with_scale_rule
from fp4rl.gemm import UNQUANTIZED, NotQuantized, OperandFormat, operand_format
from fp4rl.nn.select import Selector, block_count
from fp4rl.recovery import Recovery
from fp4rl.settings import Choices, Settings

#: rollout precision names of the paper's Table 1 -> (weights, activations) with fp4 = "{f}"
ROLLOUT_PRECISIONS = {
    "bf16": (UNQUANTIZED.name, UNQUANTIZED.name),
    "w4a16": ("{f}", UNQUANTIZED.name),
    "w4a8": ("{f}", "mxfp8_e4m3"),
    "w16a4": (UNQUANTIZED.name, "{f}"),
    "fp4": ("{f}", "{f}"),
}
#: training precision names -> how the backward GEMMs take W and X (moot for bf16, where
#: nothing is quantized); ``fp4-reuse`` is the HiFloat4 authors' simulated backward (see
#: :class:`TrainPrecision`)
TRAIN_PRECISIONS = {"bf16": "requantize", "fp4": "requantize", "fp4-reuse": "reuse_forward"}
#: the training precisions of the paper's Table 1
PAPER_TRAIN_PRECISIONS = ("bf16", "fp4")


class BackwardOperands(StrEnum):
    """How the two backward GEMMs get their W and X operands (see :class:`TrainPrecision`);
    a member equals its value, the spelling configs use."""

    REQUANTIZE = "requantize"
    REUSE_FORWARD = "reuse_forward"
    DEQUANTIZED = "dequantized"


#: the schemes' spellings, the default first
BACKWARD_OPERANDS = tuple(b.value for b in BackwardOperands)


class WgradHadamard(StrEnum):
    """Whether the weight-gradient GEMM's operands ``dY`` and ``X`` are rotated along the
    tokens by a random Hadamard transform before they are quantized, and whose signs."""

    OFF = "off"
    FIXED = "fixed"  # one draw a layer, from its seed
    FRESH = "fresh"  # a new draw at every forward, from torch's generator


#: the token block a weight-gradient Hadamard transform mixes (torchao's 16)
WGRAD_HADAMARD_BLOCK = 16


#: the number format whose name a recipe reads as :data:`UNQUANTIZED` (the paper's
#: "BF16" rows: not quantized, in the compute dtype)
READ_AS_UNQUANTIZED = "bf16"


def quantized_formats() -> list[str]:
    """Registered formats other than ``bf16`` (the ones a recipe name's ``<fmt>`` may name)."""
    return [f for f in list_formats() if f != READ_AS_UNQUANTIZED]


def operand_formats() -> list[str]:
    """What a recipe's operand takes: ``none`` (not quantized), or a quantized format."""
    return [UNQUANTIZED.name, *quantized_formats()]


def _operand_format(value: object, where: str) -> OperandFormat:
    """An operand's format as a recipe holds it: a format object taken as it is (the
    registered one of its name, as a recipe travels by names), a name read here."""
    if isinstance(value, NotQuantized):
        return UNQUANTIZED
    if isinstance(value, NumberFormat) and value.name in quantized_formats():
        if get_format(value.name) is not value:
            raise RecipeError(f"{where}: {value!r} is not the registered {value.name} format "
                              f"object; register it, or name it ({value.name!r})")
        return value
    name = value.lower() if isinstance(value, str) else value
    name = UNQUANTIZED.name if name == READ_AS_UNQUANTIZED else name
    if not isinstance(name, str) or name not in operand_formats():
        hint = did_you_mean(value, operand_formats())
        raise RecipeError(f"{where}: {value!r} is not a format{hint}; choose one of "
                          f"{', '.join(operand_formats())} ({READ_AS_UNQUANTIZED} reads as "
                          f"{UNQUANTIZED})")
    return operand_format(name)


def _weight_format(value: object, where: str) -> OperandFormat:
    """A weight's format: not one with a scale per vector, which a GEMM keeps outside the
    product only along its other axis (tokens), not along a weight's."""
    fmt = _operand_format(value, where)
    if isinstance(fmt, NumberFormat) and fmt.fixed_scale:
        raise RecipeError(f"{where}: {fmt} fixes an activation's scale per layer; a weight "
                          f"takes {fmt.weight_format}")
    if isinstance(fmt, NumberFormat) and fmt.vector_scales:
        raise RecipeError(f"{where}: {fmt} scales each token's vector, which a weight "
                          f"cannot take; use {fmt.weight_format or 'another format'} for the "
                          "weights")
    return fmt


#: an operand's format: :data:`~fp4rl.gemm.UNQUANTIZED` or a registered number format,
#: read from its name (case-insensitive) and written as it
Format = Annotated[OperandFormat, Choices(operand_formats), PlainSerializer(str, return_type=str)]


def _weight_format_of(fmt: str) -> str:
    """What a weight takes in a recipe named after ``fmt`` (NVFP4 for ``nvfp4_per_token``)."""
    return fmt if fmt == UNQUANTIZED.name else get_format(fmt).weight_format or fmt


class _Precision(Settings):
    """What both policies' settings share: operands' formats, read from their registered
    names into the format objects (a weight's without per-vector scales), each refused in
    one line naming its field."""

    model_config = ConfigDict(arbitrary_types_allowed=True)  # the format objects
    error = RecipeError

    @field_validator("weights", "activations", "gradients", mode="before",
                     check_fields=False)
    @classmethod
    def _a_format(cls, value: object, info: ValidationInfo) -> OperandFormat:
        check = _weight_format if info.field_name == "weights" else _operand_format
        return check(value, f"{cls.section}.{info.field_name}")


class TrainPrecision(_Precision):
    """Formats of the training policy's three GEMM operands, and where the backward GEMMs
    take W and X from.

    ``backward_operands``: ``requantize`` (default) quantizes W and X afresh along each
    backward GEMM's own reduction axis (W along out_features for the input gradient, X
    along tokens for the weight gradient), as block-scaled FP4 hardware needs;
    ``reuse_forward`` multiplies the new ``Q(dY)`` with the forward's ``Q(W)`` and ``Q(X)``
    (blocked along in_features), as the HiFloat4 authors' simulation (``QLinear.py``)
    does. With ``gradients: none``, ``reuse_forward`` is the exact gradient of the
    quantized forward (straight-through quantizers). ``dequantized`` (NeMo-RL's and
    Miles's FP4 recipes) runs both backward GEMMs in the compute dtype on the forward's
    ``Q(W)`` and ``Q(X)`` with their scales multiplied in, and unquantized gradients: the
    values a bf16 GEMM gets after dequantizing, which any scale allows (a per-token one
    too, which ``reuse_forward`` cannot keep outside its weight-gradient GEMM).
    """

    section = "train"

    weights: Format = Field(UNQUANTIZED, description="the weights' format in the three "
                            "training GEMMs (none: not quantized; bf16 reads as none)")
    activations: Format = Field(UNQUANTIZED, description="the layer inputs' format in the "
                                "forward and weight-gradient GEMMs")
    gradients: Format = Field(UNQUANTIZED, description="the output gradients' format in the "
                              "two backward GEMMs")
    stochastic_gradients: StrictBool = Field(False, description="round the output gradients "
                                             "stochastically (unbiased)")
    backward_operands: BackwardOperands = Field(
        BackwardOperands.REQUANTIZE, description="requantize: W and X quantized afresh along "
        "each backward GEMM's own reduction axis; reuse_forward: the forward's Q(W) and "
        "Q(X); dequantized: the forward's Q(W) and Q(X) dequantized into the compute dtype, "
        "gradients unquantized")
    wgrad_hadamard: WgradHadamard = Field(
        WgradHadamard.OFF, description="a random Hadamard transform of 16-token blocks on "
        "the weight-gradient GEMM's dY and X along the tokens before they are quantized "
        "(torchao's NVFP4 training; the product is unchanged, outliers are spread): off, "
        "fixed (signs drawn once a layer, from its seed) or fresh (new signs at every "
        "forward); needs backward_operands: requantize")

    @field_validator("backward_operands", mode="before")
    @classmethod
    def _a_scheme(cls, value: object) -> object:
        if value not in BACKWARD_OPERANDS:
            hint = did_you_mean(value, BACKWARD_OPERANDS)
            raise RecipeError(f"train.backward_operands: {value!r} is not a backward "
                              f"scheme{hint}; choose one of {', '.join(BACKWARD_OPERANDS)}")
        return value

    @model_validator(mode="after")
    def _operands_fit_the_scheme(self) -> TrainPrecision:
        if self.backward_operands is BackwardOperands.REUSE_FORWARD and \
                isinstance(self.activations, NumberFormat) and self.activations.vector_scales:
            raise RecipeError(f"train.activations: {self.activations} scales each token, and "
                              "reuse_forward multiplies the forward's Q(X) along the tokens, "
                              "where a per-token scale does not factor out; use "
                              "backward_operands: requantize or dequantized")
        if self.wgrad_hadamard is not WgradHadamard.OFF and \
                self.backward_operands is not BackwardOperands.REQUANTIZE:
            raise RecipeError(f"train.wgrad_hadamard: {self.wgrad_hadamard} rotates dY and X "
                              "along the tokens, where only backward_operands: requantize "
                              f"quantizes them (not {self.backward_operands}); set "
                              "backward_operands: requantize or wgrad_hadamard: off")
        if self.backward_operands is BackwardOperands.DEQUANTIZED and \
                self.gradients is not UNQUANTIZED:
            raise RecipeError(f"train.gradients: {self.gradients} with backward_operands: "
                              "dequantized, whose backward GEMMs run in the compute dtype on "
                              f"unquantized gradients; set gradients: {UNQUANTIZED} "
                              "(or backward_operands: reuse_forward)")
        return self


class RolloutPrecision(_Precision):
    """Formats of the rollout policy (forward only) and its activation recovery."""

    section = "rollout"

    weights: Format = Field(UNQUANTIZED, description="the rollout weights' format (none: "
                            "not quantized; bf16 reads as none)")
    activations: Format = Field(UNQUANTIZED, description="the rollout activations' format")
    recovery: Recovery = Field(default_factory=Recovery, description="the method that "
                               "repairs the rollout activations' quantization (a registered "
                               "method's name), with its parameters beside it")


class RecipeDict(TypedDict):
    """A recipe as YAML writes it (:meth:`Recipe.to_dict`): each part's settings by name,
    ``ignore`` only where it is set."""

    train: dict[str, JsonValue]
    rollout: dict[str, JsonValue]
    ignore: NotRequired[list[str]]


class Recipe(Settings):
    """Training-side and rollout-side precision of every patched linear layer."""

    section = "recipe"
    error = RecipeError

    train: TrainPrecision = Field(default_factory=TrainPrecision)
    rollout: RolloutPrecision = Field(default_factory=RolloutPrecision)
    #: modules left unquantized: regexes matched against the whole module name (a
    #: compressed-tensors style ``re:`` prefix is accepted), or selectors of blocks by
    #: position (``first:N``, ``last:N``, ``last:<fraction>``) or of linears by kind
    #: (``kind:attention``, ``kind:mlp``): :mod:`fp4rl.nn.select`
    ignore: tuple[str, ...] = ()
    _selectors: tuple[Selector, ...] = PrivateAttr(default=())

    @field_validator("ignore", mode="before")
    @classmethod
    def _selectors_parse(cls, value: object) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, list | tuple) or \
                not all(isinstance(p, str) for p in value):
            raise RecipeError(f"ignore must be a list of regexes or selectors, got {value!r}")
        return tuple(Selector.parse(p).text for p in value)

    def model_post_init(self, context: object) -> None:
        self._selectors = tuple(Selector.parse(p) for p in self.ignore)

    @model_validator(mode="after")
    def _static_scale_without_recovery(self) -> Recipe:
        """A static activation scale and a rollout recovery method do not go together: the
        method's residual would be quantized with the activation's fixed scale."""
        act = self.rollout.activations
        if isinstance(act, NumberFormat) and act.fixed_scale and \
                self.rollout.recovery.method != "none":
            raise RecipeError(f"rollout.activations {act} takes no recovery method (got "
                              f"{self.rollout.recovery.label}): its residual would be "
                              "quantized with the activation's fixed scale")
        return self

    def ignores(self, module_name: str, blocks: int | None = None) -> bool:
        """Whether ``ignore`` leaves the module called ``module_name`` unquantized, in a
        model of ``blocks`` transformer blocks (needed by ``last:`` only)."""
        return any(s.matches(module_name, blocks) for s in self._selectors)

    def ignores_in(self, names: Iterable[str]) -> Callable[[str], bool]:
        """:meth:`ignores` for the modules of one model, whose module ``names`` give its
        block count."""
        blocks = block_count(list(names))
        return lambda module_name: self.ignores(module_name, blocks)

    @classmethod
    def from_dict(cls, data: Mapping[str, object], strict: bool = True) -> Recipe:
        """Build from a mapping (as in a YAML file); unknown keys are errors.

        ``strict=False`` reads saved records, whose recovery section may carry parameters
        of other methods (see :meth:`fp4rl.recovery.Recovery.from_dict`)."""
        if not isinstance(data, dict):
            raise RecipeError(f"a recipe must be a mapping, got {type(data).__name__}")
        _settings(data, {"train", "rollout", "model", "ignore"}, "recipe")
        train = _settings(data.get("train") or {}, set(TrainPrecision.model_fields), "train")
        rollout = dict(_settings(data.get("rollout") or {}, set(RolloutPrecision.model_fields),
                                 "rollout"))
        recovery = Recovery.from_dict(rollout.pop("recovery", None) or {}, strict)
        return cls(train=TrainPrecision(**train),
                   rollout=RolloutPrecision(**rollout, recovery=recovery),
                   ignore=data.get("ignore") or ())

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        """Load from a YAML file (a full training config's extra keys are ignored there)."""
        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})

    def with_nvfp4_scale(self, rule: ScaleRule) -> Recipe:
        """This recipe with its NVFP4 activations' second-level scale under ``rule``
        (:class:`fp4rl.formats.nvfp4.ScaleRule`; :func:`scale_rule` reads its name), in
        both policies: weights and gradients keep theirs (a weight's amax does not depend
        on a batch). Refused in one line where there is no NVFP4 activation to change, a
        per-token scale is asked to be static, or ``static`` meets a recovery method (its
        residual would take the activation's scale)."""
        acts = {"train": self.train.activations, "rollout": self.rollout.activations}
        scaled = {k: f for k, f in acts.items()
                  if isinstance(f, NumberFormat) and f.scale_rule is not None}
        if not scaled:
            if rule is ScaleRule.DYNAMIC:
                return self
            raise RecipeError(f"nvfp4_scale={rule} changes NVFP4 activations' scale; this "
                              "recipe's activations are "
                              f"{' and '.join(sorted({str(f) for f in acts.values()}))}")
        changed: dict[str, OperandFormat] = {}
        for where, fmt in scaled.items():
            variant = with_scale_rule(fmt, rule)
            if variant is None:
                why = " (a per-token scale is the token's own already)" \
                    if fmt.vector_scales else ""
                base = with_scale_rule(fmt, ScaleRule.DYNAMIC) or fmt
                raise RecipeError(f"{where}.activations: {base} takes no {rule} "
                                  f"second-level scale{why}")
            changed[where] = variant
        return self.replace(
            train=self.train.replace(activations=changed.get("train", self.train.activations)),
            rollout=self.rollout.replace(
                activations=changed.get("rollout", self.rollout.activations)))

    def to_dict(self) -> RecipeDict:
        """The YAML mapping :meth:`from_dict` reads back (``ignore`` only when set)."""
        data = RecipeDict(train=self.train.model_dump(mode="json"),
                          rollout=self.rollout.model_dump(mode="json"))
        if self.ignore:
            data["ignore"] = list(self.ignore)
        return data


def scale_rule(name: object) -> ScaleRule:
    """The NVFP4 second-level scale rule ``name`` names (``dynamic``, ``pow2``,
    ``static``), read where a name is given (a config, a recipe spec); refused in one line
    otherwise."""
    if isinstance(name, str) and name in set(ScaleRule):
        return ScaleRule(name)
    raise RecipeError(f"nvfp4_scale must be one of {', '.join(ScaleRule)}, got {name!r}")


def _settings(data: object, allowed: set[str], where: str) -> Mapping[str, object]:
    """``data`` as a mapping of ``where``'s settings: refused in one line where it is not
    a mapping, or where it has a key ``allowed`` lacks."""
    if not isinstance(data, Mapping):
        raise RecipeError(f"{where} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}"
                          f"{did_you_mean(unknown[0], sorted(allowed))}; "
                          f"allowed: {sorted(allowed)}")
    return data


def _field_recipes() -> dict[str, Recipe]:
    """The field's FP4 RL recipes, dense analogues of what their sources run
    (docs/layers.md, "The field's recipes", says where each differs)."""
    nvfp4 = TrainPrecision(weights="nvfp4", activations="nvfp4",
                           backward_operands="dequantized")
    miles = TrainPrecision(weights="nvfp4_4o6", activations="nvfp4_per_token_4o6",
                           backward_operands="dequantized")
    return {
        # NeMo-RL (PR 3566): NVFP4 W4A4 in training and rollout, attention and the
        # boundary layers in BF16 (Megatron's first_last_layers_bf16: the first 2 and the
        # last 4 of its recipe), the backward dequantized
        "nemo-rl-nvfp4": Recipe(train=nvfp4,
                                rollout=RolloutPrecision(weights="nvfp4", activations="nvfp4"),
                                ignore=("kind:attention", "first:2", "last:4")),
        # Miles (PR 1261): per-token NVFP4 activation scales, Four Over Six block
        # scales, the backward dequantized, the last 15% of the blocks in BF16
        "miles-nvfp4": Recipe(train=miles,
                              rollout=RolloutPrecision(weights="nvfp4_4o6",
                                                       activations="nvfp4_per_token_4o6"),
                              ignore=("last:0.15",)),
        # torchao (0.18) NVFP4 training: 16 x 16 weight tiles (Q(W) and Q(W^T) agree),
        # NVFP4 activations and stochastically rounded NVFP4 gradients in requantized
        # backward GEMMs, a random Hadamard transform on the weight gradient's operands
        "torchao-nvfp4": Recipe(train=TrainPrecision(weights="nvfp4_2d", activations="nvfp4",
                                                     gradients="nvfp4",
                                                     stochastic_gradients=True,
                                                     wgrad_hadamard="fixed"),
                                rollout=RolloutPrecision(weights="nvfp4_2d",
                                                         activations="nvfp4")),
    }


def field_recipe_names() -> list[str]:
    """Names of the field's recipes :func:`get_recipe` takes (``nemo-rl-nvfp4``, ...)."""
    return list(_field_recipes())


def as_recipe(recipe: Recipe | str) -> Recipe:
    """The recipe a public function was given: a :class:`Recipe` as it is, a name read
    (:func:`get_recipe`). The functions that take either read it here, once, and pass the
    object down."""
    return get_recipe(recipe) if isinstance(recipe, str) else recipe


def get_recipe(name: str) -> Recipe:
    """The recipe a recipe name stands for.

    ``"bf16"``; ``"<fmt>"`` (full FP4 training and rollout); ``"<fmt>:<train>/<rollout>"``
    with train in {bf16, fp4} and rollout in {bf16, w4a16, w4a8, w16a4, fp4} (the paper's
    Table 1), or train ``fp4-reuse``: FP4 training whose backward GEMMs reuse the
    forward's Q(W) and Q(X) (``backward_operands: reuse_forward``); any of them with a
    recovery suffix ``"+<method>[-<argument>]"`` naming a registered method
    (``"+resq-2:4"``); or one of the field's recipes (:func:`field_recipe_names`), with
    a recovery suffix too.
    """
    if not isinstance(name, str):
        raise RecipeError(f"a recipe name must be a string, got {type(name).__name__}")
    base, _, recovery = name.partition("+")
    field_recipes = _field_recipes()
    if base in field_recipes:
        recipe = field_recipes[base]
        return recipe.replace(rollout=recipe.rollout.replace(recovery=Recovery.parse(recovery)))
    if base == "bf16":
        fmt, train, rollout = "hif4", "bf16", "bf16"
    else:
        fmt, _, cell = base.partition(":")
        train, _, rollout = (cell or "fp4/fp4").partition("/")
        if fmt not in quantized_formats() or train not in TRAIN_PRECISIONS or \
                rollout not in ROLLOUT_PRECISIONS:
            raise RecipeError(
                f"unknown recipe {name!r}{did_you_mean(fmt, quantized_formats())}: use 'bf16', "
                f"'<fmt>' or '<fmt>:<train>/<rollout>' with fmt in "
                f"{', '.join(quantized_formats())}, train in {', '.join(TRAIN_PRECISIONS)}, "
                f"rollout in {', '.join(ROLLOUT_PRECISIONS)}, or one of the field's recipes "
                f"({', '.join(field_recipes)}), optionally '+<recovery method>' "
                f"(e.g. '+resq-2:4')")
    t = UNQUANTIZED.name if train == "bf16" else fmt
    w, a = (v.format(f=fmt) for v in ROLLOUT_PRECISIONS[rollout])
    return Recipe(train=TrainPrecision(weights=_weight_format_of(t), activations=t, gradients=t,
                                       backward_operands=TRAIN_PRECISIONS[train]),
                  rollout=RolloutPrecision(weights=_weight_format_of(w), activations=a,
                                           recovery=Recovery.parse(recovery)))


def table1_recipes(fmt: str) -> list[str]:
    """Recipe names of every row of the paper's Table 1 for one FP4 format."""
    return ["bf16"] + [f"{fmt}:{t}/{r}" for t in PAPER_TRAIN_PRECISIONS
                       for r in ROLLOUT_PRECISIONS if (t, r) != ("bf16", "bf16")]

