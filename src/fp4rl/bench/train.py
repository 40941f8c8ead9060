"""``fp4rl bench train``: one GRPO step, split into its phases, BF16 versus FP4.

Two trainers on the same model, data and seed, both with ``mixed_precision: bf16`` (bf16
compute, FP32 masters): the BF16 recipe (the paper's baseline) and full FP4 (HiF4 on the
three training GEMMs, HiF4 + ResQ-2:4 rollout). Their steps are interleaved, so both see the
same machine load; each phase's time is the median over the repeats. The phases are the
trainer's own timers: rollout (KV-cache sampling in the rollout policy), reward, old-log-
prob recomputation (teacher forcing in the training policy; on-policy, the default, the
update's own forward gives them for the rows that train, and this phase scores the rows
that do not, for NeMo-RL's every-token metrics; with ``grpo.mismatch_tokens: trained`` it
has no row) and update (loss, backward, optimizer step).

Both trainers do the same work, so that the ratios compare precisions and not luck: every
response runs to the length limit (no EOS) and the reward is a fixed pseudo-random sequence,
the same for both, so the same groups carry advantages and are trained on.

``engine="vllm"`` compares engines instead: the FP4 recipe with its rollout in fp4rl's
engine (``hf``, the baseline) and in a colocated vLLM engine (``rollout.engine: vllm``),
whose step includes the refit of the new weights into the engine (its own row).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from statistics import median
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from fp4rl.bench.common import Comparison
from fp4rl.rl.config import load_config

if TYPE_CHECKING:
    from fp4rl.rl.trainer import Trainer

PHASES = ("rollout", "reward", "old_logprob", "update", "refit")
#: per compared engine choice: (baseline, candidate), each key -> (recipe, rollout engine)
CONTESTS = {"hf": {"bf16": ("bf16", "hf"), "fp4": ("hif4+resq-2:4", "hf")},
            "vllm": {"hf": ("hif4+resq-2:4", "hf"), "vllm": ("hif4+resq-2:4", "vllm")}}
SMALL = {"mixed_precision": "bf16", "data.train_size": 64, "grpo.num_generations": 8,
         "grpo.batch_size": 2, "grpo.micro_batch_size": 16, "grpo.max_response_length": 48,
         "grpo.temperature": 0.8, "grpo.learning_rate": 1e-6, "run.save_steps": 1000}


def _coin_flips(seed: int) -> Callable[[str | None, str], float]:
    """A reward that ignores the completion: a reproducible stream of 0/1 values."""
    rng = random.Random(seed)
    return lambda completion, reference: float(rng.random() < 0.5)


def _trainer(model_name: str, key: str, recipe: str, engine: str, out: str,
             changes: dict[str, object]) -> Trainer:
    from fp4rl.nn import get_recipe
    from fp4rl.rl.rewards import register_reward
    from fp4rl.rl.trainer import Trainer

    # a fresh generator per trainer: each measured step flips the same coins
    register_reward(f"bench_coin_flips_{key}", _coin_flips(0), replace=True)
    rec = get_recipe(recipe).to_dict()
    cfg = load_config(None, None, {"model": model_name, **SMALL, **changes,
                                   "data.reward": f"bench_coin_flips_{key}",
                                   "train": rec["train"],
                                   "rollout": {**rec["rollout"], "engine": engine}})
    trainer = Trainer.from_config(cfg, out, log=lambda message: None)
    trainer.eos_ids = []  # every response runs to grpo.max_response_length
    return trainer


def run(model_name: str = "smollm2-135m", repeats: int = 3,
        changes: dict[str, object] | None = None, device: str = "cpu",
        engine: str = "hf") -> list[Comparison]:
    """Per-phase and whole-step ratios, candidate over baseline (medians of interleaved
    steps): fp4 / bf16 in fp4rl's engine, or with ``engine="vllm"`` the FP4 recipe's
    vllm / hf."""
    import tempfile

    contest = CONTESTS[engine]
    base, cand = contest
    times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in (*PHASES, "step")}
                                                for k in contest}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {k: _trainer(model_name, k, recipe, eng, f"{tmp}/{k}",
                                {"device": device, **(changes or {})})
                    for k, (recipe, eng) in contest.items()}
        for i in range(repeats + 1):  # the first step warms up caches and kernels
            for key, trainer in trainers.items():
                m = trainer.train_step()
                if i == 0:
                    continue
                for phase in PHASES:
                    times[key][phase].append(m.get(f"time/{phase}", 0.0))
                times[key]["step"].append(sum(m.get(f"time/{p}", 0.0) for p in PHASES))
        # an on-policy step measuring the rows that train alone runs no old-log-prob pass
        # (with NeMo-RL's every-token metrics, the default, it scores the rows that do
        # not train): no row for what neither side ran; the refit has no counterpart in
        # fp4rl's engine: no ratio row, its time is named on the step's row (which
        # includes it)
        no_pass = trainers[cand].on_policy and \
            trainers[cand].cfg.grpo.mismatch_tokens == "trained"
        skip = {"old_logprob", "refit"} if no_pass else {"refit"}
        done = [p for p in (*PHASES, "step") if p not in skip]
    refit = median(times[cand]["refit"])
    return [Comparison.of(f"train.{phase}.{cand}_vs_{base}", cand, base, times[cand][phase],
                          times[base][phase], f"includes the refit, {refit:.2f} s"
                          if phase == "step" and refit else "")
            for phase in done]


def render(results: list[Comparison], console: Console) -> None:
    base, cand = results[-1].baseline, results[-1].candidate
    what = ("BF16 vs FP4 (HiF4 train, HiF4 + ResQ-2:4 rollout)" if base == "bf16" else
            "FP4 (HiF4 train, HiF4 + ResQ-2:4 rollout), rollout in fp4rl's engine (hf) vs "
            "vLLM (refit included)")
    table = Table(title=f"one GRPO step (median seconds): {what}")
    for col in ("phase", f"{base} s", f"{cand} s", f"{cand} / {base}",
                f"share of {cand} step"):
        table.add_column(col, justify="right")
    step = median(results[-1].candidate_times)
    for r in results:
        phase = r.name.split(".")[1]
        fp4 = median(r.candidate_times)
        table.add_row(phase, f"{median(r.baseline_times):.2f}", f"{fp4:.2f}",
                      r.shown(), f"{fp4 / step:.0%}" if phase != "step" else "")
    console.print(table)
    if results[-1].target:
        console.print(f"{cand} step {results[-1].target} (weights into the engine, "
                      "re-quantized)")
