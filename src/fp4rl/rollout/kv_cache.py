"""fp4rl's own rollout engine (``hf``): the Hugging Face model itself, its patched linears
in rollout mode, sampled with its KV cache.

The model's own KV cache carries the prompt, so each decode step feeds one token per row.
Rows that finish are dropped from the batch (and from the cache), which matters on CPU
where RL responses vary widely in length. :func:`generate` never switches a patched
model's policy (callers wrap it in ``fp4rl.rollout_mode(model)``);
:class:`KVCacheEngine`, the engine the trainer, evaluation and the TRL plug-in use, does
that itself, under the run's compute dtype.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from rich.console import Console
from rich.progress import Progress

from fp4rl.nn import (
    calibrate_static_scales,
    fp4_layers,
    hold_weights,
    needs_static_calibration,
    rollout_mode,
)
from fp4rl.nn.invariant import invariant_for
from fp4rl.precision import autocast
from fp4rl.progress import LogProgress, progress_bar
from fp4rl.rollout.base import ProgressFn, RolloutSetup, check_seeds
from fp4rl.rollout.batch import (
    RolloutBatch,
    SamplingConfig,
    concat_batches,
    left_pad,
    position_ids,
)
from fp4rl.rollout.sampling import row_generators, sample_next
from fp4rl.rollout.weight_sync import is_fsdp, refresh_rollout_copy

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fp4rl.nn.recipe import Recipe


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
        with invariant_for(model):  # the trainer's log-softmax, where batch-invariant
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


@torch.no_grad()
def calibrate(model: torch.nn.Module, chunks: Sequence[Sequence[Sequence[int]]],
              pad_token_id: int) -> bool:
    """Fix the static NVFP4 activation scales of ``model`` (in its current mode) for the
    step from every prompt of ``chunks``: one prefill per chunk of its distinct prompts,
    the layers unquantized (:func:`fp4rl.nn.calibrate_static_scales`), before any token is
    sampled. A prompt's rows do not depend on the chunk it is in (under a batch-invariant
    forward, to the bit), and the amax over all of them does not depend on the split, so
    neither does the scale: a step rolled out in chunks of 6 and one in chunks of 2 are
    one policy. Returns whether there was anything to calibrate."""
    if not needs_static_calibration(model):
        return False
    device = next(model.parameters()).device
    extra = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    with calibrate_static_scales(model):
        for chunk in chunks:
            if not chunk:
                continue
            ids, mask = left_pad(chunk, pad_token_id, device)
            unique, _ = _distinct(chunk, device)
            model(input_ids=ids[unique], attention_mask=mask[unique],
                  position_ids=position_ids(mask[unique]), use_cache=False, **extra)
    return True


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


def _progress_fn(progress: bool | ProgressFn, total_steps: int
                 ) -> tuple[ProgressFn | None, Progress | LogProgress | None]:
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
    calibrate_scales: bool = True,
) -> RolloutBatch:
    """Sample one response per prompt (token-id lists) with the model's KV cache.

    Each row stops at its first token in ``eos_token_ids`` or after
    ``config.max_new_tokens`` tokens. Sampling draws only from ``generator`` (on the
    model's device), so a fixed seed reproduces the rollout. ``batch_size`` splits the
    prompts into micro-batches run one after another, bounding memory; greedy results do
    not depend on it. ``progress=True`` shows a progress bar over decode steps; a callable is
    called after every decode step with the number of tokens it produced. Wrap the call
    in ``fp4rl.rollout_mode(model)`` to sample from a patched model's rollout policy.

    The call holds the model's weights (:func:`fp4rl.nn.hold_weights`: each patched layer
    quantizes its weight once, not at every decode step), and where its activations take a
    static NVFP4 scale, ``calibrate_scales`` fixes it from all the prompts first
    (:func:`calibrate`), so that it does not depend on ``batch_size`` either.
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
        with hold_weights(model):
            if calibrate_scales:
                calibrate(model, chunks, pad_token_id)
            batches = [_generate_batch(model, chunk, config, pad_token_id, eos, gen, on_step)
                       for chunk, gen in zip(chunks, gens, strict=True)]
    finally:
        if bar is not None:
            bar.stop()
    return concat_batches(batches, pad_token_id)


class KVCacheEngine:
    """fp4rl's KV-cache engine on ``policy`` (a module, patched or not): each chunk is one
    micro-batch, each row draws from its own generator, under ``mixed_precision``'s
    autocast and, for a patched model, in rollout mode.

    Under FSDP ``policy`` is an unsharded rollout copy, and :meth:`sync` refreshes it from
    the sharded model with 4-bit packed weights (:mod:`fp4rl.rollout.weight_sync`);
    otherwise it is the trainer's model, which is always current."""

    name: ClassVar[str] = "hf"
    summary: ClassVar[str] = "fp4rl's KV-cache engine on the trainer's model"
    # typed as RolloutEngine declares it: a protocol's ClassVar is matched exactly
    settings: ClassVar[type[BaseModel] | None] = None
    batch_invariant: ClassVar[bool] = True
    auto_priority: ClassVar[int] = 0
    auto_when: ClassVar[str] = ""
    samples_module: ClassVar[bool] = True

    @classmethod
    def serves(cls, recipe: Recipe, device: torch.device) -> bool:
        """Every recipe, on every device."""
        return True

    @classmethod
    def settle(cls, settings: BaseModel | None, device: torch.device) -> BaseModel | None:
        """Nothing to settle: ``settings`` as they are (None: it takes none)."""
        return settings

    @classmethod
    def check_config(cls, settings: BaseModel | None, recipe: Recipe, shards: bool,
                     named: bool) -> None:
        """Every config runs here."""

    def __init__(self, policy: torch.nn.Module, pad_token_id: int,
                 eos_token_ids: Sequence[int], *,
                 compute_dtype: torch.dtype = torch.float32, world_size: int = 1) -> None:
        """``compute_dtype``: the run's (:func:`fp4rl.precision.compute_dtype`); bf16
        samples under bf16 autocast, as the trainer's forward runs."""
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.compute_dtype = compute_dtype
        self.world_size = world_size

    @classmethod
    def check(cls, recipe: Recipe, device: torch.device, world_size: int) -> None:
        """Every recipe, device and process count runs here."""

    @classmethod
    def from_setup(cls, setup: RolloutSetup) -> KVCacheEngine:
        return cls(setup.policy, setup.pad_token_id, setup.eos_token_ids,
                   compute_dtype=setup.compute_dtype, world_size=setup.world_size)

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Nothing for a whole model (the engine samples from it); for an FSDP2-sharded
        one, its rollout copy refreshed from the shards (bytes moved and seconds, as
        metrics)."""
        if not is_fsdp(model):
            return {}
        return refresh_rollout_copy(model, self.policy, self.world_size)

    def close(self) -> None:
        """Nothing to release: the policy is the trainer's module."""

    def generate(self, chunks: Sequence[Sequence[Sequence[int]]],
                 seeds: Sequence[Sequence[int]], sampling: SamplingConfig,
                 progress: bool | ProgressFn = False) -> list[RolloutBatch]:
        check_seeds(chunks, seeds)
        device = next(self.policy.parameters()).device
        patched = bool(fp4_layers(self.policy))
        mode = rollout_mode(self.policy) if patched else contextlib.nullcontext()
        on_step, bar = _progress_fn(progress, len(chunks) * sampling.max_new_tokens)
        try:
            with autocast(device, self.compute_dtype), mode, hold_weights(self.policy):
                # the static scales from every chunk's prompts, before any chunk samples
                calibrate(self.policy, chunks, self.pad_token_id)
                return [generate(self.policy, chunk, sampling, pad_token_id=self.pad_token_id,
                                 eos_token_ids=self.eos_token_ids,
                                 generator=row_generators(chunk_seeds, device),
                                 progress=on_step or False, calibrate_scales=False)
                        for chunk, chunk_seeds in zip(chunks, seeds, strict=True)]
        finally:
            if bar is not None:
                bar.stop()
