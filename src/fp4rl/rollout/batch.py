"""What a rollout engine is asked for and what it returns: the sampling settings and the
sampled batch, laid out for the trainer's teacher-forced pass.

Prompts are left-padded so every row's next token sits in the last column, and position
ids are derived from the attention mask so a padded row sees the same positions as it
would alone. Every engine lays its batches out this way, so the trainer, the evaluation
and the log-prob code read one shape whichever engine sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick each next token.

    ``temperature`` divides the logits; ``top_k`` (0 = off) keeps the k most likely tokens
    (ties with the k-th are kept too); ``top_p`` then keeps the smallest set of most likely
    tokens whose renormalized mass reaches ``top_p``. ``greedy`` takes the argmax and
    ignores the other three.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    greedy: bool = False

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (or use greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutBatch:
    """Prompts and sampled responses, laid out for a teacher-forced forward pass.

    ``prompt_ids``/``prompt_mask`` are (B, P), left-padded; ``response_ids``/``response_mask``
    are (B, R), right-padded with the pad id, the mask covering every generated token
    including a final EOS. ``logprobs`` (B, R) float32 holds each sampled token's
    log-probability under the distribution it was drawn from, 0 where masked. ``finished``
    (B,) is True where the response ended with EOS rather than at the length limit.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt + response ids (B, P+R) and their attention mask, ready for a forward pass."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return ids, mask

    def response_lengths(self) -> torch.Tensor:
        """Number of generated tokens per row (B,), the EOS included."""
        return self.response_mask.sum(dim=1)

    def texts(self, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        """The responses as text, special tokens (EOS, padding) left out."""
        rows = zip(self.response_ids.tolist(), self.response_lengths().tolist(), strict=True)
        # one sequence of ids decodes to one str (the stubs also allow a batch's list)
        return [cast(str, tokenizer.decode(ids[:n], skip_special_tokens=True))
                for ids, n in rows]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only attended tokens, so padding does not shift them.

    Padding positions get 0; they are masked anyway. Use the same function for the
    teacher-forced pass so it sees the positions the rollout used.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)



def _pad_to(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    fill = tensor.new_full((tensor.shape[0], missing), value)
    return torch.cat([fill, tensor] if left else [tensor, fill], dim=1)


def concat_batches(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Join micro-batches, re-padding prompts on the left and responses on the right."""
    if len(batches) == 1:
        return batches[0]
    p = max(b.prompt_ids.shape[1] for b in batches)
    r = max(b.response_ids.shape[1] for b in batches)
    return RolloutBatch(
        prompt_ids=torch.cat([_pad_to(b.prompt_ids, p, pad_token_id, True) for b in batches]),
        prompt_mask=torch.cat([_pad_to(b.prompt_mask, p, 0, True) for b in batches]),
        response_ids=torch.cat([_pad_to(b.response_ids, r, pad_token_id, False)
                                for b in batches]),
        response_mask=torch.cat([_pad_to(b.response_mask, r, 0, False) for b in batches]),
        logprobs=torch.cat([_pad_to(b.logprobs, r, 0.0, False) for b in batches]),
        finished=torch.cat([b.finished for b in batches]),
    )
