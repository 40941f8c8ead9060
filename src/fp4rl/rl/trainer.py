"""The GRPO training loop: rollout in the FP4 rollout policy, update in the FP4 training policy.

One RL step, :meth:`Trainer.train_step`, is described once, phase by phase in the order
it runs, in docs/architecture.md ("One RL step").

The model, its tokenizer, the optimizer and the training examples are built outside and
handed in (:meth:`Trainer.from_config` builds them from a config: the model by name, the
optimizer by its ``torch.optim`` name, the examples from ``data``).

Every step appends one JSON line to ``<output>/metrics.jsonl`` and checkpoints are
written every ``run.save_steps``; ``resume=True`` continues from the latest checkpoint
and reproduces, on CPU and for a fixed seed, exactly the metrics of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from fp4rl.data import Example
from fp4rl.errors import ConfigError
from fp4rl.nn import (
    begin_step,
    copy_static_scales,
    fp4_layers,
    hold_weights,
    load_rollout_states,
    quantize_model,
    rollout_states,
    train_mode,
)
from fp4rl.precision import (
    autocast,
    slow_bf16_note,
)
from fp4rl.rl.checkpoint import RunState
from fp4rl.rl.config import TrainConfig
from fp4rl.rl.datasets import encode_examples, load_split, stop_token_ids
from fp4rl.rl.distributed import (
    all_gather,
    gradient_sync,
    reduce_metrics,
    wrap_model,
)
from fp4rl.rl.grpo import group_advantages, grpo_loss, masked_mean, mismatch_stats
from fp4rl.rl.logprobs import response_logprobs
from fp4rl.rl.optim import build_optimizer
from fp4rl.rl.plan import RunPlan, plan_run
from fp4rl.rl.resume import Checkpointer
from fp4rl.rl.rewards import get_reward
from fp4rl.rl.rundir import Metrics, RunDir, check_same_run
from fp4rl.rollout import (
    RolloutBatch,
    RolloutEngine,
    RolloutSetup,
    SamplingConfig,
    concat_batches,
    sample_seed,
)
from fp4rl.rollout.weight_sync import is_fsdp

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class _Sequences(NamedTuple):
    """The rollout batch laid out for teacher forcing, built once per update."""

    ids: torch.Tensor
    attention: torch.Tensor
    prompt_width: int


@dataclass
class DataCursor:
    """Position in the shuffled training set: epoch and index inside its permutation."""

    epoch: int = 0
    index: int = 0


@dataclass
class StepTimings:
    """Where one RL step's time went, and the tokens each phase processed."""

    rollout: float = 0.0
    reward: float = 0.0
    old_logprob: float = 0.0  # teacher-forced pi_old (and the reference policy)
    update: float = 0.0  # the loss, backward and optimizer steps
    rollout_tokens: int = 0
    train_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        """The ``time/*`` and ``tokens_per_second/*`` entries of a metrics line."""
        return {"time/rollout": self.rollout, "time/reward": self.reward,
                "time/old_logprob": self.old_logprob, "time/update": self.update,
                "tokens_per_second/rollout": self.rollout_tokens / max(self.rollout, 1e-9),
                "tokens_per_second/train": self.train_tokens / max(self.update, 1e-9)}


@dataclass
class UpdateResult:
    """What :meth:`Trainer.update` reports: loss statistics, and its own costs, each
    phase timed once (no-grad log-prob passes; epochs of loss, backward and steps)."""

    stats: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    logprob_seconds: float = 0.0
    update_seconds: float = 0.0


class Trainer:
    """GRPO on one model object that serves as both the rollout and the training policy."""

    def __init__(self, config: TrainConfig | RunPlan, output_dir: str | Path,
                 model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, *,
                 optimizer: torch.optim.Optimizer | None = None,
                 examples: list[Example] | None = None,
                 log: Callable[[str], None] = print) -> None:
        """``config`` is resolved here (:func:`~fp4rl.rl.plan.plan_run`) unless it is a
        plan already; ``optimizer`` must hold ``model``'s parameters (default:
        ``optimizer`` of the config); ``examples`` default to the config's ``data``
        training split."""
        #: the run resolved once: device, process group, compute dtype, recipe, engine
        self.plan = plan = config if isinstance(config, RunPlan) else plan_run(config)
        self.dist, self.device = plan.dist, plan.device
        self.mixed_precision = plan.mixed_precision
        #: the config as run: device, precision and strategy resolved, so it reproduces
        #: the run
        self.cfg = config = plan.config
        self.out = Path(output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        #: where the run's files go (:mod:`fp4rl.rl.rundir`)
        self.run_dir = RunDir(self.out)
        self.log = log
        _seed_everything(config.run.seed)
        self.model, self.tok = _fp32_masters(model, log).to(self.device), tokenizer
        log(f"device {self.device}, mixed_precision={self.mixed_precision} (compute "
            f"{str(plan.compute_dtype).removeprefix('torch.')}, "
            "FP32 master weights and optimizer)")
        note = slow_bf16_note(self.mixed_precision, self.device)
        if note:
            log(note)
        self.recipe = plan.recipe
        quantize_model(self.model, self.recipe, batch_invariant=plan.batch_invariant,
                       weight_cache=plan.weight_cache)
        self.model.eval()  # no dropout in either policy; gradients still flow
        #: the rollout policy's model: the training model itself, or under FSDP an
        #: unsharded copy refreshed from the shards once per step (generation runs many
        #: forwards of different counts per rank, which sharded layers cannot)
        self.policy = copy.deepcopy(self.model) if self.dist.shards else self.model
        if self.dist.shards and optimizer is not None:
            raise ConfigError("distributed.strategy=fsdp shards the parameters, so the trainer "
                              "builds the optimizer itself (set optimizer.name/kwargs)")
        #: what the loss's forward runs through: the model, its DDP wrapper, or the model
        #: with FSDP2-sharded layers
        self.train_model = wrap_model(self.model, self.dist, self.device)
        #: the bytes of the FP4 layers' kept Q(W) operands at the last update's end
        self.weight_cache_bytes = 0
        self.ref_model = self._reference_model() if config.grpo.beta > 0 else None
        if config.data.reward:
            get_reward(config.data.reward)  # an unknown name fails now, not after a rollout
        self.optimizer = optimizer or build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad], config)
        #: where checkpoints are written and resumed from (:mod:`fp4rl.rl.resume`)
        self.checkpoints = Checkpointer(self.out, self.model, self.policy, self.optimizer,
                                        self.dist, config.run.keep_checkpoints, log)
        if examples is None:
            examples = load_split(config.data, "train", config.run.seed)
        self.train_examples, self.train_prompts = encode_examples(
            examples, tokenizer, config.grpo.max_prompt_length, config.data.template,
            config.data.strict, log)
        self.cursor = DataCursor()
        self.step = 0
        self.eos_ids = stop_token_ids(tokenizer)
        self.last_timings = StepTimings()
        #: the rollout engine ``rollout.engine`` names (:mod:`fp4rl.rollout`), built now
        #: so that no step's timings include its start
        self.engine = self._rollout_engine()

    @classmethod
    def from_config(cls, config: TrainConfig, output_dir: str | Path,
                    log: Callable[[str], None] = print) -> Trainer:
        """A trainer whose model (``config.model``, loaded on the config's device),
        optimizer and examples are built from ``config``."""
        from fp4rl.models import load_model
        from fp4rl.models.registry import REGISTRY, local_model_dir

        if config.model not in REGISTRY:
            local_model_dir(config.model)  # a model that is not there: one line, first
        examples = load_split(config.data, "train", config.run.seed)  # then a data error
        # an engine that cannot serve the run (vLLM absent, on several processes): one
        # line before minutes of loading
        plan = plan_run(config)
        model, tokenizer = load_model(config.model, device=plan.device)
        return cls(plan, output_dir, model, tokenizer, examples=examples, log=log)

    # ----- data ----------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train_prompts)))
        random.Random(f"{self.cfg.run.seed}/{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        """Indices of the next ``batch_size`` prompts, cycling through shuffled epochs."""
        chosen: list[int] = []
        order = self._order(self.cursor.epoch)
        while len(chosen) < self.cfg.grpo.batch_size:
            if self.cursor.index >= len(order):
                self.cursor = DataCursor(self.cursor.epoch + 1, 0)
                order = self._order(self.cursor.epoch)
            chosen.append(order[self.cursor.index])
            self.cursor.index += 1
        return chosen

    # ----- one RL step ---------------------------------------------------------------
    def chunks(self, step_prompts: list[int]) -> list[list[tuple[int, int, int]]]:
        """The step's rows (prompt index, position in the step, sample) cut into chunks of
        ``4 * micro_batch_size`` rows: the same chunks on any number of processes."""
        g = self.cfg.grpo
        rows = [(prompt, pos, j) for pos, prompt in enumerate(step_prompts)
                for j in range(g.num_generations)]
        size = g.micro_batch_size * 4
        return [rows[k:k + size] for k in range(0, len(rows), size)]

    def _rollout_engine(self) -> RolloutEngine:
        """The engine the plan chose, serving ``self.policy`` (the plan has refused an
        engine that cannot serve this run, before any loading)."""
        cfg, plan = self.cfg, self.plan
        return plan.engine.from_setup(RolloutSetup(
            model=cfg.model, policy=self.policy, recipe=self.recipe,
            compute_dtype=plan.compute_dtype, seed=cfg.run.seed,
            max_model_len=cfg.grpo.max_prompt_length + cfg.grpo.max_response_length,
            pad_token_id=self.tok.pad_token_id, eos_token_ids=tuple(self.eos_ids),
            world_size=self.dist.world_size, settings=plan.engine_settings))

    def rollout(self, chunks: list[list[tuple[int, int, int]]]) -> dict[int, RolloutBatch]:
        """This rank's chunks of the step's rollout (dealt round-robin), by chunk number:
        G responses per prompt from the rollout policy, with their log-probs mu.

        Sample j of the prompt at position i draws from its own generator, seeded by (run
        seed, step, i, j): the same tokens, from the same batch shapes, on any number of
        processes."""
        g = self.cfg.grpo
        sampling = SamplingConfig(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                  max_new_tokens=g.max_response_length)
        mine = list(range(self.dist.rank, len(chunks), self.dist.world_size))
        batches = self.engine.generate(
            [[self.train_prompts[i] for i, _, _ in chunks[c]] for c in mine],
            [[sample_seed(self.cfg.run.seed, self.step, pos, j) for _, pos, j in chunks[c]]
             for c in mine], sampling)
        return dict(zip(mine, batches, strict=True))

    def rewards(self, examples: list[Example], batch: RolloutBatch) -> torch.Tensor:
        """One reward per response (on the CPU), from its example's reward function."""
        texts = batch.texts(self.tok)
        return torch.tensor([get_reward(self._reward_name(e))(t, e.answer)
                             for t, e in zip(texts, examples, strict=True)])

    def _reward_name(self, example: Example) -> str:
        return self.cfg.data.reward or example.reward

    def train_step(self) -> Metrics:
        """Run one RL step and return its metrics (timings in ``last_timings`` too).

        The step holds the weights (:func:`fp4rl.nn.hold_weights`): within it they change
        only through the optimizer, so the FP4 layers keep ``Q(W)`` from the rollout through
        the micro-batches; between steps nothing is kept, and whatever writes the weights
        there (a loader, a user's edit through ``.data``) meets no old ``Q(W)``."""
        with contextlib.ExitStack() as held:
            for model in {id(m): m for m in (self.policy, self.model)}.values():
                if fp4_layers(model):
                    held.enter_context(hold_weights(model))
            return self._train_step()

    def _train_step(self) -> Metrics:
        g = self.cfg.grpo
        self.step += 1
        timings = StepTimings()
        rows = self.chunks(self.next_batch())
        sync = self._sync_policy()
        begin_step(self.policy)
        if self.policy is not self.model and fp4_layers(self.model):
            begin_step(self.model)
        with _stopwatch(timings, "rollout"):
            mine = self.rollout(rows)
        if self.policy is not self.model:  # the rollout copy's static scales, the trainer's too
            copy_static_scales(self.policy, self.model)
        with _stopwatch(timings, "reward"):
            chunk_rewards = {c: self.rewards([self.train_examples[i] for i, _, _ in rows[c]], b)
                             for c, b in mine.items()}
        timings.rollout_tokens = sum(int(b.response_mask.sum()) for b in mine.values())
        batch, rewards = self._gather(mine, chunk_rewards)  # the whole step, in order, on device
        advantages = group_advantages(rewards, g.num_generations)  # on the CPU, as rewards
        update = self.update(batch, advantages)
        timings.old_logprob, timings.update = update.logprob_seconds, update.update_seconds
        timings.train_tokens = update.tokens
        self.last_timings = timings
        metrics = {**self._metrics(rewards, batch, update.stats, timings), **sync}
        return reduce_metrics(metrics, self.dist)

    def _gather(self, chunks: dict[int, RolloutBatch], rewards: dict[int, torch.Tensor]
                ) -> tuple[RolloutBatch, torch.Tensor]:
        """Every rank's rollout chunks and rewards, joined in the step's order: each rank
        then holds the whole batch, as a single process does, and trains its share of
        the micro-batches. The chunks travel between ranks from the CPU, and the joined
        batch goes to the training device once (the rewards stay on the CPU)."""
        if self.dist.active:
            cpu = torch.device("cpu")
            everything: dict[int, tuple[RolloutBatch, torch.Tensor]] = {}
            for part in all_gather({c: (_to_device(b, cpu), rewards[c])
                                    for c, b in chunks.items()}, self.dist):
                everything.update(part)
            chunks = {c: b for c, (b, _) in everything.items()}
            rewards = {c: r for c, (_, r) in everything.items()}
        order = sorted(chunks)
        batch = concat_batches([chunks[c] for c in order], self.tok.pad_token_id)
        return _to_device(batch, self.device), torch.cat([rewards[c] for c in order])

    def _metrics(self, rewards: torch.Tensor, batch: RolloutBatch, stats: dict[str, float],
                 timings: StepTimings) -> Metrics:
        grouped = rewards.reshape(-1, self.cfg.grpo.num_generations)
        lengths = batch.response_mask.sum(1).float()
        return {
            "step": self.step,
            "reward_mean": rewards.mean().item(),
            "reward": rewards.mean().item(),
            "reward_std": grouped.std(1).mean().item(),
            "frac_reward_zero_std": (grouped.std(1) == 0).float().mean().item(),
            **stats,
            "completions/mean_length": lengths.mean().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": (~batch.finished).float().mean().item(),
            **timings.metrics(),
            # the kept Q(W) operands (weight_cache), measured before the step drops them
            "memory/weight_cache_gb": self.weight_cache_bytes / 2**30,
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def _micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.cfg.grpo.micro_batch_size)) if rows.numel() else []

    def _logprobs(self, model: torch.nn.Module, seqs: _Sequences, rows: torch.Tensor,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        mode = train_mode(model) if fp4_layers(model) else contextlib.nullcontext()
        with self.compute(), mode:
            return response_logprobs(model, seqs.ids[rows], seqs.attention[rows],
                                     seqs.prompt_width, self.cfg.grpo.temperature,
                                     with_entropy)

    def update(self, batch: RolloutBatch, advantages: torch.Tensor) -> UpdateResult:
        """PPO-style epochs of GRPO over mini-batches of whole groups.

        Every rank holds the whole step's batch; the micro-batches (the same rows, the
        same padding on any number of processes) are dealt round-robin to the ranks, so a
        run on several processes computes each micro-batch exactly as one process does,
        FP4 blocks along tokens included."""
        g = self.cfg.grpo
        n = advantages.numel()
        mask = batch.response_mask.bool()
        ids, attention = batch.sequences()
        seqs = _Sequences(ids, attention, ids.shape[1] - batch.response_ids.shape[1])
        seq_per_mini = (g.mini_batch_size or g.batch_size) * g.num_generations
        start = time.perf_counter()
        old_logp = None if self.on_policy else self._no_grad_logprobs(self.model, seqs)
        ref_logp = self._no_grad_logprobs(self.ref_model, seqs) if self.ref_model else None
        # rows that train (zero advantage and no KL term: no gradient, skipped)
        trains = torch.ones(n, dtype=torch.bool) if ref_logp is not None else advantages != 0
        idle = (~trains).nonzero().squeeze(-1)
        idle_logp = None  # NeMo-RL measures every token: pi_old of the rows that skip too
        if old_logp is None and g.mismatch_tokens == "all" and idle.numel():
            idle_logp = self._no_grad_logprobs(self.model, seqs, idle)
        logprob_time = time.perf_counter() - start
        seen = _OldLogprobs(mask, old_logp)
        data = _UpdateBatch(batch, seqs, advantages, mask, seen, ref_logp, trains)
        stats: dict[str, list[float]] = {}
        tokens = 0
        start = time.perf_counter()
        for epoch in range(g.ppo_epochs):
            perm = torch.randperm(n // g.num_generations,
                                  generator=torch.Generator().manual_seed(
                                      self.cfg.run.seed * 1000 + self.step * 10 + epoch))
            rows_all = (perm[:, None] * g.num_generations
                        + torch.arange(g.num_generations)).reshape(-1)
            for mini in rows_all.split(seq_per_mini):
                tokens += self._mini_step(data, mini, stats)
        update_time = time.perf_counter() - start
        out = {k: float(np.mean(v)) for k, v in stats.items()}
        trained = mask & trains.to(mask.device)[:, None]
        if idle_logp is not None:
            seen.fill(idle.to(mask.device), idle_logp)
        measured = seen.mask if g.mismatch_tokens == "all" or not seen.given else trained
        out.update(mismatch_stats(seen.logp, batch.logprobs, measured, g.tis_imp_ratio_cap))
        out.update({k.replace("mismatch/", "mismatch/trained/"): v for k, v in mismatch_stats(
            seen.logp, batch.logprobs, trained & seen.mask, g.tis_imp_ratio_cap).items()
            if k.startswith("mismatch/")})
        return UpdateResult(out, tokens, logprob_time, update_time)

    @property
    def on_policy(self) -> bool:
        """One epoch of one optimizer step per rollout batch: the old policy is the current
        one, so the update takes its log-probs from its own forward, detached, and runs no
        pass of their own."""
        g = self.cfg.grpo
        return g.ppo_epochs == 1 and (g.mini_batch_size or g.batch_size) >= g.batch_size

    @torch.no_grad()
    def _no_grad_logprobs(self, model: torch.nn.Module, seqs: _Sequences,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probs of ``rows`` (default every row), in their order; each rank computes
        its micro-batches, then all share. On FSDP2-sharded layers every rank runs as many
        forwards as the busiest one (an idle rank a discarded pass), as their all-gathers
        need."""
        d = self.dist
        micros = self._micro_batches(torch.arange(seqs.ids.shape[0]) if rows is None
                                     else rows.cpu())
        mine = {i: self._logprobs(model, seqs, r)[0]
                for i, r in enumerate(micros) if i % d.world_size == d.rank}
        if is_fsdp(model):
            for _ in range(-(-len(micros) // d.world_size) - len(mine)):
                self._logprobs(model, seqs, micros[0])
        parts: dict[int, torch.Tensor] = {}
        for part in all_gather(mine, d):
            parts.update(part)
        return torch.cat([parts[i].to(self.device) for i in range(len(micros))])

    def _mini_step(self, data: _UpdateBatch, rows: torch.Tensor,
                   stats: dict[str, list[float]]) -> int:
        """One optimizer step over ``rows``, accumulating gradients over micro-batches.

        Sequences whose advantage is zero contribute no policy gradient; when no KL term
        needs them they are skipped, keeping the aggregation's denominators unchanged.
        Rank r takes micro-batches r, r + W, ...; each loss is weighted by its share of
        the mini-batch times the world size W, which the gradient average of DDP (or
        FSDP2's reduce-scatter) divides back out. Every rank runs as many forward and
        backward passes as the busiest one (an idle one a zero-weight pass), as those
        collectives need.
        """
        loss_cfg, d = self.cfg.grpo, self.dist
        batch, seqs, advantages, mask, ref_logp = (data.batch, data.seqs, data.advantages,
                                                   data.mask, data.ref_logp)
        self.optimizer.zero_grad(set_to_none=True)
        active = rows[data.trains[rows]]
        seq_mode = loss_cfg.loss_agg_mode == "seq-mean-token-mean"
        denominator = len(rows) if seq_mode else mask[rows].sum().clamp_min(1).item()
        micros = self._micro_batches(active)
        mine = micros[d.rank::d.world_size]
        passes = -(-len(micros) // d.world_size)
        tokens, total_loss = 0, 0.0
        for i in range(passes):
            weight = 1.0 if i < len(mine) else 0.0  # an idle rank's pass adds nothing
            micro = mine[i] if weight else micros[0]
            sync = i == passes - 1 or not d.active
            with gradient_sync(self.train_model, sync):
                logp, entropy = self._logprobs(self.train_model, seqs, micro,
                                               with_entropy=True)
                assert entropy is not None  # with_entropy=True
                m = mask[micro]
                loss, st = grpo_loss(logp, data.old.take(micro, logp), batch.logprobs[micro],
                                     advantages[micro].to(logp.device), m, loss_cfg,
                                     None if ref_logp is None else ref_logp[micro])
                share = weight * d.world_size * (
                    len(micro) if seq_mode else m.sum().item()) / denominator
                (loss * share).backward()
            if not weight:
                continue
            total_loss += loss.item() * share
            tokens += int(seqs.attention[micro].sum())
            for k, v in st.items():
                stats.setdefault(k, []).append(v.item())
            stats.setdefault("entropy", []).append(masked_mean(entropy, m).item())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   self.cfg.grpo.max_grad_norm or math.inf)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        self.weight_cache_bytes = sum(layer.weight_cache_bytes()
                                      for layer in fp4_layers(self.model).values())
        if active.numel():
            self.optimizer.step()
        stats.setdefault("loss", []).append(total_loss)
        stats.setdefault("grad_norm", []).append(float(grad_norm))
        stats.setdefault("active_fraction", []).append(active.numel() / max(len(rows), 1))
        return tokens

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """The run's compute context (bf16 autocast under mixed_precision=bf16)."""
        return autocast(self.device, self.plan.compute_dtype)

    def close(self) -> None:
        """Release the rollout engine (a vLLM engine's memory and process groups)."""
        self.engine.close()

    def _sync_policy(self) -> dict[str, float]:
        """Bring the rollout side up to the current weights, once per step: under
        ``rollout.engine: vllm`` refit the engine (``time/refit``, ``sync/*``); under FSDP
        refresh the rollout copy from the shards, the FP4 rollout weights as packed 4-bit
        codes (:mod:`fp4rl.rollout.weight_sync`). Returns the bytes moved, as metrics."""
        return self.engine.sync(self.model)

    def _reference_model(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.policy)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref.eval()

    # ----- run, checkpoints, resume --------------------------------------------------
    def state(self) -> RunState:
        return {
            "step": self.step, "cursor": (self.cursor.epoch, self.cursor.index),
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
            "recovery": rollout_states(self.policy),
            "config": self.cfg.model_dump(mode="json"),
        }

    def load_state(self, state: RunState) -> None:
        self.step = state["step"]
        self.cursor = DataCursor(*state["cursor"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
        load_rollout_states(self.policy, state["recovery"])

    def save(self, consolidate: bool = False) -> Path | None:
        """Write this step's checkpoint (:class:`~fp4rl.rl.resume.Checkpointer`);
        ``consolidate`` adds the whole model under FSDP. The path on rank 0."""
        return self.checkpoints.save(self.step, self.state(), consolidate)

    def resume(self) -> bool:
        """Continue from the latest checkpoint that loads, if any, and cut metrics.jsonl
        back to its step. A checkpoint of other settings (beyond
        :data:`~fp4rl.rl.config.RESUMABLE`) is refused."""
        found = self.checkpoints.load_latest()
        if found is None:
            return False
        path, state = found
        check_same_run(path, state["config"], self.cfg)
        self.load_state(state)
        if self.dist.is_main:
            self.run_dir.truncate_metrics(self.step)
        if self.ref_model is not None:  # the reference policy is the initial one
            self.log("note: the KL reference model is rebuilt from the resumed weights")
            self.ref_model = self._reference_model()
        self.log(f"resumed from {path} (step {self.step})")
        return True

    def train(self, steps: int | None = None, resume: bool = False,
              progress: Callable[[int, int, Metrics], None] | None = None
              ) -> list[Metrics]:
        """Run until ``steps`` (default ``run.steps``); returns this call's metrics."""
        total = steps or self.cfg.run.steps
        resumed = resume and self.resume()
        if not resumed and self.dist.is_main:
            self.run_dir.clear_metrics()  # lines of a run that never reached a checkpoint
        history = []
        while self.step < total:
            metrics = self.train_step()
            if self.dist.is_main:
                self.run_dir.append_metrics(metrics)
            history.append(metrics)
            if self.step % self.cfg.run.save_steps == 0 or self.step == total:
                self.save(consolidate=self.step == total)
            if progress:
                progress(self.step, total, metrics)
        return history


class _OldLogprobs:
    """The old policy's log-probs of a step's tokens, and which tokens they cover.

    Given (a separate pass, off-policy), they cover every token. On-policy they are
    taken from the update's own forward as it reaches each row, so they cover the rows
    that train: the rollout-mismatch metrics are then measured on those rows."""

    def __init__(self, mask: torch.Tensor, logp: torch.Tensor | None = None) -> None:
        self.given = logp is not None
        self.logp = logp if logp is not None else torch.zeros(mask.shape, device=mask.device)
        self.response = mask
        self.mask = mask if self.given else torch.zeros_like(mask)

    def take(self, rows: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """The old log-probs of ``rows``, whose current ones are ``logp``."""
        if self.given:
            return self.logp[rows]
        self.fill(rows, logp)
        return self.logp[rows]

    def fill(self, rows: torch.Tensor, logp: torch.Tensor) -> None:
        """Record ``logp`` as the old log-probs of ``rows`` (of a pass of their own)."""
        self.logp[rows] = logp.detach().to(self.logp.dtype)
        self.mask[rows] = self.response[rows]


@dataclass(frozen=True)
class _UpdateBatch:
    """What every mini-batch step of one update reads: the step's rollout batch, its
    sequences, advantages and response mask, the old policy's log-probs, the reference
    policy's (None without a KL term) and which rows train (a non-zero advantage, or every
    row with a KL term)."""

    batch: RolloutBatch
    seqs: _Sequences
    advantages: torch.Tensor
    mask: torch.Tensor
    old: _OldLogprobs
    ref_logp: torch.Tensor | None
    trains: torch.Tensor


def _fp32_masters(model: torch.nn.Module, log: Callable[[str], None]) -> torch.nn.Module:
    """Master weights are FP32: a model handed over in another dtype is converted."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes - {torch.float32}:
        log(f"note: converting the model's {sorted(map(str, dtypes))} weights to FP32 master "
            "weights (the compute dtype is set by mixed_precision)")
        model.float()
    return model


@contextlib.contextmanager
def _stopwatch(timings: StepTimings, phase: str) -> Iterator[None]:
    """Add the wall-clock seconds of the block to ``timings.<phase>``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(timings, phase, getattr(timings, phase) + time.perf_counter() - start)


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    return RolloutBatch(*(getattr(batch, f.name).to(device) for f in fields(batch)))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


