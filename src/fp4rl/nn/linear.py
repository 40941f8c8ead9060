"""The FP4 linear layer: one module, two policies.

In **train** mode all three GEMMs are quantized along their own reduction axes, each
operand re-quantized from high precision (master weights stay FP32)::

    forward          Y  = Q_a(X) Q_w(W)^T          (along in_features)
    input gradient   dX = Q_g(dY) Q_w(W)           (along out_features)
    weight gradient  dW = Q_g(dY)^T Q_a(X)         (along tokens)

That is ``train.backward_operands: requantize``, what block-scaled hardware needs.
``reuse_forward`` instead multiplies the new ``Q_g(dY)`` with the forward's ``Q_w(W)`` and
``Q_a(X)``, both blocked along in_features, as the HiFloat4 authors' simulation does
(:func:`backward_axes`); ``dequantized`` multiplies unquantized ``dY`` with those two
dequantized into the compute dtype (their scales multiplied in), as NeMo-RL and Miles do.

In **rollout** mode the forward runs the rollout recipe: the weight quantized (once per
weight version where the layer keeps ``Q(W)``, see below) and the activations through the
configured recovery method.

What a layer derives from its weight (``Q(W)`` in each GEMM's form) is kept only inside
:func:`fp4rl.nn.weight_cache` (:class:`_KeptWeights`), a scope opened by whoever owns the
weights for its duration: fp4rl's trainer for a step, its engine for a ``generate``, TRL's
plug-in for a training step. A write through ``weight.data`` bumps no version counter and
moves no storage, so no key could see it; outside such a scope the layer quantizes the
master at every GEMM, so no write path can leave it computing with an old ``Q(W)``.

The GEMMs run in the compute dtype in force, as ``nn.Linear`` under autocast does: bf16
under ``torch.autocast(dtype=torch.bfloat16)`` (quantized operands cast to bf16 exactly,
fp32 accumulation), else the input's dtype. Quantization itself always reads the
high-precision tensors, with autocast off, so no operand is rounded to bf16 before it is
quantized. For backward the layer keeps only ``Q_a(X)`` (along tokens, or under
``reuse_forward`` the forward's own, along in_features), in the compute dtype: what the
weight gradient needs, no more than ``nn.Linear`` keeps under autocast. ``Q_w(W)`` is
quantized again from the master in backward (under ``reuse_forward`` along in_features,
which reproduces the forward's operand bit for bit) rather than kept as a second copy.
"""

from __future__ import annotations

import warnings
import weakref
from enum import StrEnum
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fp4rl.formats import NumberFormat
from fp4rl.formats.nvfp4 import ScaleRule, current_static_scale, finite_amax, static_scale
from fp4rl.formats.registry import with_scale_rule
from fp4rl.gemm import (
    UNQUANTIZED,
    OnLoad,
    Operand,
    OperandFormat,
    PackedCall,
    PackedOperand,
    mm,
    mm_on_load,
    packed_fusion,
    packed_gemm,
    quantize_operand,
    quantize_operand_pair,
    quantizes_on_load,
)
from fp4rl.kernels import quantize_on_load
from fp4rl.kernels.cpu import drop_panels
from fp4rl.nn.cpu_rollout import CpuRollout
from fp4rl.nn.invariant import token_rows
from fp4rl.nn.recipe import (
    WGRAD_HADAMARD_BLOCK,
    BackwardOperands,
    Recipe,
    TrainPrecision,
    WgradHadamard,
)
from fp4rl.precision import active_compute_dtype, autocast_off
from fp4rl.recovery import RolloutRecovery, make_recovery
from fp4rl.recovery.hadamard import make_signs, random_hadamard


class _OptimizerSteps:
    """How many optimizer steps any ``torch.optim`` optimizer has taken in this process.

    A weight's version counter misses an update that a fused optimizer writes straight
    into the parameter's storage (``AdamW(fused=True)``, transformers' default
    ``adamw_torch_fused``), so what a layer keeps of its weight keys on this count too: any
    optimizer step makes every kept ``Q(W)`` stale."""

    count = 0
    #: what every layer keeps of its weight, dropped at each step (it is stale)
    kept: ClassVar[weakref.WeakSet[_KeptWeights]] = weakref.WeakSet()

    @classmethod
    def bump(cls, *_: object) -> None:
        cls.count += 1
        for weights in list(cls.kept):
            weights.clear()
        drop_panels()


register_optimizer_step_post_hook(_OptimizerSteps.bump)


class Mode(StrEnum):
    TRAIN = "train"
    ROLLOUT = "rollout"


def backward_axes(precision: TrainPrecision) -> tuple[int, int]:
    """The axes ``(W, X)`` along which the backward GEMMs quantize the weight (for the
    input gradient) and the activation (for the weight gradient): their own reduction
    axes (out_features, tokens) under ``requantize``, the forward's (in_features) under
    ``reuse_forward``. ``dY`` is always blocked along the reduction axis."""
    return (0, 0) if precision.backward_operands is BackwardOperands.REQUANTIZE else (-1, -1)


def rotate_tokens(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``(T, F)`` rows rotated along the tokens by the block-diagonal random Hadamard
    transform of ``signs`` (one 16-token block's), in float32, the tokens zero-padded to
    whole blocks: ``rotate_tokens(a, s)^T rotate_tokens(b, s) = a^T b`` (orthonormal)."""
    block = signs.numel()
    padded = torch.nn.functional.pad(t.float(), (0, 0, 0, -t.shape[0] % block))
    every = signs.float().repeat(padded.shape[0] // block)
    return random_hadamard(padded.t(), every, block).t()


def _backward_operand(op: Operand, precision: TrainPrecision, dtype: torch.dtype) -> Operand:
    """A forward operand as a backward GEMM takes it: as it is, or under ``dequantized``
    its values times its scale, rounded to the compute dtype once (no scale left to keep
    outside the product, so a per-token one is no obstacle)."""
    if precision.backward_operands is BackwardOperands.DEQUANTIZED:
        return Operand(op.dense().to(dtype))
    return op.to(dtype)


def _gradient_format(fmt: OperandFormat) -> OperandFormat:
    """The output gradient's format as the backward quantizes it: a ``static`` NVFP4 one
    by its dynamic rule, which is what it computes there (the step's fixed scale belongs
    to the activations and is set only while the forward runs). Named so, the backward
    reads no scope: a compiled backward, traced while the forward's scope is open, gives
    the eager bits."""
    if isinstance(fmt, NumberFormat) and fmt.fixed_scale:
        dynamic = with_scale_rule(fmt, ScaleRule.DYNAMIC)
        assert dynamic is not None  # a fixed-scale format is one rule of a dynamic one
        return dynamic
    return fmt


class _FP4LinearFn(torch.autograd.Function):
    """Autograd of ``Y = Q(X) Q(W)^T + b`` with quantized backward GEMMs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                precision: TrainPrecision, dtype: torch.dtype,
                signs: torch.Tensor | None = None,
                layer: FP4Linear | None = None,
                gradients: OperandFormat | None = None) -> torch.Tensor:
        p = precision
        x2 = x.reshape(-1, x.shape[-1])
        qw = _train_weight(layer, weight, p, -1, dtype, backward=False,
                           with_backward=ctx.needs_input_grad[0])
        grads = _gradient_format(p.gradients) if gradients is None else gradients
        ctx.precision, ctx.dtype, ctx.x_shape, ctx.signs = p, dtype, x.shape, signs
        ctx.layer, ctx.gradients = layer, grads
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        ctx.on_load = _on_load_path(p, grads, x2, dtype, signs)
        if ctx.on_load:
            return _forward_on_load(ctx, x, x2, weight, qw, bias)
        x_axis = backward_axes(p)[1]  # the forward's Q(X) when it is blocked the same way
        saved_x = None
        if ctx.needs_input_grad[1] and signs is None and x_axis == 0:
            # Q(X) along the features and along the tokens (the weight gradient's), one read,
            # written in the compute dtype the GEMMs read (no cast pass after)
            qx, saved_x = quantize_operand_pair(x2, p.activations, out_dtype=dtype)
        else:
            qx = quantize_operand(x2, p.activations, -1)
        y = mm(qx, qw.t(), dtype, bias)
        if ctx.needs_input_grad[1]:  # Q(X) for the weight gradient, in the compute dtype
            if signs is not None:  # requantize: X along the tokens, rotated first
                saved_x = quantize_operand(rotate_tokens(x2, signs), p.activations, x_axis)
            elif saved_x is None:
                saved_x = qx
            saved_x = _backward_operand(saved_x, p, dtype)
        ctx.save_for_backward(weight, None if saved_x is None else saved_x.values)
        ctx.x_scale = None if saved_x is None else saved_x.scale
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.on_load:
            return _backward_on_load(ctx, grad_y)
        weight, qx_values = ctx.saved_tensors
        p: TrainPrecision = ctx.precision
        grads: OperandFormat = ctx.gradients
        g = grad_y.reshape(-1, grad_y.shape[-1])
        sr = p.stochastic_gradients
        grad_x = grad_w = grad_b = None
        g_rows = g_cols = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and not sr and ctx.signs is None:
            # dY along the outputs (dX's) and along the tokens (dW's), one read
            g_rows, g_cols = quantize_operand_pair(g, grads)
        if ctx.needs_input_grad[0]:
            qw = _train_weight(ctx.layer, weight, p, backward_axes(p)[0], ctx.dtype,
                               backward=True)
            if g_rows is None:
                g_rows = quantize_operand(g, grads, -1, sr)
            grad_x = mm(g_rows, qw, ctx.dtype)
            grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            qx = Operand(qx_values, ctx.x_scale)
            if g_cols is None:
                gw = g if ctx.signs is None else rotate_tokens(g, ctx.signs)
                g_cols = quantize_operand(gw, grads, 0, sr)
            grad_w = mm(g_cols.t(), qx, ctx.dtype)
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(dim=0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _on_load_path(p: TrainPrecision, grads: OperandFormat, x2: torch.Tensor,
                  dtype: torch.dtype, signs: torch.Tensor | None) -> bool:
    """Whether the three GEMMs quantize ``X`` and ``dY`` as they load them
    (:func:`fp4rl.gemm.mm_on_load`; ``FP4RL_QUANTIZE_ON_LOAD=1`` on a GPU): ``requantize``
    backward operands (each GEMM's operands blocked along its own reduction axis, which is
    the axis the kernel quantizes along), no token rotation of the weight gradient, nearest
    rounding of ``dY``, and both formats with the kernel. Asked for and not taken, it says
    why, once per reason (a warning), rather than quantizing first in silence."""
    if not quantize_on_load() or not isinstance(p.activations, NumberFormat):
        return False  # not asked for, or nothing to quantize (an unquantized recipe)
    reason = _not_on_load(p, grads, x2, dtype, signs)
    if reason is not None:
        warnings.warn(f"FP4RL_QUANTIZE_ON_LOAD=1: this linear quantizes first ({reason})",
                      RuntimeWarning, stacklevel=4)
    return reason is None


def _not_on_load(p: TrainPrecision, grads: OperandFormat, x2: torch.Tensor,
                 dtype: torch.dtype, signs: torch.Tensor | None) -> str | None:
    """Why the quantize-on-load GEMMs do not apply to this linear, or None where they do."""
    if signs is not None:
        return "the weight gradient's tokens are rotated (wgrad_hadamard)"
    if p.backward_operands is not BackwardOperands.REQUANTIZE:
        return f"backward_operands {p.backward_operands.value} blocks an operand across " \
            "the GEMM's reduction axis"
    if p.stochastic_gradients:
        return "dY is rounded stochastically"
    if dtype != torch.bfloat16:
        return f"the GEMMs compute in {str(dtype).removeprefix('torch.')}, the kernel in bf16"
    for fmt in (p.activations, grads):
        if not quantizes_on_load(fmt, x2, dtype):
            return f"no quantize-on-load kernel for {fmt} on {x2.device.type}, or a " \
                "batch-invariant forward (docs/layers.md lists what the kernel takes)"
    return None


def _forward_on_load(ctx: Any, x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                     qw: Operand, bias: torch.Tensor | None) -> torch.Tensor:
    """The forward on the quantize-on-load path: ``X`` quantized along the features inside
    the GEMM; for the weight gradient ``X`` itself is kept (no quantized copy), with its
    scale along the tokens computed here, under the forward's scale scope (a static
    NVFP4 scale), as the quantize-first path computes it."""
    p: TrainPrecision = ctx.precision
    act = p.activations
    assert isinstance(act, NumberFormat)  # _on_load_path checked it
    # the scales along the features and along the tokens (one per tensor serves both;
    # one a token and one a feature come from one read of X)
    rows, cols = act.tensor_scales(x2) if ctx.needs_input_grad[1] else \
        (act.tensor_scale(x2, -1), None)
    y = mm_on_load(OnLoad(x2, act, rows), qw.t(), ctx.dtype, bias)
    ctx.x_scale = cols
    ctx.save_for_backward(weight, x2 if ctx.needs_input_grad[1] else None)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _backward_on_load(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward on the quantize-on-load path: ``dY`` quantized along the outputs for
    the input gradient and along the tokens for the weight gradient, ``X`` along the
    tokens, each inside its GEMM; the gradients written in their parameters' types (the
    bf16 result, exactly, with no cast pass)."""
    weight, x2 = ctx.saved_tensors
    p: TrainPrecision = ctx.precision
    grads = ctx.gradients
    dtype: torch.dtype = ctx.dtype
    g = grad_y.reshape(-1, grad_y.shape[-1])
    direct = (torch.bfloat16, torch.float32)
    grad_x = grad_w = grad_b = None
    act = p.activations
    assert isinstance(act, NumberFormat) and isinstance(grads, NumberFormat)  # _on_load_path
    rows, cols = grads.tensor_scales(g) if ctx.needs_input_grad[1] else \
        (grads.tensor_scale(g, -1), None)
    g_rows = OnLoad(g, grads, rows)
    if ctx.needs_input_grad[0]:
        qw = _train_weight(ctx.layer, weight, p, 0, dtype, backward=True)
        out = ctx.x_dtype if ctx.x_dtype in direct else dtype
        grad_x = mm_on_load(g_rows, qw, dtype, out_dtype=out)
        grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
    if ctx.needs_input_grad[1]:
        g_cols = OnLoad(g, grads, cols)
        out = weight.dtype if weight.dtype in direct else dtype
        grad_w = mm_on_load(g_cols.t(), OnLoad(x2, act, ctx.x_scale), dtype,
                            out_dtype=out).to(weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g.float().sum(dim=0).to(weight.dtype)
    return grad_x, grad_w, grad_b, None, None, None, None, None


class _KeptWeights:
    """What one layer derives from its weight, kept while the weight is the same version
    (:meth:`FP4Linear._weight_key`) and only inside a :func:`fp4rl.nn.weight_cache` scope:
    the training policy's ``Q(W)`` operands, each in the form its GEMM reads (the
    micro-batches of a step and its old-log-prob pass read them instead of quantizing the
    master and casting it again), the rollout policy's ``Q(W)`` in one dtype and as packed
    codes. Any change of the weight the key sees (an in-place update, a ``load_state_dict``,
    a new storage, a new recovery transform) drops them all, and so does any optimizer
    step, fused or not, at once (:meth:`clear`), so no stale copy holds memory through the
    next rollout. Entering and leaving the outermost scope drops them too: a write between
    two scopes (``weight.data.copy_``, a PEFT merge) is never met by an old ``Q(W)``."""

    def __init__(self) -> None:
        self.clear()
        _OptimizerSteps.kept.add(self)

    def clear(self) -> None:
        self.version: tuple[int, ...] | None = None
        #: (axis, dtype, backward) -> the training GEMM's operand
        self.train: dict[tuple[int, torch.dtype, bool], Operand] = {}
        self.rollout: tuple[torch.dtype, Operand] | None = None
        #: the rollout Q(W) as packed codes, where a fused kernel multiplies by them
        self.rollout_packed: PackedCall | None = None
        #: the rollout GEMM's kernels on a CPU for this version (False: the general path)
        self.cpu_rollout: CpuRollout | bool | None = None

    def at(self, version: tuple[int, ...]) -> _KeptWeights:
        """These kept values, for ``version``: emptied first where they were another's."""
        if version != self.version:
            self.clear()
            self.version = version
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> _KeptWeights:
        return _KeptWeights()  # a copy of the layer has a weight of its own

    def train_nbytes(self) -> int:
        """The bytes the training policy's kept operands take (values and scales)."""
        return sum(op.nbytes for op in self.train.values())


def _train_weight(layer: FP4Linear | None, weight: torch.Tensor, p: TrainPrecision,
                  axis: int, dtype: torch.dtype, backward: bool,
                  with_backward: bool = False) -> Operand:
    """``Q(W)`` along ``axis`` as the forward (or a backward) GEMM reads it, from the
    layer's kept operands where it keeps them (``layer`` None: it does not).
    ``with_backward`` (the forward's, where the input gradient follows): a kept weight
    requantized along the outputs for it is made in the same read of the master."""
    def make() -> Operand:
        if backward and p.backward_operands is BackwardOperands.DEQUANTIZED:
            return _backward_operand(quantize_operand(weight.detach(), p.weights, axis), p,
                                     dtype)
        # the GEMM's operand, written in the compute dtype by the quantizer where a GPU
        # kernel can (no fp32 round trip and cast)
        return quantize_operand(weight.detach(), p.weights, axis, out_dtype=dtype)
    kept_weights = None if layer is None else layer._kept_now()
    if kept_weights is None:
        return make()
    kept = kept_weights.train
    slot = (axis, dtype, backward)
    back = (0, dtype, True)
    if slot not in kept and with_backward and not backward and axis == -1 and \
            back not in kept and backward_axes(p)[0] == 0 and \
            p.backward_operands is not BackwardOperands.DEQUANTIZED:
        kept[slot], kept[back] = quantize_operand_pair(weight.detach(), p.weights,
                                                       out_dtype=dtype)
    if slot not in kept:
        kept[slot] = make()
    return kept[slot]


class FP4Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in simulated 4-bit formats.

    Built from an existing linear with :meth:`from_linear`, sharing its parameters, so
    parameter names, the state_dict and optimizer references stay unchanged.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Recipe | None = None, seed: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_policy(recipe or Recipe(), seed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, seed: int = 0) -> FP4Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_policy(recipe, seed)
        return new

    def _init_policy(self, recipe: Recipe, seed: int) -> None:
        self.mode = Mode.TRAIN
        self.seed = seed
        self.set_recipe(recipe)

    def set_recipe(self, recipe: Recipe) -> None:
        """Switch formats/recovery; drops cached rollout weights."""
        self.recipe = recipe
        self.recovery: RolloutRecovery = make_recovery(
            recipe.rollout.recovery, recipe.rollout.activations, self.in_features, self.seed,
            weight_format=recipe.rollout.weights)
        generator = torch.Generator().manual_seed(self.seed)
        self._wgrad_signs = make_signs(WGRAD_HADAMARD_BLOCK, generator)
        #: the output gradient's format as the backward quantizes it (resolved here, not
        #: in a traced backward: :func:`_gradient_format`)
        self._gradients = _gradient_format(recipe.train.gradients)
        self._kept = _KeptWeights()
        #: a Q(W) received from elsewhere, for the weight version it came with (state set
        #: by its sender, not a cache: no scope drops it)
        self._received: tuple[tuple[int, ...], Operand] | None = None
        #: a static NVFP4 activation scale, fixed for the RL step (:meth:`_static_scale`)
        self._static: torch.Tensor | None = None
        #: the running amax of a static-scale calibration (:meth:`calibrating`), or None
        self._calibration: torch.Tensor | None = None
        if not hasattr(self, "_held"):
            #: how many :func:`fp4rl.nn.weight_cache` scopes hold this layer (kept Q(W)
            #: only while one does)
            self._held = 0
        if not hasattr(self, "cache_weights"):
            #: keep the training policy's Q(W) operands for a weight version
            #: (:class:`_KeptWeights`); off: quantize the master at every GEMM
            self.cache_weights = True

    def weight_cache_bytes(self) -> int:
        """The bytes of the training policy's kept ``Q(W)`` operands (see
        :attr:`cache_weights`)."""
        return self._kept.train_nbytes()

    def _keeps_weights(self) -> FP4Linear | None:
        """This layer where it keeps its ``Q(W)`` operands, else None: not with
        :attr:`cache_weights` off (the trainer turns it off under FSDP2, whose unsharded
        weight lives for one GEMM and whose memory is the point of sharding), nor for a
        DTensor weight; Q(W) is then quantized at every GEMM."""
        if not self.cache_weights or type(self.weight.data) is not torch.Tensor:
            return None
        return self

    def hold(self) -> None:
        """Enter a :func:`fp4rl.nn.weight_cache` scope: from here on, until :meth:`release`,
        the weights change only through an optimizer step (which drops what is kept) or a
        write a key sees, so what is derived from them may be kept. The outermost entry
        starts from nothing kept."""
        if self._held == 0:
            self._kept.clear()
        self._held += 1

    def release(self) -> None:
        """Leave a :meth:`hold` scope; the outermost one drops what was kept."""
        self._held = max(self._held - 1, 0)
        if self._held == 0:
            self._kept.clear()

    def _kept_now(self) -> _KeptWeights | None:
        """The kept values for the current weight version, inside a scope; else None (the
        caller derives afresh and keeps nothing). Under ``torch.compile`` also None: the
        version key compares data pointers and version counters, which a graph cannot
        hold, so a compiled forward derives ``Q(W)`` in its graph at every call (the same
        bits)."""
        if not self._held or torch.compiler.is_compiling():
            return None
        return self._kept.at(self._weight_key())

    def begin_step(self) -> None:
        """Start of an RL step: recovery methods recalibrate / redraw as configured, and a
        static NVFP4 activation scale is fixed anew by the step's first calibration or
        forward."""
        self.recovery.begin_step()
        self._static = None

    def rollout_state(self) -> dict[str, object]:
        """The rollout policy's state beyond the parameters (a recovery method's random
        generator, say), for checkpoints."""
        return self.recovery.state_dict()

    def load_rollout_state(self, state: dict[str, object]) -> None:
        self.recovery.load_state_dict(state)

    def rollout_weight(self, dtype: torch.dtype = torch.float32) -> Operand:
        """The rollout-quantized weight in ``dtype``; inside a :func:`fp4rl.nn.weight_cache`
        scope recomputed only when the weight, the recovery transform or the compute dtype
        changed, outside it at every call."""
        kept = self._kept_now()
        if kept is None:
            return self._quantized_rollout_weight(dtype)
        if kept.rollout is None or kept.rollout[0] != dtype:  # one dtype: a new one replaces it
            kept.rollout = (dtype, self._quantized_rollout_weight(dtype))
        return kept.rollout[1]

    def rollout_reads_weight_only(self) -> bool:
        """Whether ``Q(W)`` (the rollout-quantized weight) is all this layer's rollout
        needs of its weight: what a rollout engine can be sent instead of the weight.
        Not where the rollout weight is unquantized, nor where the recovery method reads
        the high-precision weight (SmoothQuant, RHT, OCC)."""
        return self.recipe.rollout.weights is not UNQUANTIZED and not self.recovery.reads_weight

    def receive_rollout_weight(self, qw: Operand) -> None:
        """Use ``qw`` (the rollout weight quantized elsewhere, e.g. decoded from the 4-bit
        codes a sharded trainer sent) instead of quantizing this layer's own weight, until
        the weight or the recovery transform changes: a rollout copy then holds what a real
        FP4 rollout engine receives, not the trainer's FP32 weights."""
        self._received = (self._weight_key(), qw)
        self._kept.rollout = self._kept.rollout_packed = self._kept.cpu_rollout = None

    def _wgrad_signs_for(self, device: torch.device) -> torch.Tensor | None:
        """The signs of this forward's weight-gradient Hadamard transform: the layer's own
        draw (moved to ``device`` once), a fresh draw from torch's generator, or None
        where it is off."""
        how = self.recipe.train.wgrad_hadamard
        if how is WgradHadamard.OFF:
            return None
        if how is WgradHadamard.FRESH:
            return make_signs(WGRAD_HADAMARD_BLOCK, device=device)
        if self._wgrad_signs.device != device:
            self._wgrad_signs = self._wgrad_signs.to(device)
        return self._wgrad_signs

    def _weight_key(self) -> tuple[int, int, int, int]:
        return (self.weight._version, self.weight.data_ptr(), self.recovery.version,
                _OptimizerSteps.count)

    def _received_weight(self) -> Operand | None:
        """A received ``Q(W)`` while the weight is the version it came with."""
        if self._received is None or self._received[0] != self._weight_key():
            return None
        return self._received[1]

    def _quantized_rollout_weight(self, dtype: torch.dtype) -> Operand:
        """``Q(W)`` in ``dtype``: a received one cast, or this layer's own written in it."""
        received = self._received_weight()
        if received is not None:
            return received.to(dtype)
        with torch.no_grad():
            operand = self.recovery.weight_operand(self.weight.detach(), out_dtype=dtype)
        assert isinstance(operand, Operand)  # not packed: the values
        return operand

    def _without_padding(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the rows of padding tokens zeroed where this mode's activations take
        one scale for the whole tensor (NVFP4's): a pad row then sets no scale, in the
        engine as in the trainer. A pad row's own output is never read (attention masks
        it), and it gets no gradient either way."""
        rows = token_rows()
        fmt = self._activation_format()
        if rows is None or not isinstance(fmt, NumberFormat) or not fmt.has_tensor_scale or \
                fmt.vector_scales or x.dim() < 2 or rows.numel() != x[..., 0].numel():
            return x
        return x.masked_fill(~rows.reshape(x.shape[:-1])[..., None], 0)

    def _activation_format(self) -> OperandFormat:
        return (self.recipe.train if self.mode is Mode.TRAIN else self.recipe.rollout).activations

    def _static_format(self) -> NumberFormat | None:
        """This mode's activation format where its scale is one a caller fixes (``static``
        NVFP4: :attr:`~fp4rl.formats.NumberFormat.fixed_scale`), else None."""
        fmt = self._activation_format()
        if isinstance(fmt, NumberFormat) and fmt.fixed_scale:
            return fmt
        return None

    def _static_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """A ``static`` NVFP4 activation format's one scale for the RL step, shared by every
        forward of either policy until the next :meth:`begin_step`: fixed by a calibration
        (:func:`fp4rl.nn.calibrate_static_scales`, which the rollout engine runs over all the
        prompts of a ``generate`` before sampling, so that it does not depend on how they
        are chunked) or else by the first forward that meets none, from its real tokens.
        None for any other format."""
        fmt = self._static_format()
        if fmt is None:
            return None
        if self._static is None:
            with torch.no_grad(), static_scale(None):
                self._static = fmt.tensor_scale(x.detach().reshape(-1, x.shape[-1]).float())
            assert self._static is not None  # a static format has a per-tensor scale
        return self._static

    def start_calibration(self) -> None:
        """Begin a static-scale calibration: until :meth:`finish_calibration` a layer whose
        activations take a static NVFP4 scale records the amax of its real input rows and
        computes unquantized (the high-precision model's activations, as a post-training
        observer sees them: no layer's calibration depends on another's scale, nor on
        which prompts share a forward)."""
        self._calibration = torch.zeros((), dtype=torch.float32, device=self.weight.device) \
            if self._static_format() is not None else None

    def finish_calibration(self) -> None:
        """Fix the static scale from the amax recorded since :meth:`start_calibration`."""
        fmt, amax = self._static_format(), self._calibration
        self._calibration = None
        if fmt is None or amax is None:
            return
        with torch.no_grad(), static_scale(None):
            # the scale of a tensor is a function of its finite amax alone: the amax over
            # every prompt gives the scale of all of them at once, however they were split
            self._static = fmt.tensor_scale(amax.reshape(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = active_compute_dtype(x)
        x = self._without_padding(x)
        if self._calibration is not None:
            with torch.no_grad():
                rows = x.detach().reshape(-1, x.shape[-1])
                self._calibration = torch.maximum(self._calibration, finite_amax(rows))
            return torch.nn.functional.linear(x, self.weight, self.bias)
        scale = self._static_scale(x)
        if scale is None and current_static_scale() is None:  # nothing to set (the common case)
            return self._forward(x, dtype)
        with static_scale(scale):
            return self._forward(x, dtype)

    def _forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with autocast_off(x.device.type):
            if self.mode is Mode.TRAIN:
                out: torch.Tensor = _FP4LinearFn.apply(
                    x, self.weight, self.bias, self.recipe.train, dtype,
                    self._wgrad_signs_for(x.device), self._keeps_weights(),
                    self._gradients)
                return out
            return self._rollout_forward(x, dtype)

    def _rollout_forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if torch.is_grad_enabled():  # an engine's generate has it off already
            with torch.no_grad():
                return self._rollout_forward(x, dtype)
        x2 = x.reshape(-1, x.shape[-1])
        plan = self._cpu_rollout(x2, dtype)
        if plan is not None:  # the same kernels as below, chosen once for the weight version
            return plan(x2, self.bias).reshape(*x.shape[:-1], self.out_features)
        w = self.weight.detach()
        self.recovery.prepare(x2, w)
        packed = self._packed_rollout_weight(x2, dtype)
        if packed is not None and len(acts := self.recovery.packed_activation(x2, dtype)) <= 2:
            # the checks are made (packed_fusion): straight to the operator
            y = packed_gemm(acts, packed, dtype, self.bias)
        else:
            y = self.recovery.forward(x2, self.rollout_weight(dtype), w, dtype, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _cpu_rollout(self, x2: torch.Tensor, dtype: torch.dtype) -> CpuRollout | None:
        """The rollout GEMM's kernels on a CPU, kept for the weight version
        (:class:`~fp4rl.nn.cpu_rollout.CpuRollout`), where they take this call; else None
        (the general path: outside a weight scope, another device or method)."""
        if x2.device.type != "cpu" or dtype != torch.bfloat16:
            return None
        kept = self._kept_now()
        if kept is None:
            return None
        if kept.cpu_rollout is None:
            kept.cpu_rollout = CpuRollout.of(self.recovery, self.rollout_weight(dtype),
                                             dtype) or False
        plan = kept.cpu_rollout
        return plan if isinstance(plan, CpuRollout) and plan.takes(x2) else None

    def _packed_rollout_weight(self, x2: torch.Tensor, dtype: torch.dtype
                               ) -> PackedCall | None:
        """The rollout ``Q(W)`` as packed codes (kept for the weight version) where a decode
        step multiplies by them in one fused kernel (:func:`fp4rl.gemm.packed_fusion`: a GPU,
        bf16, any token count): it reads about a quarter of the bytes of the bf16
        ``Q(W)``. Only where the recovery's rollout is ``activation(x) @ Q(W).T`` (no
        forward of its own) and ``Q(W)`` is this layer's own; else None."""
        fmt = self.recipe.rollout.weights
        if not isinstance(fmt, NumberFormat) or \
                type(self.recovery).forward is not RolloutRecovery.forward or \
                self.recovery.reads_weight or \
                not packed_fusion(fmt, x2.shape[0], x2.device, dtype):
            return None
        if self._received_weight() is not None:
            return None
        kept = self._kept_now()
        if kept is not None and kept.rollout_packed is not None:
            return kept.rollout_packed
        with torch.no_grad():
            packed = self.recovery.weight_operand(self.weight.detach(), packed=True)
        assert isinstance(packed, PackedOperand)
        call = PackedCall.of(packed)
        if kept is not None:
            kept.rollout_packed = call
        return call

    def extra_repr(self) -> str:
        r, t = self.recipe.rollout, self.recipe.train
        rec = f"+{r.recovery.label}" if r.recovery.label else ""
        scheme = "" if t.backward_operands is BackwardOperands.REQUANTIZE \
            else f"/{t.backward_operands}"
        return (f"{super().extra_repr()}, mode={self.mode.value}, "
                f"train=W:{t.weights}/A:{t.activations}/G:{t.gradients}{scheme}, "
                f"rollout=W:{r.weights}/A:{r.activations}{rec}")
