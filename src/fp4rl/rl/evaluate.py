"""Evaluation as the paper reports it: Mean@1 (greedy) and Mean@k (k samples per prompt).

Mean@k is the average accuracy over all k samples of every prompt; ``best@k`` (verl's
name, pass@k) counts a prompt solved if any sample is correct. A patched model is
evaluated as its rollout policy (FP4 + recovery), an unpatched one as it is.

A result also keeps each prompt's number of correct samples (in prompt order) and a digest
of the prompts: two policies scored on the same prompts can then be compared prompt by
prompt (a paired comparison), which separates far smaller gaps than two means can.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fp4rl.data import Example
from fp4rl.errors import UserError
from fp4rl.precision import compute_dtype
from fp4rl.rl.datasets import stop_token_ids
from fp4rl.rl.rewards import get_reward
from fp4rl.rollout import (
    KVCacheEngine,
    RolloutEngine,
    SamplingConfig,
    concat_batches,
    sample_seed,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class EvalResult:
    k: int
    n: int
    mean: float  # Mean@k (Mean@1 when k == 1: greedy)
    best: float  # best@k: share of prompts with at least one correct sample
    per_level: dict[str, float] = field(default_factory=dict)
    mean_length: float = 0.0
    correct: list[int] = field(default_factory=list)  # correct samples (of k) per prompt
    prompts: str = ""  # digest of the prompts, in order (see prompt_digest)

    @property
    def name(self) -> str:
        return f"mean@{self.k}"

    def as_dict(self) -> dict[str, Any]:
        return {f"mean@{self.k}": self.mean, f"best@{self.k}": self.best, "n": self.n,
                "per_level": self.per_level, "mean_length": self.mean_length,
                "correct": self.correct, "prompts": self.prompts}


def prompt_digest(examples: list[Example]) -> str:
    """A short fingerprint of the prompts and answers, in order: equal digests mean two
    evaluations asked the same questions."""
    text = "\n".join(f"{e.prompt!r}\t{e.answer}" for e in examples)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def evaluate(model: torch.nn.Module | None, tokenizer: PreTrainedTokenizerBase,
             examples: list[Example],
             prompts: list[list[int]], *, k: int = 1, temperature: float = 1.0,
             max_new_tokens: int = 256, seed: int = 0, batch_size: int = 32,
             reward: str | None = None, eos_token_ids: list[int] | None = None,
             progress: bool | Callable[[int], None] = False,
             mixed_precision: str = "no", engine: RolloutEngine | None = None) -> EvalResult:
    """Score ``examples`` (with their encoded ``prompts``) by Mean@k, on the model's device
    and in the compute dtype of ``mixed_precision``, as resolved where the run's device is
    known (no or bf16: a :class:`~fp4rl.rl.plan.RunPlan`'s, or
    :func:`fp4rl.precision.resolve_mixed_precision` at the edge; ``auto`` is refused rather
    than resolved a second time).

    Sample j of prompt i draws under its own seed (``seed``, i, j), in chunks of
    ``batch_size`` rows, from ``engine`` (default: fp4rl's KV-cache engine on ``model``,
    as its rollout policy if it is patched; ``model`` may be None when ``engine`` is
    given)."""
    if mixed_precision not in ("no", "bf16"):
        raise UserError(f"evaluate takes a resolved mixed_precision (no or bf16), got "
                        f"{mixed_precision!r}: resolve it once, where the device is known "
                        "(fp4rl.precision.resolve_mixed_precision, or the run's plan)")
    if engine is None:
        assert model is not None  # may be None only when ``engine`` is given
        engine = KVCacheEngine(model, tokenizer.pad_token_id,
                               eos_token_ids or stop_token_ids(tokenizer),
                               compute_dtype=compute_dtype(mixed_precision))
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens,
                              greedy=k == 1)
    rows = [(p, sample_seed(seed, i, j)) for i, p in enumerate(prompts) for j in range(k)]
    chunks = [rows[c:c + batch_size] for c in range(0, len(rows), batch_size)]
    batch = concat_batches(engine.generate([[p for p, _ in c] for c in chunks],
                                           [[s for _, s in c] for c in chunks], sampling,
                                           progress=progress),
                           tokenizer.pad_token_id)
    texts = batch.texts(tokenizer)
    scores = torch.tensor([
        get_reward(reward or e.reward)(texts[i * k + j], e.answer)
        for i, e in enumerate(examples) for j in range(k)]).reshape(len(examples), k)
    levels: dict[str, list[float]] = defaultdict(list)
    for e, row in zip(examples, scores, strict=True):
        if "level" in e.meta:
            levels[str(e.meta["level"])].append(row.mean().item())
    return EvalResult(k, len(examples), scores.mean().item(),
                      (scores.max(dim=1).values > 0).float().mean().item(),
                      {lv: sum(v) / len(v) for lv, v in sorted(levels.items())},
                      batch.response_mask.sum(1).float().mean().item(),
                      (scores > 0).sum(dim=1).tolist(), prompt_digest(examples))
