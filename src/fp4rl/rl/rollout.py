"""Batched sampling of responses from a causal LM, with the log-probabilities GRPO needs.

A rollout returns, for every sampled token, the log-probability under the exact
distribution it was drawn from (temperature, top-k and top-p applied). That is the
behaviour policy's probability: the trainer compares it with the training policy's
teacher-forced log-probability, so both must describe the same tokens at the same
positions.

Prompts are left-padded so every row's next token sits in the last column, and position
ids are derived from the attention mask so a padded row sees the same positions as it
would alone. The model's own KV cache carries the prompt, so each decode step feeds one
token per row. Rows that finish are dropped from the batch (and from the cache), which
matters on CPU where RL responses vary widely in length.

The engine never switches a patched model's policy: callers wrap it in
``fp4rl.rollout_mode(model)`` so that the same code samples from any policy.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import Progress

from fp4rl.progress import progress_bar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ProgressFn = Callable[[int], None]
"""Called after each decode step with the number of tokens that step produced."""


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
        return [tokenizer.decode(ids[:n], skip_special_tokens=True) for ids, n in rows]


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


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes (and its output returns) the KV cache:
    ``cache`` from transformers 5.24 on, which deprecates the older ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def _generate_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                    config: SamplingConfig, pad_token_id: int, eos: torch.Tensor,
                    generator: torch.Generator | list[torch.Generator] | None,
                    on_step: ProgressFn | None) -> RolloutBatch:
    """One micro-batch: prefill the prompts, then decode one token per running row.

    A prompt repeated in the batch (the G samples of a GRPO group) is prefilled once and
    its KV cache copied to every row that asks it: each row's activations, hence its
    quantization blocks (and NVFP4's per-tensor amax), are the same either way."""
    device = eos.device
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)
    n, width, steps = len(prompts), prompt_ids.shape[1], config.max_new_tokens
    unique, inverse = _distinct(prompts, device)
    response_ids = torch.full((n, steps), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((n, steps), dtype=torch.float32, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)

    # Attention mask of the running rows over prompt + all possible response slots.
    mask = torch.cat([prompt_mask, prompt_mask.new_ones((n, steps))], dim=1)
    rows = torch.arange(n, device=device)
    next_position = prompt_mask.sum(dim=1, keepdim=True)
    extra = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    cache_name = _cache_argument(model)
    out = model(input_ids=prompt_ids[unique], attention_mask=prompt_mask[unique],
                position_ids=position_ids(prompt_mask[unique]), use_cache=True, **extra)
    if len(unique) < n:
        getattr(out, cache_name).batch_select_indices(inverse)
        out.logits = out.logits[inverse]
    for step in range(steps):
        gen = [generator[i] for i in rows.tolist()] if isinstance(generator, list) else generator
        tokens, token_logprobs = sample_next(out.logits[:, -1], config, gen)
        response_ids[rows, step] = tokens
        logprobs[rows, step] = token_logprobs
        lengths[rows] = step + 1
        done = torch.isin(tokens, eos)
        finished[rows[done]] = True
        if on_step is not None:
            on_step(len(rows))
        if step + 1 == steps:
            break
        if done.any():
            keep = (~done).nonzero().squeeze(-1)
            if len(keep) == 0:
                break
            getattr(out, cache_name).batch_select_indices(keep)
            rows, tokens, mask = rows[keep], tokens[keep], mask[keep]
            next_position = next_position[keep]
        out = model(input_ids=tokens[:, None], attention_mask=mask[:, :width + step + 1],
                    position_ids=next_position, use_cache=True,
                    **{cache_name: getattr(out, cache_name)})
        next_position = next_position + 1

    used = int(lengths.max())
    response_mask = (torch.arange(used, device=device) < lengths[:, None]).long()
    return RolloutBatch(prompt_ids, prompt_mask, response_ids[:, :used], response_mask,
                        logprobs[:, :used], finished)


def _distinct(prompts: Sequence[Sequence[int]], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the first occurrence of each distinct prompt, and for every row the
    position of its prompt among those."""
    index: dict[tuple[int, ...], int] = {}
    unique: list[int] = []
    inverse = []
    for row, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(unique)
            unique.append(row)
        inverse.append(index[key])
    return (torch.tensor(unique, dtype=torch.long, device=device),
            torch.tensor(inverse, dtype=torch.long, device=device))


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


def _progress_fn(progress: bool | ProgressFn, total_steps: int
                 ) -> tuple[ProgressFn | None, Progress | None]:
    if callable(progress):
        return progress, None
    if not progress:
        return None, None
    bar = progress_bar(Console(stderr=True))
    task = bar.add_task("rollout", total=total_steps, info="decode steps")
    bar.start()
    return (lambda _tokens: bar.advance(task)), bar


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    *,
    pad_token_id: int,
    eos_token_ids: int | Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    batch_size: int | None = None,
    progress: bool | ProgressFn = False,
) -> RolloutBatch:
    """Sample one response per prompt (token-id lists) with the model's KV cache.

    Each row stops at its first token in ``eos_token_ids`` or after
    ``config.max_new_tokens`` tokens. Sampling draws only from ``generator`` (on the
    model's device), so a fixed seed reproduces the rollout. ``batch_size`` splits the
    prompts into micro-batches run one after another, bounding memory; greedy results do
    not depend on it. ``progress=True`` shows a progress bar over decode steps; a callable is
    called after every decode step with the number of tokens it produced. Wrap the call
    in ``fp4rl.rollout_mode(model)`` to sample from a patched model's rollout policy.
    """
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    eos_list = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
    eos = torch.tensor(eos_list, dtype=torch.long, device=device)
    size = batch_size or len(prompts)
    chunks = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    if isinstance(generator, Sequence) and len(generator) != len(prompts):
        raise ValueError(f"{len(generator)} generators for {len(prompts)} prompts")
    gens = [list(generator[i:i + size]) if isinstance(generator, Sequence) else generator
            for i in range(0, len(prompts), size)]
    on_step, bar = _progress_fn(progress, len(chunks) * config.max_new_tokens)
    try:
        batches = [_generate_batch(model, chunk, config, pad_token_id, eos, gen, on_step)
                   for chunk, gen in zip(chunks, gens, strict=True)]
    finally:
        if bar is not None:
            bar.stop()
    return concat_batches(batches, pad_token_id)
