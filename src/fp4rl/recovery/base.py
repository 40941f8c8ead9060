"""The rollout-recovery plug-in interface and its registry.

A recovery method decides how one patched linear layer computes its rollout output
from the high-precision input ``x`` (tokens x in_features), given the layer's
quantized weight. Each layer owns one method instance, so per-layer state
(SmoothQuant scales, Hadamard signs) lives there. A method is one module: a
:class:`RecoveryConfig` model with its parameters, a :class:`RolloutRecovery`
subclass naming it as ``config_cls``, and one call ``register(name, method_cls)``.
Nothing else in the package lists methods: recipes, experiment grids and fidelity
tables all read this registry, so a method registered from outside the package is a
first-class citizen as soon as its module is imported.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import ConfigDict

from fp4rl.errors import RecipeError, did_you_mean
from fp4rl.formats import NumberFormat
from fp4rl.gemm import (
    NMOperand,
    Operand,
    OperandFormat,
    PackedOperand,
    has_tensor_scale,
    mm,
    pack_operand,
    quantize_operand,
)
from fp4rl.recovery.sparsity import SparsityPattern
from fp4rl.registry import Registry
from fp4rl.settings import Settings


class RecoveryConfig(Settings):
    """A method's parameters (none here). Subclasses add fields with defaults and
    descriptions (``Field(0.5, description=...)``) and check them with pydantic
    validators; a value of the wrong type or out of range is one line naming it."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    section = "rollout.recovery"
    error = RecipeError

    @classmethod
    def from_text(cls, arg: str) -> RecoveryConfig:
        """The config named by a recipe string's argument (``resq-2:4`` -> ``"2:4"``);
        methods without one refuse any."""
        if arg:
            raise RecipeError(f"this recovery method takes no argument, got {arg!r}")
        return cls()

    def text(self) -> str:
        """The recipe-string argument that :meth:`from_text` reads back ("" for none)."""
        return ""

    @property
    def patterns(self) -> tuple[SparsityPattern, ...]:
        """The sparsity patterns the method keeps its residuals with (none here): what a
        split of the layer across ranks asks of them (:attr:`SparsityPattern.local`)."""
        return ()


class RolloutRecovery(ABC):
    """Per-layer rollout-side treatment of activations (and, if needed, weights)."""

    #: set by :func:`register`
    name: ClassVar[str] = ""
    #: the method's parameters
    config_cls: ClassVar[type[RecoveryConfig]] = RecoveryConfig
    #: the variants experiment grids and fidelity tables run: (recipe-string argument,
    #: table label), in table order; empty means one variant, labelled with the name
    variants: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: whether the method needs the high-precision weight at rollout time (a weight
    #: transform, a high-precision correction term); if not, the 4-bit weight is all a
    #: rollout engine needs, and a sharded trainer sends it packed
    reads_weight: ClassVar[bool] = False
    #: whether the method's rollout is its activation operands times ``Q(W)`` with no
    #: state between calls and no high-precision weight: what a serving engine (fp4rl's
    #: vLLM method) runs with fp4rl's own code
    serves_in_engines: ClassVar[bool] = False

    def __init__(self, config: RecoveryConfig, act_format: OperandFormat,
                 in_features: int, seed: int,
                 weight_format: OperandFormat | None = None) -> None:
        self.config = config
        #: the rollout activation format
        self.act_format = act_format
        #: the rollout weight format (methods that treat the weight as well need it)
        self.weight_format = act_format if weight_format is None else weight_format
        self.in_features = in_features
        self.seed = seed
        #: bumped whenever ``transform_weight`` would change: invalidates the weight cache
        self.version = 0
        self.init_state()

    def init_state(self) -> None:  # noqa: B027  (optional hook)
        """A method's own state, made once the attributes above are set: a method with
        state overrides this, not ``__init__``, so its constructor stays this one."""

    def quantize_act(self, x: torch.Tensor) -> Operand:
        """Q(x) along the reduction axis in the rollout activation format."""
        return quantize_operand(x, self.act_format)

    def begin_step(self) -> None:  # noqa: B027  (optional hook)
        """Called at the start of every RL step (a new policy version)."""

    def prepare(self, x: torch.Tensor, w: torch.Tensor) -> None:  # noqa: B027  (optional hook)
        """Called before each rollout forward, before the quantized weight is fetched."""

    def state_dict(self) -> dict[str, object]:
        """State to checkpoint beyond the config (e.g. random generators)."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:  # noqa: B027  (optional)
        """Restore :meth:`state_dict`."""

    def transform_weight(self, w: torch.Tensor) -> torch.Tensor:
        """High-precision weight transform applied before weight quantization."""
        return w

    def weight_operand(self, w: torch.Tensor, packed: bool = False,
                       tensor_scale: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> Operand | PackedOperand:
        """``Q(W)`` of the rollout: ``w`` (out, in) transformed (:meth:`transform_weight`)
        and quantized along in_features in :attr:`weight_format`; ``packed``: as the
        format's 4-bit codes and scales (the same values). Every consumer of the rollout
        weight takes it from here (the FP4 layer, a refit, the vLLM method, the FSDP2
        gather, a vLLM export), so they agree bit for bit. ``tensor_scale``: the whole
        weight's per-tensor scale, for a shard of it (NVFP4). ``out_dtype``: the values in
        that dtype, written by the kernel where one does (the GEMM's bf16 operand in one
        pass, not a float32 one and a cast), the same values as ``.to(out_dtype)``."""
        w = self.transform_weight(w)
        if packed and isinstance(self.weight_format, NumberFormat):
            return pack_operand(w, self.weight_format, tensor_scale)
        return quantize_operand(w, self.weight_format, -1, tensor_scale=tensor_scale,
                                out_dtype=out_dtype)

    @abstractmethod
    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        """The activation operands that share the quantized weight in the rollout GEMM
        (one for plain FP4; ResQ's two terms where ``dtype`` cannot hold their sum)."""

    def packed_activation(self, x: torch.Tensor, dtype: torch.dtype
                          ) -> list[Operand | NMOperand]:
        """:meth:`activation` for the packed GEMM (:func:`fp4rl.gemm.packed_gemm`), which
        also takes a second term kept n:m sparse (:class:`~fp4rl.gemm.NMOperand`) and
        expands it in registers: the same operands, in fewer bytes where a method has
        such a term. For a caller that has checked :func:`fp4rl.gemm.packed_fusion`."""
        return list(self.activation(x, dtype))

    def packed_nm(self, device: torch.device) -> tuple[int, int] | None:
        """``(keep, group)`` where :meth:`packed_activation` gives an n:m second term for
        rows on ``device`` (a tracer must know the operands' layout without running it),
        else None."""
        return None

    def activation_scales(self, dtype: torch.dtype) -> tuple[bool, ...]:
        """For each operand :meth:`activation` returns in ``dtype``, whether it carries a
        per-tensor scale: a tracer (:mod:`fp4rl.recovery.ops`) must know the operands'
        layout without running it."""
        return (has_tensor_scale(self.act_format),)

    def forward(self, x: torch.Tensor, qw: Operand, w: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """Rollout output in ``dtype``: ``x`` (tokens, in), ``qw`` the quantized weight,
        ``w`` the raw one."""
        return mm(self.activation(x, dtype), qw.t(), dtype, bias)


class NoRecovery(RolloutRecovery):
    """Plain FP4 rollout: ``Q(X) Q(W)^T``."""

    variants = (("", "--"),)
    serves_in_engines = True

    def activation(self, x: torch.Tensor, dtype: torch.dtype) -> list[Operand]:
        return [self.quantize_act(x)]


_METHODS: Registry[type[RolloutRecovery]] = Registry(
    "recovery method", RecipeError,
    hint=" (rollout.recovery.method; a third-party method registers with "
         "fp4rl.recovery.register_recovery)")


def register_recovery(name: str, method_cls: type[RolloutRecovery], *,
                      replace: bool = False) -> type[RolloutRecovery]:
    """Make ``method_cls`` the recovery method called ``name`` in recipes.

    ``name`` is what a recipe says (``rollout.recovery.method: name``, ``"hif4+name"``);
    a name already taken is refused unless ``replace``.
    """
    if not (isinstance(method_cls, type) and issubclass(method_cls, RolloutRecovery)):
        raise RecipeError(f"register_recovery({name!r}, ...): expected a RolloutRecovery "
                          f"subclass, got {method_cls!r}")
    if not name or not name.replace("_", "").isalnum() or name != name.lower():
        raise RecipeError(f"recovery method names are lower-case words, got {name!r}")
    _METHODS.register(name, method_cls, replace=replace)
    method_cls.name = name
    return method_cls


def unregister_recovery(name: str) -> None:
    """Remove a method (tests and notebooks that register temporary ones)."""
    _METHODS.unregister(name)


def list_recoveries() -> list[str]:
    """Registered method names, in registration order (``none`` first)."""
    return _METHODS.names()


def get_recovery(name: str) -> type[RolloutRecovery]:
    """The method class called ``name``; an unknown name is one line with a suggestion."""
    return _METHODS.get(name)


def recovery_variants() -> list[tuple[str, str]]:
    """Every registered method's variants as (recipe-string suffix, table label): ``""``
    for no recovery, ``"smoothquant"``, ``"resq-2:4"``, ... in registration order."""
    out = []
    for name, cls in _METHODS.items():
        for arg, label in cls.variants or (("", name),):
            suffix = "" if name == "none" else f"{name}-{arg}" if arg else name
            out.append((suffix, label))
    return out


def method_config(method: str, params: Mapping[str, object]) -> RecoveryConfig:
    """Build ``method``'s config from a mapping, refusing keys it does not have."""
    cls = get_recovery(method).config_cls
    allowed = list(cls.model_fields)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        owners = {k: [m for m, c in _METHODS.items() if k in c.config_cls.model_fields]
                  for k in unknown}
        hints = "; ".join(f"{k!r} belongs to {', '.join(o)} (unset it: "
                          f"rollout.recovery.{k}=)" if o else
                          f"{k!r}{did_you_mean(k, allowed)}" for k, o in owners.items())
        raise RecipeError(f"rollout.recovery: method {method!r} takes "
                          f"{', '.join(allowed) or 'no parameters'}; {hints}")
    return cls(**params)


register_recovery("none", NoRecovery)

