"""Tables in the paper's layout, the paper's claims with verdicts, and the reward curves.

Accuracy is reported twice: scored as the cell's rollout policy (the FP4 policy that
generated the training data, which is what the paper's verl runs validate with) and
scored with the trained master weights unquantized. Each number is the mean over the
seeds that finished, with a 95% bootstrap interval over seeds and test prompts, and its
gap to the BF16 cell as a paired difference (same seeds, same prompts) with its own
interval; the claims table does the same for every comparison the paper draws
(:mod:`fp4rl.experiments.claims`) and gives each a verdict (:mod:`fp4rl.experiments.stats`).
A result file written before per-prompt outcomes were stored still loads: its cells show
means and plain gaps, without intervals.
"""

from __future__ import annotations

import shlex
import sys
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fp4rl.experiments import stats
from fp4rl.experiments.claims import FORMAT_LABELS, NOTES, Comparison, grid_claims
from fp4rl.experiments.grid import Cell, precision_name, precision_rows, train_label
from fp4rl.experiments.runner import Experiment
from fp4rl.paths import write_json
from fp4rl.rl.report import moving_average

#: cell name -> seed -> that run's result.json
Results = dict[str, dict[int, dict[str, Any]]]
Runs = dict[int, dict[str, Any]]
POLICIES = (("rollout", "scored as the cell's rollout policy"),
            ("bf16", "scored with the trained weights unquantized"),
            ("initial", "before training: the starting model as the cell's rollout policy"))
CLAIM_POLICY = "rollout"


def _scores(runs: Runs | None, policy: str, bench: str) -> list[tuple[int, dict[str, Any]]]:
    """(seed, scores) of every finished run that scored ``bench`` under ``policy``."""
    return [(seed, r[policy][bench]) for seed, r in sorted((runs or {}).items())
            if bench in r.get(policy, {})]


def _mean_at(scores: dict[str, Any]) -> tuple[int, float]:
    key = next(k for k in scores if k.startswith("mean@"))
    return int(key.removeprefix("mean@")), scores[key]


def accuracy(runs: Runs | None, policy: str, bench: str) -> float | None:
    """Mean@k (in %) of one cell on one benchmark, averaged over its finished seeds; None
    if no seed has finished."""
    found = _scores(runs, policy, bench)
    return 100.0 * mean(_mean_at(s)[1] for _, s in found) if found else None


def outcomes(runs: Runs | None, policy: str, bench: str) -> list[stats.Outcomes] | None:
    """Per-prompt accuracy of every finished seed, or None if a result file predates
    per-prompt outcomes."""
    out = []
    for seed, scores in _scores(runs, policy, bench):
        if "correct" not in scores:
            return None
        k = _mean_at(scores)[0]
        out.append(stats.Outcomes(seed, tuple(c / k for c in scores["correct"]),
                                  scores["prompts"]))
    return out


def interval(runs: Runs | None, policy: str, bench: str) -> stats.Estimate | str:
    """One cell's accuracy (%) with its interval, or why it has none."""
    found = outcomes(runs, policy, bench)
    if found is None:
        return "no per-prompt outcomes"
    estimate = stats.accuracy(found)
    return estimate if isinstance(estimate, str) else estimate.scaled(100)


def gap(runs: Runs | None, base: Runs | None, policy: str,
        bench: str) -> stats.Estimate | str:
    """``runs`` minus ``base`` in points, paired over common seeds and prompts, or why no
    paired difference exists."""
    a, b = outcomes(runs, policy, bench), outcomes(base, policy, bench)
    if a is None or b is None:
        return "no per-prompt outcomes"
    estimate = stats.paired_difference(a, b)
    return estimate if isinstance(estimate, str) else estimate.scaled(100)


def _fmt(estimate: stats.Estimate, sign: str = "") -> str:
    return (f"{estimate.mean:{sign}.1f} [{estimate.lo:{sign}.1f}, "
            f"{estimate.hi:{sign}.1f}]")


def _table_cell(runs: Runs | None, base: Runs | None, policy: str, bench: str,
                seeds: int, is_base: bool) -> str:
    value = accuracy(runs, policy, bench)
    if value is None:
        return "--"
    est = interval(runs, policy, bench)
    text = f"{value:.1f}" if isinstance(est, str) else _fmt(est)
    done = len(_scores(runs, policy, bench))
    if done < seeds:
        text += f" ({done} of {seeds} seeds)"
    base_value = accuracy(base, policy, bench)
    if is_base or base_value is None:
        return text
    diff = gap(runs, base, policy, bench)
    return text + (f" ({value - base_value:+.1f})" if isinstance(diff, str)
                   else f" ({_fmt(diff, '+')})")


def precision_table(results: Results, formats: tuple[str, ...], bench: str, policy: str,
                    seeds: int = 1, cells: set[str] | None = None) -> list[str]:
    """Table 1: rows train x rollout precision, one column per FP4 format; with ``cells``,
    only the rows that hold one of them (a preset's cut of the grid)."""
    base = results.get("bf16")
    head = "| Train | Rollout | " + " | ".join(f"FP4 = {FORMAT_LABELS[f]}" for f in formats) + " |"
    lines = [head, "|---|---|" + "---|" * len(formats)]
    for train, rollout in precision_rows():
        is_base = (train, rollout) == ("bf16", "bf16")
        if cells is not None and not any(precision_name(f, train, rollout) in cells
                                         for f in formats):
            continue
        values = [_table_cell(results.get(precision_name(f, train, rollout)), base, policy,
                              bench, seeds, is_base) for f in formats]
        lines.append(f"| {train_label(train)} | {rollout.upper()} | " + " | ".join(values) + " |")
    return lines


def recovery_table(results: Results, cells: list[Cell], benches: list[str], policy: str,
                   seeds: int = 1) -> list[str]:
    """Tables 2/4: rows format x recovery method, one column per benchmark."""
    base = results.get("bf16")
    lines = ["| Format | Recovery | " + " | ".join(benches) + " |",
             "|---|---|" + "---|" * len(benches)]
    for fmt in [None, *dict.fromkeys(c.fmt for c in cells if c.fmt)]:
        group = [c for c in cells if c.fmt == fmt]
        for i, c in enumerate(group):
            label = "BF16" if fmt is None else (FORMAT_LABELS[fmt] if i == 0 else "")
            row = "--" if fmt is None else c.row
            values = [_table_cell(results.get(c.name), base, policy, b, seeds, fmt is None)
                      for b in benches]
            lines.append(f"| {label} | {row} | " + " | ".join(values) + " |")
    return lines


def claim_rows(results: Results, claims: list[Comparison],
               benches: list[str]) -> list[dict[str, Any]]:
    """Every comparison on every benchmark: the paired gap (points, as the rollout
    policy), its interval and the verdict ("not run" / "no interval" where none)."""
    rows = []
    for c in claims:
        for bench in benches:
            a, b = results.get(c.better), results.get(c.worse)
            diff = gap(a, b, CLAIM_POLICY, bench)
            row = {"claim": c.claim, "comparison": c.label, "better": c.better,
                   "worse": c.worse, "benchmark": bench, "paper_gap": c.paper_gap}
            means = accuracy(a, CLAIM_POLICY, bench), accuracy(b, CLAIM_POLICY, bench)
            if isinstance(diff, stats.Estimate):
                row |= {"gap": diff.mean, "lo": diff.lo, "hi": diff.hi, "seeds": diff.seeds,
                        "prompts": diff.prompts, "verdict": stats.verdict(diff)}
            elif means[0] is None or means[1] is None:
                row |= {"verdict": "not run"}
            else:  # both ran, but cannot be paired: the plain difference of their means
                row |= {"gap": means[0] - means[1], "verdict": "no interval", "reason": diff}
            rows.append(row)
    return rows


def claims_table(rows: list[dict[str, Any]]) -> list[str]:
    """The claims as markdown: the paper's gap next to ours, its interval and verdict."""
    lines = ["| claim | comparison | benchmark | paper (3B, GSM8K) | here: paired gap "
             "[95%] | seeds x prompts | verdict |", "|---|---|---|---|---|---|---|"]
    previous = None
    for r in rows:
        claim = "" if r["claim"] == previous else r["claim"]
        previous = r["claim"]
        paper = "--" if r["paper_gap"] is None else f"{r['paper_gap']:+.2f}"
        if "lo" in r:
            here = f"{r['gap']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}]"
            size = f"{r['seeds']} x {r['prompts']}"
            verdict = f"**{r['verdict']}**" if r["verdict"] != "within noise" else r["verdict"]
        else:
            here = "--" if "gap" not in r else f"{r['gap']:+.1f}"
            size = "--"
            verdict = r["verdict"] + (f" ({r['reason']})" if "reason" in r else "")
        lines.append(f"| {claim} | {r['comparison']} | {r['benchmark']} | {paper} | {here} "
                     f"| {size} | {verdict} |")
    tally = Counter(r["verdict"] for r in rows)
    lines += ["", "Verdicts: " + ", ".join(f"{tally[v]} {v}" for v in
                                           (*stats.VERDICTS, "no interval", "not run")
                                           if tally[v]) + "."]
    notes = [NOTES[c] for c in dict.fromkeys(r["claim"] for r in rows) if c in NOTES]
    return [*lines, *(part for note in notes for part in ("", note))]


def method_lines(results: Results, seeds: tuple[int, ...]) -> list[str]:
    """How the intervals and verdicts are computed, and what they cover here."""
    designs = {len({o.prompts for o in found}) == 1 for runs in results.values()
               for bench in _benches(runs)
               if (found := outcomes(runs, CLAIM_POLICY, bench)) and len(found) > 1}
    prompts = ("every seed was scored on the same test prompts, so one draw of prompts "
               "serves all drawn seeds" if designs == {True} else
               "each seed was scored on test prompts of its own, so prompts are drawn "
               "within each drawn seed" if designs == {False} else
               "prompts are shared across seeds where they are the same, drawn within each "
               "seed where not")
    return [
        "## Method", "",
        f"Seeds: {', '.join(map(str, seeds))}. Each accuracy is the mean over the seeds a "
        "cell finished and over the test prompts (greedy Mean@1: a prompt counts 1 if its "
        "answer is right; Mean@k: the share of its k samples that are). Its 95% interval is "
        f"a bootstrap over seeds and prompts: {stats.RESAMPLES} resamples each draw the seeds "
        f"with replacement and the prompts with replacement ({prompts}); the interval runs "
        "from the 2.5th to the 97.5th percentile of the resampled means.",
        "",
        "Every gap (to BF16 in the tables, and each comparison in the claims table) is "
        "paired: the two cells' outcomes are subtracted prompt by prompt at each seed both "
        "finished, and the same bootstrap is applied to the differences, so what the two "
        "runs share (an easy prompt, a lucky data order) cancels. A claim **holds** when its "
        "interval lies entirely on the paper's side of 0, is **reversed** when it lies "
        "entirely on the other side, and is **within noise** when it contains 0. The "
        f"resampling uses a fixed generator seed ({stats.RNG_SEED}), so rebuilding the report "
        "gives the same numbers.",
        "",
        _coverage(len(seeds)) + " With this many comparisons, about one in twenty would "
        "leave 0 by chance where there is no difference.",
        ""]


def _coverage(seeds: int) -> str:
    """What the intervals leave out with this many seeds."""
    if seeds == 1:
        return ("With one seed the intervals cover the choice of test prompts only, not the "
                "seed-to-seed variation of a GRPO run, which on small models can be the "
                "larger of the two.")
    return (f"With {seeds} seeds the seed part of an interval is coarse: a bootstrap over "
            "a handful of seeds tends to make it too narrow.")


def _benches(runs: Runs) -> set[str]:
    return {b for r in runs.values() for b in r.get(CLAIM_POLICY, {})}


def _legend(cell: Cell) -> str:
    if cell.fmt is None:
        return "BF16"
    return f"{FORMAT_LABELS[cell.fmt]} (no recovery)" if cell.row == "--" else cell.row


def reward_band(runs: Runs | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Moving-average training reward per step: the mean over seeds and the band from the
    lowest to the highest seed (the steps every seed has)."""
    curves = [r["rewards"] for r in (runs or {}).values() if r.get("rewards")]
    if not curves:
        return None
    steps = min(map(len, curves))
    window = max(1, steps // 5)
    smooth = np.array([moving_average(c[:steps], window) for c in curves])
    return smooth.mean(0), smooth.min(0), smooth.max(0)


def plot_rewards(results: Results, cells: list[Cell], path: Path, title: str) -> None:
    """Figure 4: mean training reward per step, one panel per FP4 format, with the band
    across seeds."""
    formats = list(dict.fromkeys(c.fmt for c in cells if c.fmt))
    fig, axes = plt.subplots(1, len(formats), figsize=(6 * len(formats), 4.2), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        for c in [x for x in cells if x.fmt in (None, fmt)]:
            band = reward_band(results.get(c.name))
            if band is None:
                continue
            middle, low, high = band
            steps = np.arange(1, len(middle) + 1)
            style = {"color": "black", "ls": "--"} if c.fmt is None else {}
            (line,) = ax.plot(steps, middle, lw=1.6, label=_legend(c), **style)
            if len(results[c.name]) > 1:
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15, lw=0)
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
    done = [r for c in cells for r in results.get(c.name, {}).values()]
    if not done:
        return []
    train = sum(r["train_seconds"] for r in done) / 3600
    evals = sum(r["eval_seconds"] for r in done) / 3600
    return [f"Wall clock of the {len(done)} finished runs: {train:.2f} h training + "
            f"{evals:.2f} h evaluation (torch threads per cell: "
            f"{sorted({r['torch_threads'] for r in done})})."]


def _summary(runs: Runs | None, benches: list[str]) -> dict[str, Any]:
    """A cell's accuracies and intervals for the report's JSON (no per-prompt lists:
    those stay in the cells' result files)."""
    out: dict[str, Any] = {}
    for policy, _ in POLICIES:
        for bench in benches:
            value = accuracy(runs, policy, bench)
            est = interval(runs, policy, bench)
            out.setdefault(policy, {})[bench] = (
                None if value is None else {"mean": value} if isinstance(est, str)
                else {"mean": est.mean, "lo": est.lo, "hi": est.hi, "seeds": est.seeds})
    return out


def _run_json(result: dict[str, Any]) -> dict[str, Any]:
    def strip(scores: dict[str, Any]) -> dict[str, Any]:
        return {b: {k: v for k, v in s.items() if k != "correct"} for b, s in scores.items()}

    return {**{p: strip(result[p]) for p, _ in POLICIES},
            **{k: result[k] for k in ("rewards", "train_seconds", "eval_seconds")}}


def write_report(exp: Experiment, cells: list[Cell], results: Results,
                 command: list[str] | None = None) -> Path:
    """``<output>/<kind>.md``, ``<kind>_rewards.png`` and ``<kind>.json``; returns the .md."""
    out = exp.output
    seeds = exp.run_seeds
    benches = [e.name for e in exp.benchmarks()]
    title = "Train x rollout precision" if exp.kind == "precision" else "Rollout recovery"
    plot = out / f"{exp.kind}_rewards.png"
    plot_rewards(results, cells, plot, title)
    cmd = shlex.join(command if command is not None else ["fp4rl", *sys.argv[1:]])
    done = sum(len(results.get(c.name, {})) for c in cells)
    lines = [f"# {title} ({exp.preset.name} preset)", "", f"Command: `{cmd}`", "",
             f"{exp.preset.description}. Runs finished: {done} of {len(cells) * len(seeds)} "
             f"({len(cells)} cells x {len(seeds)} seeds); '--' marks a cell not run yet.", ""]
    some = next((r for runs in results.values() for r in runs.values()), None)
    if some and some.get("config"):
        cfg = some["config"]
        lines += [f"Model {cfg['model']}, {cfg['run']['steps']} steps, lr "
                  f"{cfg['grpo']['learning_rate']}, G = {cfg['grpo']['num_generations']}, "
                  f"{cfg['grpo']['batch_size']} prompts per step, Mean@"
                  f"{cfg['eval']['mean_at_k']}.", ""]
    lines += method_lines(results, seeds)
    names = {c.name for c in cells}  # a preset's cut of the grid settles its own claims
    claims = [c for c in grid_claims(exp.kind, exp.formats)
              if c.better in names and c.worse in names]
    rows = claim_rows(results, claims, benches)
    lines += ["## The paper's claims (paired, as the rollout policy)", "",
              *claims_table(rows), ""]
    for policy, label in POLICIES:
        lines += [f"## Accuracy (%), {label}", ""]
        if exp.kind == "precision":
            for bench in benches:
                lines += [f"{bench}:", "",
                          *precision_table(results, exp.formats, bench, policy, len(seeds),
                                           names), ""]
        else:
            lines += [*recovery_table(results, cells, benches, policy, len(seeds)), ""]
    band = "; the band spans the lowest to the highest seed" if len(seeds) > 1 else ""
    lines += ["## Training reward (Figure 4)", "",
              f"Mean over seeds of the moving-average training reward{band}.", "",
              f"![rewards]({plot.name})", "", *_cost_lines(results, cells), ""]
    path = out / f"{exp.kind}.md"
    path.write_text("\n".join(lines))
    write_json(out / f"{exp.kind}.json", {
        "kind": exp.kind, "preset": exp.preset.name, "formats": list(exp.formats),
        "benchmarks": benches, "command": cmd, "seeds": list(seeds),
        "method": {"resamples": stats.RESAMPLES, "rng_seed": stats.RNG_SEED,
                   "level": stats.LEVEL, "claims_policy": CLAIM_POLICY},
        "claims": rows,
        "cells": [{"cell": c.name, "format": c.fmt, "row": c.row,
                   "accuracy": _summary(results.get(c.name), benches),
                   "runs": {str(s): _run_json(r) for s, r in results.get(c.name, {}).items()}}
                  for c in cells]})
    return path
