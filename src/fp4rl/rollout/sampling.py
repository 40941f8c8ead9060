"""Picking each next token, and the seeds that make a row's draw its own.

A sampled token's log-probability is taken under the exact distribution it was drawn from
(temperature, top-k and top-p applied): the behaviour policy's probability mu, which
the trainer divides by. Each row can draw from its own generator, seeded by
:func:`sample_seed` from (run seed, step, prompt, sample): a row then draws the same
token whatever else shares its batch, on any number of processes and in any engine that
honours per-row seeds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from fp4rl.rollout.batch import SamplingConfig


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the tokens ranked above it already reach p; the top one always stays.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits: torch.Tensor, config: SamplingConfig,
                generator: torch.Generator | Sequence[torch.Generator] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from (N, V) logits; return the tokens and their log-probs.

    The log-prob is taken under the filtered, renormalized distribution actually sampled
    from; for greedy decoding, under the plain softmax (temperature 1). ``generator`` is
    one generator for the whole batch, or one per row (a row then draws the same token
    whatever else is in the batch: what makes a sharded rollout equal a single one).
    """
    logits = logits.float()
    if config.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    filtered = _top_p(_top_k(logits / config.temperature, config.top_k), config.top_p)
    logp = filtered.log_softmax(dim=-1)
    probs = logp.exp()
    if isinstance(generator, Sequence):
        tokens = torch.cat([torch.multinomial(p, 1, generator=g)
                            for p, g in zip(probs, generator, strict=True)])
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def row_generators(seeds: Sequence[int], device: torch.device | str = "cpu"
                   ) -> list[torch.Generator]:
    """One generator per row, seeded with ``seeds`` (see :func:`sample_seed`)."""
    return [torch.Generator(device).manual_seed(s) for s in seeds]


def sample_seed(*key: object) -> int:
    """A 63-bit seed derived from ``key`` (e.g. run seed, step, prompt, sample): stable
    across processes and Python runs, unlike ``hash``."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
