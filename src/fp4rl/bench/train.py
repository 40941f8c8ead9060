"""``fp4rl bench train``: one GRPO step, split into its phases, BF16 versus FP4.

Two trainers on the same model, data and seed, both with ``mixed_precision: bf16`` (bf16
compute, FP32 masters): the BF16 recipe (the paper's baseline) and full FP4 (HiF4 on the
three training GEMMs, HiF4 + ResQ-2:4 rollout). Their steps are interleaved, so both see the
same machine load; each phase's time is the median over the repeats. The phases are the
trainer's own timers: rollout (KV-cache sampling in the rollout policy), reward, old-log-
prob recomputation (teacher forcing in the training policy; on-policy, the default, the
update's own forward gives them and this phase has no row) and update (loss, backward,
optimizer step).

Both trainers do the same work, so that the ratios compare precisions and not luck: every
response runs to the length limit (no EOS) and the reward is a fixed pseudo-random sequence,
the same for both, so the same groups carry advantages and are trained on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from statistics import median
from typing import Any

from rich.console import Console
from rich.table import Table

from fp4rl.bench.common import Comparison
from fp4rl.rl.config import load_config

PHASES = ("rollout", "reward", "old_logprob", "update")
RECIPES = {"bf16": "bf16", "fp4": "hif4+resq-2:4"}
SMALL = {"mixed_precision": "bf16", "data.train_size": 64, "grpo.num_generations": 8,
         "grpo.batch_size": 2, "grpo.micro_batch_size": 16, "grpo.max_response_length": 48,
         "grpo.temperature": 0.8, "grpo.learning_rate": 1e-6, "run.save_steps": 1000}


def _coin_flips(seed: int) -> Callable[[str, str], float]:
    """A reward that ignores the completion: a reproducible stream of 0/1 values."""
    rng = random.Random(seed)
    return lambda completion, reference: float(rng.random() < 0.5)


def _trainer(model_name: str, key: str, recipe: str, out: str,
             changes: dict[str, Any]) -> Any:
    from fp4rl.nn import preset
    from fp4rl.rl.rewards import register_reward
    from fp4rl.rl.trainer import Trainer

    register_reward(f"bench_coin_flips_{key}", _coin_flips(0))
    rec = preset(recipe).to_dict()
    cfg = load_config(None, None, {"model": model_name, **SMALL, **changes,
                                   "data.reward": f"bench_coin_flips_{key}",
                                   "train": rec["train"], "rollout": rec["rollout"]})
    trainer = Trainer.from_config(cfg, out, log=lambda message: None)
    trainer.eos_ids = []  # every response runs to grpo.max_response_length
    return trainer


def run(model_name: str = "smollm2-135m", repeats: int = 3,
        changes: dict[str, Any] | None = None, device: str = "cpu") -> list[Comparison]:
    """Per-phase and whole-step fp4 / bf16 ratios (medians of interleaved steps)."""
    import tempfile

    times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in (*PHASES, "step")}
                                                for k in RECIPES}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {k: _trainer(model_name, k, r, f"{tmp}/{k}",
                                {"device": device, **(changes or {})})
                    for k, r in RECIPES.items()}
        for i in range(repeats + 1):  # the first step warms up caches and kernels
            for key, trainer in trainers.items():
                m = trainer.train_step()
                if i == 0:
                    continue
                for phase in PHASES:
                    times[key][phase].append(m[f"time/{phase}"])
                times[key]["step"].append(sum(m[f"time/{p}"] for p in PHASES))
        # an on-policy step (the default) runs no old-log-prob pass: no row for it
        done = [p for p in (*PHASES, "step")
                if p != "old_logprob" or not trainers["fp4"].on_policy]
    return [Comparison(f"train.{phase}.fp4_vs_bf16", "fp4", "bf16", times["fp4"][phase],
                       times["bf16"][phase], median(times["fp4"][phase]) /
                       max(median(times["bf16"][phase]), 1e-9))
            for phase in done]


def render(results: list[Comparison], console: Console) -> None:
    table = Table(title="one GRPO step (median seconds): BF16 vs FP4 (HiF4 train, "
                        "HiF4 + ResQ-2:4 rollout)")
    for col in ("phase", "bf16 s", "fp4 s", "fp4 / bf16", "share of fp4 step"):
        table.add_column(col, justify="right")
    step = median(results[-1].candidate_times)
    for r in results:
        phase = r.name.split(".")[1]
        fp4 = median(r.candidate_times)
        table.add_row(phase, f"{median(r.baseline_times):.2f}", f"{fp4:.2f}",
                      f"{r.ratio:.2f}x", f"{fp4 / step:.0%}" if phase != "step" else "")
    console.print(table)
