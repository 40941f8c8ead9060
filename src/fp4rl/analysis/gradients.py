"""Gradient-side diagnosis: what FP4 does to the training GEMMs and to the update, on a
GRPO batch.

One batch is sampled as a GRPO step would (prompts of the built-in arithmetic task, G
responses each from the FP4 rollout policy, 0/1 rewards, group-normalized advantages),
then the model is differentiated once per *variant* of the training policy:

==================  =========================================================
``bf16``            nothing quantized: the reference update
``fp4_forward``     FP4 forward, unquantized backward through the forward's Q(W),
                    Q(X): the exact (straight-through) gradient of the FP4 forward
``requantize``      all three GEMMs FP4, backward operands re-quantized along their
                    own reduction axes (fp4rl's default)
``reuse_forward``   all three GEMMs FP4, backward reusing the forward's Q(W), Q(X)
                    (the HiFloat4 authors' simulation)
``weights_only``    only W quantized in the forward, exact backward
``activations_only``  only X quantized in the forward, exact backward
==================  =========================================================

and reports, per patched layer and per GEMM (``Y``, ``dX``, ``dW``), the SQNR of the FP4
GEMM against the unquantized GEMM of the *same* operands (what one GEMM loses), the zero
shares of ``dY``, of ``Q(dY)`` and of the non-zero ``dY`` entries ``Q`` flushes to zero,
and the cosine (and SQNR) of every variant's weight gradient with the two references,
``bf16`` and ``fp4_forward`` (what the whole update loses), per layer and over all
gradients concatenated.

Every variant differentiates the same objective: GRPO's loss on its first mini-batch
step, where the policy is its own ``pi_old`` (ratio 1, so no clipping), which is the
policy-gradient surrogate ``-agg(w_t A_i log pi(y_t))``; the truncated importance
weights ``w_t = min(pi_old / mu, C)`` are computed once, from the FP4 training policy,
and held fixed, so a difference between variants is a difference of numerics only. As
in the trainer, responses with zero advantage are left out of the forward and backward
(the loss keeps its denominator), and at most ``max_sequences`` are kept, whole groups
first. Where no group's rewards differ (no signal), the advantages fall back to random
+/-1 per response, and the report says so. Everything runs in fp32 compute, with
round-to-nearest gradients, so the figures isolate the 4-bit quantization.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fp4rl.data import synthetic_dataset
from fp4rl.gemm import UNQUANTIZED, OperandFormat, mm, quantize_operand
from fp4rl.nn import (
    FP4Linear,
    Mode,
    Recipe,
    TrainPrecision,
    begin_step,
    fp4_layers,
    get_recipe,
    quantize_model,
    rollout_mode,
    train_mode,
)
from fp4rl.nn.linear import backward_axes
from fp4rl.rl.datasets import encode_examples, stop_token_ids
from fp4rl.rl.grpo import LossConfig, aggregate, group_advantages, tis_weights
from fp4rl.rl.logprobs import response_logprobs
from fp4rl.rl.rewards import get_reward
from fp4rl.rollout import (
    RolloutBatch,
    SamplingConfig,
    generate,
    row_generators,
    sample_seed,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GEMMS = ("Y", "dX", "dW")
SCHEMES = ("requantize", "reuse_forward")
REFERENCES = ("bf16", "fp4_forward")
#: what each variant quantizes (the module docstring's table, for the JSON record)
GRADIENT_VARIANTS = {
    "bf16": "nothing quantized",
    "fp4_forward": "W, X in the forward; backward unquantized through the forward's Q(W), Q(X)",
    "requantize": "all three GEMMs; backward W, X re-quantized along their reduction axes",
    "reuse_forward": "all three GEMMs; backward reuses the forward's Q(W), Q(X)",
    "weights_only": "W in the forward; backward unquantized through Q(W)",
    "activations_only": "X in the forward; backward unquantized through Q(X)",
}


# ----- measures --------------------------------------------------------------------------
def sqnr_db(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (approx - ref)^2)`` in float64; ``inf`` when equal."""
    ref64 = ref.double()
    noise = (approx.double() - ref64).pow(2).sum().item()
    signal = ref64.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of the flattened tensors in float64 (``nan`` when either is zero)."""
    return _cosine_from(*_dot_norms(a, b))


def _dot_norms(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    a64, b64 = a.double().flatten(), b.double().flatten()
    return (a64 @ a64).item(), (b64 @ b64).item(), (a64 @ b64).item()


def _cosine_from(aa: float, bb: float, ab: float) -> float:
    if aa == 0 or bb == 0:
        return math.nan
    return max(-1.0, min(1.0, ab / math.sqrt(aa * bb)))


def forward_sqnr(x: torch.Tensor, w: torch.Tensor, p: TrainPrecision) -> float:
    """SQNR of the forward GEMM ``Q(X) Q(W)^T`` against ``X W^T`` (bias left out)."""
    fp4 = mm(quantize_operand(x, p.activations, -1), quantize_operand(w, p.weights, -1).t(),
             torch.float32)
    return sqnr_db(fp4, x @ w.t())


def backward_stats(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, p: TrainPrecision
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """SQNR of the two backward GEMMs against the unquantized ``dY W`` and ``dY^T X``,
    with the operands ``p`` prescribes (its ``backward_operands``); and zero shares:
    of ``dY`` itself (``dY``: positions that reach no loss term, such as padding, are
    exactly zero), of ``Q(dY)`` blocked along out_features (``QdY_dX``) and tokens
    (``QdY_dW``), and of the non-zero entries of ``dY`` that quantization flushes to
    zero (``flushed_dX``, ``flushed_dW``), the gradient's own zero collapse."""
    w_axis, x_axis = backward_axes(p)
    g_out, g_tok = quantize_operand(dy, p.gradients, -1), quantize_operand(dy, p.gradients, 0)
    dx = mm(g_out, quantize_operand(w, p.weights, w_axis), torch.float32)
    dw = mm(g_tok.t(), quantize_operand(x, p.activations, x_axis), torch.float32)
    nonzero = dy != 0
    zeros = {"dY": _share(~nonzero)}
    for gemm, q in (("dX", g_out.dense()), ("dW", g_tok.dense())):
        zeros[f"QdY_{gemm}"] = _share(q == 0)
        zeros[f"flushed_{gemm}"] = _share(q[nonzero] == 0)
    return {"dX": sqnr_db(dx, dy @ w), "dW": sqnr_db(dw, dy.t() @ x)}, zeros


def _share(mask: torch.Tensor) -> float:
    return mask.float().mean().item() if mask.numel() else math.nan


class GemmProbe:
    """Hooks on every patched layer in train mode that record, for the forward and
    backward pass they watch, :func:`forward_sqnr` and :func:`backward_stats` with the
    operands the layer really received (its input, master weight and incoming gradient).
    ``enabled=False`` watches nothing (the passes that need no GEMM statistics)."""

    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        self.layers = fp4_layers(model) if enabled else {}
        self.sqnr: dict[str, dict[str, float]] = {}  # layer -> GEMM -> dB
        self.zeros: dict[str, dict[str, float]] = {}  # layer -> zero shares
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> GemmProbe:
        self._handles = [layer.register_forward_hook(partial(self._forward, name))
                         for name, layer in self.layers.items()]
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _forward(self, name: str, layer: FP4Linear, inputs: tuple[torch.Tensor, ...],
                 output: torch.Tensor) -> None:
        if layer.mode is not Mode.TRAIN or not output.requires_grad:
            return
        x = inputs[0].detach().reshape(-1, layer.in_features).float()
        w, p = layer.weight.detach(), layer.recipe.train
        self.sqnr[name] = {"Y": forward_sqnr(x, w, p)}
        output.register_hook(partial(self._backward, name, x, w, p))

    def _backward(self, name: str, x: torch.Tensor, w: torch.Tensor, p: TrainPrecision,
                  dy: torch.Tensor) -> None:
        sqnr, self.zeros[name] = backward_stats(x, w, dy.reshape(-1, w.shape[0]).float(), p)
        self.sqnr[name].update(sqnr)


# ----- the batch and its objective -------------------------------------------------------
class BatchFacts(TypedDict):
    """A sampled batch's facts for the report (:meth:`GradientBatch.describe`)."""

    prompts: int
    responses_per_prompt: int
    responses: int  # sampled
    sequences: int  # kept: non-zero advantage, at most max_sequences
    tokens: int
    response_tokens: int
    reward_mean: float
    temperature: float
    advantages: str  # where they came from


@dataclass
class GradientBatch:
    """A sampled GRPO batch laid out for teacher forcing, with its fixed loss weights."""

    ids: torch.Tensor
    attention: torch.Tensor
    prompt_width: int
    mask: torch.Tensor  # (B, R) response tokens of the kept sequences
    advantages: torch.Tensor  # (B,)
    weights: torch.Tensor  # (B, R) truncated importance weights, fixed
    rewards: torch.Tensor  # (all sampled responses,)
    temperature: float
    advantage_source: str
    agg_mode: str
    #: the kept sequences' share of the step's loss: the aggregation's denominator is the
    #: whole step's, as in the trainer, which leaves out zero-advantage sequences too
    scale: float

    def describe(self, prompts: int, group: int) -> BatchFacts:
        """The batch's facts for the report."""
        return {"prompts": prompts, "responses_per_prompt": group,
                "responses": int(self.rewards.numel()),
                "sequences": int(self.ids.shape[0]), "tokens": int(self.attention.sum()),
                "response_tokens": int(self.mask.sum()),
                "reward_mean": self.rewards.float().mean().item(),
                "temperature": self.temperature, "advantages": self.advantage_source}


def sample_batch(model: nn.Module, tokenizer: PreTrainedTokenizerBase, fmt: str, *,
                 prompts: int = 4,
                 group: int = 4, max_new_tokens: int = 64, levels: Sequence[int] = (1, 2),
                 temperature: float = 0.8, seed: int = 0, max_sequences: int = 16,
                 loss: LossConfig | None = None) -> GradientBatch:
    """Sample ``group`` responses to each of ``prompts`` arithmetic prompts from the FP4
    rollout policy of ``fmt`` (``model`` is patched in place), score them, and keep and
    weight them as the trainer's first update step would: the sequences with non-zero
    advantage, with the truncated importance weights of the FP4 training policy.

    At most ``max_sequences`` are kept (whole groups, in prompt order; at least one
    group): the passes hold every layer's activations, so memory grows with them."""
    loss = loss or LossConfig()
    examples, encoded = encode_examples(synthetic_dataset("train", n=prompts, levels=levels,
                                                          seed=seed), tokenizer, 4096,
                                        log=lambda _: None)
    rows = [(i, j) for i in range(len(encoded)) for j in range(group)]
    device = next(model.parameters()).device
    quantize_model(model, get_recipe(fmt))
    begin_step(model)
    with rollout_mode(model):
        rollout = generate(model, [encoded[i] for i, _ in rows],
                           SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens),
                           pad_token_id=tokenizer.pad_token_id,
                           eos_token_ids=stop_token_ids(tokenizer),
                           generator=row_generators([sample_seed(seed, i, j) for i, j in rows],
                                                    device))
    texts = rollout.texts(tokenizer)
    rewards = torch.tensor([get_reward(examples[i].reward)(t, examples[i].answer)
                            for (i, _), t in zip(rows, texts, strict=True)])
    advantages, source = _advantages(rewards, group, seed)
    chosen = (advantages != 0).nonzero().squeeze(-1)[:max(group, max_sequences // group * group)]
    scale = (len(chosen) / len(rows) if loss.loss_agg_mode == "seq-mean-token-mean" else
             (rollout.response_mask[chosen].sum() / rollout.response_mask.sum()).item())
    kept = _rows(rollout, chosen.to(device))
    ids, attention = kept.sequences()
    width = ids.shape[1] - kept.response_ids.shape[1]
    with torch.no_grad(), train_mode(model):
        old_logp = response_logprobs(model, ids, attention, width, temperature)[0]
    weights = tis_weights(old_logp, kept.logprobs, loss.tis_imp_ratio_cap)
    return GradientBatch(ids, attention, width, kept.response_mask.bool(),
                         advantages[chosen].to(device), weights, rewards, temperature,
                         source, loss.loss_agg_mode, scale)


def _rows(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """``rows`` of a rollout batch, without the padding columns no kept row needs."""
    prompt = int(batch.prompt_mask[rows].sum(1).max())
    response = int(batch.response_mask[rows].sum(1).max())
    return RolloutBatch(batch.prompt_ids[rows, -prompt:], batch.prompt_mask[rows, -prompt:],
                        batch.response_ids[rows, :response],
                        batch.response_mask[rows, :response], batch.logprobs[rows, :response],
                        batch.finished[rows])


def _advantages(rewards: torch.Tensor, group: int, seed: int) -> tuple[torch.Tensor, str]:
    """Group-normalized advantages, or random +/-1 where no group carries a signal."""
    advantages = group_advantages(rewards, group)
    if advantages.abs().sum() > 0:
        return advantages, "group-normalized rewards"
    signs = torch.randint(0, 2, rewards.shape, generator=torch.Generator().manual_seed(seed))
    return signs.float() * 2 - 1, "random +/-1 (no group's rewards differ)"


def surrogate_loss(model: nn.Module, batch: GradientBatch) -> torch.Tensor:
    """``-agg(w_t A_i log pi(y_t))``: GRPO's loss at ratio 1 (its first update step,
    before any clipping can act), with the batch's fixed importance weights."""
    with train_mode(model):
        logp, _ = response_logprobs(model, batch.ids, batch.attention, batch.prompt_width,
                                    batch.temperature)
    per_token = -batch.weights * batch.advantages[:, None] * logp
    return aggregate(per_token, batch.mask, batch.agg_mode) * batch.scale


# ----- variants and their comparison -------------------------------------------------------
def variants(fmt: str) -> dict[str, TrainPrecision]:
    """The training-policy variants diagnosed for ``fmt`` (see the module docstring)."""
    f = TrainPrecision(weights=fmt).weights  # the name read once, as a recipe reads it

    def precision(w: OperandFormat, a: OperandFormat, g: OperandFormat,
                  scheme: str = "reuse_forward") -> TrainPrecision:
        return TrainPrecision(weights=w, activations=a, gradients=g, backward_operands=scheme)

    return {
        "fp4_forward": precision(f, f, UNQUANTIZED),
        "requantize": precision(f, f, f, "requantize"),
        "reuse_forward": precision(f, f, f),
        "weights_only": precision(f, UNQUANTIZED, UNQUANTIZED),
        "activations_only": precision(UNQUANTIZED, f, UNQUANTIZED),
    }


def variant_gradients(model: nn.Module, batch: GradientBatch, train: TrainPrecision,
                      probe: bool = False) -> tuple[dict[str, torch.Tensor], GemmProbe]:
    """Every parameter's gradient of the batch's objective under ``train`` (``model`` is
    patched in place), and the probe that watched the pass (empty unless ``probe``)."""
    quantize_model(model, Recipe(train=train))
    model.zero_grad(set_to_none=True)
    with GemmProbe(model, enabled=probe) as watcher:
        surrogate_loss(model, batch).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, watcher


@dataclass
class LayerGradients:
    """One patched layer: GEMM SQNR (dB) and zero shares per scheme, and its weight
    gradient's cosine and SQNR against each reference, per variant."""

    name: str
    gemm_sqnr: dict[str, dict[str, float]] = field(default_factory=dict)
    zeros: dict[str, dict[str, float]] = field(default_factory=dict)
    grad_cosine: dict[str, dict[str, float]] = field(default_factory=dict)
    grad_sqnr: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class FormatGradients:
    """All variants of one format: the update's cosine with each reference, over every
    parameter (``update_cosine``) and over the patched layers' weights only
    (``linear_cosine``), and the per-layer records."""

    format: str
    update_cosine: dict[str, dict[str, float]] = field(default_factory=dict)
    linear_cosine: dict[str, dict[str, float]] = field(default_factory=dict)
    layers: list[LayerGradients] = field(default_factory=list)


def diagnose_format(model: nn.Module, batch: GradientBatch, fmt: str,
                    reference: dict[str, torch.Tensor],
                    progress: Callable[[str], None] = lambda _: None) -> FormatGradients:
    """Differentiate every variant of ``fmt`` and compare it with ``reference`` (the
    unquantized gradients, from :func:`variant_gradients` with ``TrainPrecision()``) and with
    the exact gradient of the FP4 forward."""
    weights = {name: f"{name}.weight" for name in fp4_layers(model)}
    layers = {name: LayerGradients(name) for name in weights}
    refs = {"bf16": reference}
    result = FormatGradients(fmt)
    for variant, train in variants(fmt).items():
        progress(f"{fmt}: {variant}")
        grads, probe = variant_gradients(model, batch, train, probe=variant in SCHEMES)
        if variant == "fp4_forward":
            refs["fp4_forward"] = grads
        for ref_name, ref in refs.items():
            if ref is grads:
                continue
            result.update_cosine.setdefault(variant, {})[ref_name] = _total_cosine(
                grads, ref, list(ref))
            result.linear_cosine.setdefault(variant, {})[ref_name] = _total_cosine(
                grads, ref, list(weights.values()))
            for name, param in weights.items():
                layers[name].grad_cosine.setdefault(variant, {})[ref_name] = cosine(
                    grads[param], ref[param])
                layers[name].grad_sqnr.setdefault(variant, {})[ref_name] = sqnr_db(
                    grads[param], ref[param])
        for name in probe.sqnr:
            layers[name].gemm_sqnr[variant] = probe.sqnr[name]
            layers[name].zeros[variant] = probe.zeros[name]
        del grads  # before the next pass allocates its own
    result.layers = list(layers.values())
    return result


def diagnose_gradients(model: nn.Module, batch: GradientBatch, formats: Sequence[str],
                       progress: Callable[[str], None] = lambda _: None
                       ) -> list[FormatGradients]:
    """The unquantized reference gradient once, then every variant of every format."""
    progress("bf16")
    reference, _ = variant_gradients(model, batch, TrainPrecision())
    return [diagnose_format(model, batch, fmt, reference, progress) for fmt in formats]


def _total_cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                  names: list[str]) -> float:
    """Cosine of the named gradients concatenated (a gradient missing on one side, a
    parameter the loss never reached there, counts as zero)."""
    aa = bb = ab = 0.0
    for n in names:
        if n in a and n in b:
            x, y, xy = _dot_norms(a[n], b[n])
            aa, bb, ab = aa + x, bb + y, ab + xy
        elif n in a:
            aa += _dot_norms(a[n], a[n])[0]
        elif n in b:
            bb += _dot_norms(b[n], b[n])[0]
    return _cosine_from(aa, bb, ab)


# ----- summaries and the record -------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    """Median that keeps infinities (an exact GEMM) and skips NaNs."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def summarize(result: FormatGradients, kind: str = "") -> dict[str, float]:
    """Medians over the layers whose name contains ``kind`` ("" for all): the GEMM SQNRs
    per scheme, the zero shares of dY and Q(dY), and each variant's per-layer gradient
    cosine and SQNR with each reference."""
    chosen = [d for d in result.layers if kind in d.name]
    out: dict[str, float] = {}
    for record in ("gemm_sqnr", "zeros", "grad_cosine", "grad_sqnr"):
        keys = {(a, b) for d in chosen for a, inner in getattr(d, record).items()
                for b in inner}
        for a, b in sorted(keys):
            out[f"{record}/{a}/{b}"] = median([getattr(d, record)[a][b] for d in chosen
                                               if a in getattr(d, record)])
    return out


class GradientsReport(TypedDict):
    """The JSON record of a gradient diagnosis (:func:`report`)."""

    model: str
    batch: dict[str, object]  # BatchFacts and what the caller adds (levels, seed, ...)
    objective: str
    compute: str
    variants: dict[str, str]  # variant -> what it quantizes
    formats: list[dict[str, object]]  # FormatGradients as dicts, infinities as null


def report(model_name: str, batch: Mapping[str, object],
           results: list[FormatGradients]) -> GradientsReport:
    """The JSON record (infinite SQNR, an exact result, is written as null)."""
    return {"model": model_name, "batch": _finite_items(batch),
            "objective": "-agg(w_t A_i log pi(y_t)): GRPO's loss at ratio 1, "
                         "importance weights fixed from the FP4 training policy",
            "compute": "fp32, round-to-nearest gradients",
            "variants": dict(GRADIENT_VARIANTS),
            "formats": [_finite_items(asdict(r)) for r in results]}


def _finite_items(value: Mapping[str, object]) -> dict[str, object]:
    return {k: _finite(v) for k, v in value.items()}


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return _finite_items(value)
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
