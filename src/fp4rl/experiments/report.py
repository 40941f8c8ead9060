"""Tables in the paper's layout and the training-reward curves of its Figure 4.

Accuracy is reported twice: scored as the cell's rollout policy (the FP4 policy that
generated the training data, which is what the paper's verl runs validate with) and
scored with the trained master weights unquantized. Every number carries its gap to
the BF16 cell in parentheses, and each table states the standard error of one cell
(binomial, from the number of test prompts), which the gaps should be read against.
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fp4rl.experiments.grid import PRECISION_ROWS, Cell, precision_name
from fp4rl.experiments.runner import Experiment
from fp4rl.paths import write_json
from fp4rl.rl.report import moving_average

Results = dict[str, dict[str, Any]]
POLICIES = (("rollout", "scored as the cell's rollout policy"),
            ("bf16", "scored with the trained weights unquantized"),
            ("initial", "before training: the starting model as the cell's rollout policy"))
FORMAT_LABELS = {"hif4": "HiF4", "mxfp4": "MXFP4", "nvfp4": "NVFP4"}


def accuracy(result: dict[str, Any] | None, policy: str, bench: str) -> float | None:
    """Mean@k (in %) of one cell on one benchmark, or None if the cell is unfinished."""
    if result is None or bench not in result.get(policy, {}):
        return None
    scores = result[policy][bench]
    key = next(k for k in scores if k.startswith("mean@"))
    return 100.0 * scores[key]


def _cell(value: float | None, base: float | None, is_base: bool = False) -> str:
    if value is None:
        return "--"
    if is_base or base is None:
        return f"{value:.1f}"
    return f"{value:.1f} ({value - base:+.1f})"


def _stderr_note(results: Results, bench: str) -> str:
    done = [r for r in results.values() if r and bench in r.get("rollout", {})]
    if not done:
        return ""
    n = done[0]["rollout"][bench]["n"]
    p = mean(accuracy(r, "rollout", bench) for r in done) / 100
    se = 100 * math.sqrt(max(p * (1 - p), 1e-12) / n)
    return (f"One cell's standard error on {bench} ({n} prompts, accuracy near {100 * p:.0f}%): "
            f"about {se:.1f} points; a gap between two cells is noise below about "
            f"{2 * math.sqrt(2) * se:.1f} points.")


def precision_table(results: Results, formats: tuple[str, ...], bench: str,
                    policy: str) -> list[str]:
    """Table 1: rows train x rollout precision, one column per FP4 format."""
    base = accuracy(results.get("bf16"), policy, bench)
    head = "| Train | Rollout | " + " | ".join(f"FP4 = {FORMAT_LABELS[f]}" for f in formats) + " |"
    lines = [head, "|---|---|" + "---|" * len(formats)]
    for train, rollout in PRECISION_ROWS:
        values = [accuracy(results.get(precision_name(f, train, rollout)), policy, bench)
                  for f in formats]
        is_base = (train, rollout) == ("bf16", "bf16")
        lines.append(f"| {train.upper()} | {rollout.upper()} | "
                     + " | ".join(_cell(v, base, is_base) for v in values) + " |")
    return lines


def recovery_table(results: Results, cells: list[Cell], benches: list[str],
                   policy: str) -> list[str]:
    """Tables 2/4: rows format x recovery method, one column per benchmark."""
    bases = {b: accuracy(results.get("bf16"), policy, b) for b in benches}
    lines = ["| Format | Recovery | " + " | ".join(benches) + " |",
             "|---|---|" + "---|" * len(benches)]
    for fmt in [None, *dict.fromkeys(c.fmt for c in cells if c.fmt)]:
        group = [c for c in cells if c.fmt == fmt]
        for i, c in enumerate(group):
            label = "BF16" if fmt is None else (FORMAT_LABELS[fmt] if i == 0 else "")
            row = "--" if fmt is None else c.row
            values = [_cell(accuracy(results.get(c.name), policy, b), bases[b], fmt is None)
                      for b in benches]
            lines.append(f"| {label} | {row} | " + " | ".join(values) + " |")
    return lines


def _legend(cell: Cell) -> str:
    if cell.fmt is None:
        return "BF16"
    return f"{FORMAT_LABELS[cell.fmt]} (no recovery)" if cell.row == "--" else cell.row


def plot_rewards(results: Results, cells: list[Cell], path: Path, title: str) -> None:
    """Figure 4: mean training reward per step, one panel per FP4 format."""
    formats = list(dict.fromkeys(c.fmt for c in cells if c.fmt))
    fig, axes = plt.subplots(1, len(formats), figsize=(6 * len(formats), 4.2), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        for c in [x for x in cells if x.fmt in (None, fmt)]:
            r = results.get(c.name)
            if not r or not r["rewards"]:
                continue
            steps = range(1, len(r["rewards"]) + 1)
            window = max(1, len(r["rewards"]) // 5)
            style = {"color": "black", "ls": "--"} if c.fmt is None else {}
            ax.plot(steps, moving_average(r["rewards"], window), lw=1.6,
                    label=_legend(c), **style)
        ax.set_title(f"{title}: {FORMAT_LABELS[fmt]}", fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean training reward (moving average)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cost_lines(results: Results, cells: list[Cell]) -> list[str]:
    done = [results[c.name] for c in cells if results.get(c.name)]
    if not done:
        return []
    train = sum(r["train_seconds"] for r in done) / 3600
    evals = sum(r["eval_seconds"] for r in done) / 3600
    return [f"Wall clock of the {len(done)} finished cells: {train:.2f} h training + "
            f"{evals:.2f} h evaluation (torch threads per cell: "
            f"{sorted({r['torch_threads'] for r in done})})."]


def write_report(exp: Experiment, cells: list[Cell], results: Results,
                 command: list[str] | None = None) -> Path:
    """``<output>/<kind>.md``, ``<kind>_rewards.png`` and ``<kind>.json``; returns the .md."""
    out = exp.output
    benches = [e.name for e in exp.benchmarks()]
    title = "Train x rollout precision" if exp.kind == "precision" else "Rollout recovery"
    plot = out / f"{exp.kind}_rewards.png"
    plot_rewards(results, cells, plot, title)
    cmd = shlex.join(command if command is not None else ["fp4rl", *sys.argv[1:]])
    done = sum(1 for c in cells if results.get(c.name))
    lines = [f"# {title} ({exp.preset.name} preset)", "", f"Command: `{cmd}`", "",
             f"{exp.preset.description}. Cells finished: {done} of {len(cells)}; "
             f"'--' marks a cell not run yet.", ""]
    some = next((r for r in results.values() if r), None)
    if some:
        cfg = some["config"]
        lines += [f"Model {cfg['model']}, seed {cfg['run']['seed']}, {cfg['run']['steps']} "
                  f"steps, lr {cfg['grpo']['learning_rate']}, G = "
                  f"{cfg['grpo']['num_generations']}, {cfg['grpo']['batch_size']} prompts per "
                  f"step, Mean@{cfg['eval']['mean_at_k']}.", ""]
    for policy, label in POLICIES:
        lines += [f"## Accuracy (%), {label}", ""]
        for bench in benches:
            if exp.kind == "precision":
                lines += [f"{bench}:", "", *precision_table(results, exp.formats, bench, policy),
                          ""]
        if exp.kind == "recovery":
            lines += [*recovery_table(results, cells, benches, policy), ""]
    lines += [*(_stderr_note(results, b) for b in benches), "",
              "## Training reward (Figure 4)", "", f"![rewards]({plot.name})", "",
              *_cost_lines(results, cells), ""]
    path = out / f"{exp.kind}.md"
    path.write_text("\n".join(lines))
    write_json(out / f"{exp.kind}.json", {
        "kind": exp.kind, "preset": exp.preset.name, "formats": list(exp.formats),
        "benchmarks": benches, "command": cmd,
        "cells": [{"cell": c.name, "format": c.fmt, "row": c.row,
                   **({k: results[c.name][k] for k in ("initial", "rollout", "bf16", "rewards",
                                                       "train_seconds", "eval_seconds")}
                      if results.get(c.name) else {"finished": False})} for c in cells]})
    return path
