"""Rollout fidelity: how far each rollout configuration strays from the training policy.

All rows score the same token sequences (prompts plus the unquantized model's greedy
completions), teacher-forced, so differences come from the numerics alone:

- ``kl``: mean per-token KL(unquantized || rollout) over completion tokens;
- ``kl_vs_train``: the same against the FP4 *training* policy of the same format, the
  mismatch that GRPO's importance weights must absorb;
- ``logprob_diff`` / ``logprob_diff_vs_train``: mean |log p - log q| of the sequence's
  own tokens;
- ``accuracy``: greedy accuracy of the rollout policy on the arithmetic prompts.

Row names: ``bf16``, ``<format>`` (plain FP4 rollout) and ``<format>+<recovery>``; the
training side of a row is full FP4 in that format (bf16 for the bf16 row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp4rl.nn import begin_step, get_recipe, quantize_model, rollout_mode, train_mode
from fp4rl.recovery import recovery_variants
from fp4rl.rl.rewards import get_reward
from fp4rl.rollout import SamplingConfig, generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def default_methods(formats: Sequence[str] = ("hif4", "mxfp4")) -> list[str]:
    """The bf16 row, then every registered recovery variant for each format."""
    return ["bf16"] + [f"{fmt}+{suffix}" if suffix else fmt for fmt in formats
                       for suffix, _ in recovery_variants()]


@dataclass
class FidelityRow:
    method: str
    kl: float
    kl_vs_train: float
    logprob_diff: float
    logprob_diff_vs_train: float
    accuracy: float


@dataclass
class Batch:
    """Right-padded teacher-forcing batch; ``scored`` marks completion tokens to score."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    scored: torch.Tensor


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Batch:
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    scored = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, rows, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        scored[i, len(p): len(r)] = True
    return Batch(ids, mask, scored)


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log-softmax over the vocabulary at each scored position: (n_scored, vocab)."""
    device = next(model.parameters()).device
    logits = model(input_ids=batch.input_ids.to(device),
                   attention_mask=batch.attention_mask.to(device)).logits
    # logits at t predict token t+1
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp[batch.scored[:, 1:].to(device)].cpu()


def compare(ref: torch.Tensor, other: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float]:
    """Mean per-token KL(ref || other) and mean |log-prob difference| of ``tokens``."""
    kl = (ref.exp() * (ref - other)).sum(-1).mean().item()
    diff = (ref.gather(-1, tokens[:, None]) - other.gather(-1, tokens[:, None])).abs()
    return kl, diff.mean().item()


def greedy_completions(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                       prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids, EOS included), from the KV-cache rollout engine."""
    batch = generate(model, prompts, SamplingConfig(max_new_tokens=max_new_tokens, greedy=True),
                     pad_token_id=tokenizer.pad_token_id, eos_token_ids=tokenizer.eos_token_id)
    return [ids[:n] for ids, n in zip(batch.response_ids.tolist(),
                                      batch.response_lengths().tolist(), strict=True)]


def accuracy(tokenizer: PreTrainedTokenizerBase, completions: list[list[int]],
             answers: Sequence[str], reward: Callable[[str, str], float]) -> float:
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return sum(reward(t, a) for t, a in zip(texts, answers, strict=True)) / len(texts)


def run_fidelity(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                 prompts: list[list[int]], answers: Sequence[str], methods: Sequence[str],
                 max_new_tokens: int = 48, reward: str = "gsm8k",
                 progress: Callable[[str], None] = lambda _: None) -> list[FidelityRow]:
    """Score every method on the same sequences; ``model`` is patched in place."""
    reward_fn = get_reward(reward)
    completions = greedy_completions(model, tokenizer, prompts, max_new_tokens)
    batch = make_batch(prompts, completions, tokenizer.pad_token_id)
    tokens = batch.input_ids[:, 1:][batch.scored[:, 1:]]
    reference = token_logprobs(model, batch)
    rows = []
    for method in methods:
        progress(method)
        quantize_model(model, get_recipe(method))
        begin_step(model)
        with rollout_mode(model):
            rollout = token_logprobs(model, batch)
            acc = accuracy(tokenizer, greedy_completions(model, tokenizer, prompts,
                                                         max_new_tokens), answers, reward_fn)
        with train_mode(model):
            trained = token_logprobs(model, batch)
        kl, diff = compare(reference, rollout, tokens)
        kl_t, diff_t = compare(trained, rollout, tokens)
        rows.append(FidelityRow(method, kl, kl_t, diff, diff_t, acc))
    return rows
