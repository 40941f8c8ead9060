"""Tables in the paper's layout, the paper's claims with verdicts, and the reward curves.

Accuracy is reported twice: scored as the cell's rollout policy (the FP4 policy that
generated the training data, which is what the paper's verl runs validate with) and
scored with the trained master weights unquantized. Each number is the mean over the
seeds that finished, with a 95% seed-t interval (Student's t over the seeds, widened by
the prompt sampling the seeds share: :mod:`fp4rl.experiments.stats`), and its gap to the
BF16 cell as a paired difference (the seeds both have, the same prompts) with its own
interval; the claims table does the same for every comparison the paper draws
(:mod:`fp4rl.experiments.claims`) and gives each a verdict from that interval. The
two-way bootstrap stays beside it as a secondary column, labelled as such: with a handful
of seeds it is too narrow to judge by. A cell shows how many seeds it has where that is
fewer than the grid's, and a cell or claim with no run yet is marked, never an error. A
result file written before per-prompt outcomes were stored still loads: its cells show
means and plain gaps, without intervals.
"""

from __future__ import annotations

import shlex
import sys
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Literal, NotRequired, Required, TypedDict, cast

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fp4rl.experiments import stats
from fp4rl.experiments.claims import NOTES, Comparison, format_label, grid_claims
from fp4rl.experiments.grid import Cell, precision_name, precision_rows, train_label
from fp4rl.experiments.runner import CellResult, Experiment, Scores
from fp4rl.paths import write_json
from fp4rl.rl.report import moving_average
from fp4rl.rollout.mismatch import NEMO_RL_LIMITS

#: cell name -> seed -> that run's result.json
Results = dict[str, dict[int, CellResult]]
Runs = dict[int, CellResult]
#: the policies a run is scored as: the keys of its result that hold scores
Policy = Literal["rollout", "bf16", "initial"]
SCORED_AS: tuple[tuple[Policy, str], ...] = (
    ("rollout", "scored as the cell's rollout policy"),
    ("bf16", "scored with the trained weights unquantized"),
    ("initial", "before training: the starting model as the cell's rollout policy"))
CLAIM_POLICY: Policy = "rollout"
#: the header of the bootstrap's column, next to each seed-t column
SECONDARY = "bootstrap [95%] (secondary)"


def _scores(runs: Runs | None, policy: Policy, bench: str) -> list[tuple[int, Scores]]:
    """(seed, scores) of every finished run that scored ``bench`` under ``policy``."""
    return [(seed, r[policy][bench]) for seed, r in sorted((runs or {}).items())
            if bench in r.get(policy, {})]


def _mean_at(scores: Scores) -> tuple[int, float]:
    key = next(k for k in scores if k.startswith("mean@"))
    return int(key.removeprefix("mean@")), scores[key]


def accuracy(runs: Runs | None, policy: Policy, bench: str) -> float | None:
    """Mean@k (in %) of one cell on one benchmark, averaged over its finished seeds; None
    if no seed has finished."""
    found = _scores(runs, policy, bench)
    return 100.0 * mean(_mean_at(s)[1] for _, s in found) if found else None


def outcomes(runs: Runs | None, policy: Policy, bench: str) -> list[stats.Outcomes] | None:
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


def interval(runs: Runs | None, policy: Policy, bench: str,
             method: stats.Interval = stats.seed_t) -> stats.Estimate | str:
    """One cell's accuracy (%) with its interval (by default the one verdicts use), or
    why it has none."""
    found = outcomes(runs, policy, bench)
    if found is None:
        return "no per-prompt outcomes"
    estimate = stats.accuracy(found, method)
    return estimate if isinstance(estimate, str) else estimate.scaled(100)


def gap(runs: Runs | None, base: Runs | None, policy: Policy, bench: str,
        method: stats.Interval = stats.seed_t) -> stats.Estimate | str:
    """``runs`` minus ``base`` in points, paired over the seeds both have and the same
    prompts, or why no paired difference exists."""
    a, b = outcomes(runs, policy, bench), outcomes(base, policy, bench)
    if a is None or b is None:
        return "no per-prompt outcomes"
    estimate = stats.paired_difference(a, b, method)
    return estimate if isinstance(estimate, str) else estimate.scaled(100)


def _fmt(estimate: stats.Estimate, sign: str = "") -> str:
    return (f"{estimate.mean:{sign}.1f} [{estimate.lo:{sign}.1f}, "
            f"{estimate.hi:{sign}.1f}]")


def _bounds(estimate: stats.Estimate, sign: str = "") -> str:
    return f"[{estimate.lo:{sign}.1f}, {estimate.hi:{sign}.1f}]"


def _table_cell(runs: Runs | None, base: Runs | None, policy: Policy, bench: str,
                seeds: int, is_base: bool) -> tuple[str, str]:
    """A cell's accuracy with its seed-t interval, its seed count where short of the
    grid's, and its paired gap to BF16; and the same two intervals by the bootstrap (the
    secondary column), "--" where there is none."""
    value = accuracy(runs, policy, bench)
    if value is None:
        return "--", "--"
    est, boot = interval(runs, policy, bench), interval(runs, policy, bench, stats.bootstrap)
    text = f"{value:.1f}" if isinstance(est, str) else _fmt(est)
    second = "--" if isinstance(boot, str) else _bounds(boot)
    done = len(_scores(runs, policy, bench))
    if done < seeds:
        text += f" ({done} of {seeds} seeds)"
    base_value = accuracy(base, policy, bench)
    if is_base or base_value is None:
        return text, second
    diff = gap(runs, base, policy, bench)
    if isinstance(diff, str):
        return text + f" ({value - base_value:+.1f})", second
    # the same cells as ``diff``, which has an estimate: so has the bootstrap
    boot_diff = cast(stats.Estimate, gap(runs, base, policy, bench, stats.bootstrap))
    return text + f" ({_fmt(diff, '+')})", f"{second} ({_bounds(boot_diff, '+')})"


def precision_table(results: Results, formats: tuple[str, ...], bench: str, policy: Policy,
                    seeds: int = 1, cells: set[str] | None = None) -> list[str]:
    """Table 1: rows train x rollout precision, one column per FP4 format; with ``cells``,
    only the rows that hold one of them (a plan's cut of the grid)."""
    base = results.get("bf16")
    head = "| Train | Rollout | " + " | ".join(
        f"FP4 = {format_label(f)} | {format_label(f)}: {SECONDARY}" for f in formats) + " |"
    lines = [head, "|---|---|" + "---|---|" * len(formats)]
    for train, rollout in precision_rows():
        is_base = (train, rollout) == ("bf16", "bf16")
        if cells is not None and not any(precision_name(f, train, rollout) in cells
                                         for f in formats):
            continue
        values = [part for f in formats
                  for part in _table_cell(results.get(precision_name(f, train, rollout)),
                                          base, policy, bench, seeds, is_base)]
        lines.append(f"| {train_label(train)} | {rollout.upper()} | " + " | ".join(values) + " |")
    return lines


def recovery_table(results: Results, cells: list[Cell], benches: list[str], policy: Policy,
                   seeds: int = 1, rows: str = "Recovery") -> list[str]:
    """Tables 2/4: rows format x recovery method (or the field's recipes, ``rows``), one
    column per benchmark."""
    base = results.get("bf16")
    lines = [f"| Format | {rows} | " + " | ".join(f"{b} | {b}: {SECONDARY}" for b in benches)
             + " |", "|---|---|" + "---|---|" * len(benches)]
    for fmt in [None, *dict.fromkeys(c.fmt for c in cells if c.fmt)]:
        group = [c for c in cells if c.fmt == fmt]
        for i, c in enumerate(group):
            label = "BF16" if fmt is None else (format_label(fmt) if i == 0 else "")
            row = "--" if fmt is None else c.row
            values = [part for b in benches
                      for part in _table_cell(results.get(c.name), base, policy, b, seeds,
                                              fmt is None)]
            lines.append(f"| {label} | {row} | " + " | ".join(values) + " |")
    return lines


class ClaimCase(TypedDict):
    """One comparison on one benchmark, as the paper states it: before any run is read."""

    claim: str
    comparison: str
    better: str
    worse: str
    benchmark: str
    paper_gap: float | None
    paper: tuple[float, float] | None  # the paper's accuracy (%) of better and of worse


class ClaimRow(ClaimCase):
    """A row of the claims table (and of the report's JSON): the case, what the runs say
    of it and its verdict."""

    gap: NotRequired[float]  # points; paired, or the plain difference with "no interval"
    lo: NotRequired[float]  # the seed-t interval and what it pairs, where there is one
    hi: NotRequired[float]
    seeds: NotRequired[int]
    prompts: NotRequired[int]
    verdict: str
    bootstrap_lo: NotRequired[float]
    bootstrap_hi: NotRequired[float]
    reason: NotRequired[str]  # why there is no interval


def claim_rows(results: Results, claims: list[Comparison],
               benches: list[str]) -> list[ClaimRow]:
    """Every comparison on every benchmark: the paired gap (points, as the rollout
    policy), its seed-t interval and the verdict it gives ("not run" / "no interval"
    where none), the bootstrap's interval beside it, and the paper's figures."""
    rows: list[ClaimRow] = []
    for c in claims:
        for bench in benches:
            a, b = results.get(c.better), results.get(c.worse)
            diff = gap(a, b, CLAIM_POLICY, bench)
            case: ClaimCase = {"claim": c.claim, "comparison": c.label, "better": c.better,
                               "worse": c.worse, "benchmark": bench, "paper_gap": c.paper_gap,
                               "paper": c.paper_figures}
            means = accuracy(a, CLAIM_POLICY, bench), accuracy(b, CLAIM_POLICY, bench)
            if isinstance(diff, stats.Estimate):
                # the same cells as ``diff``, which has an estimate: so has the bootstrap
                boot = cast(stats.Estimate, gap(a, b, CLAIM_POLICY, bench, stats.bootstrap))
                rows.append({**case, "gap": diff.mean, "lo": diff.lo, "hi": diff.hi,
                             "seeds": diff.seeds, "prompts": diff.prompts,
                             "verdict": stats.verdict(diff),
                             "bootstrap_lo": boot.lo, "bootstrap_hi": boot.hi})
            elif means[0] is None or means[1] is None:
                rows.append({**case, "verdict": "not run"})
            else:  # both ran, but cannot be paired: the plain difference of their means
                rows.append({**case, "gap": means[0] - means[1], "verdict": "no interval",
                             "reason": diff})
    return rows


def claims_table(rows: list[ClaimRow]) -> list[str]:
    """The claims as markdown: the paper's figures next to ours, the seed-t interval, the
    seeds it pairs, the verdict, and the bootstrap's interval as a secondary column."""
    lines = ["| claim | comparison | benchmark | paper (3B, GSM8K): better vs worse (gap) | "
             "here: paired gap [95% seed-t] | seeds x prompts | verdict | "
             f"{SECONDARY} |", "|---|---|---|---|---|---|---|---|"]
    previous = None
    for r in rows:
        claim = "" if r["claim"] == previous else r["claim"]
        previous = r["claim"]
        paper = ("--" if r["paper"] is None else
                 f"{r['paper'][0]:.2f} vs {r['paper'][1]:.2f} ({r['paper_gap']:+.2f})")
        if "lo" in r:
            here = f"{r['gap']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}]"
            size = f"{r['seeds']} x {r['prompts']}" + (" (prompts only)" if r["seeds"] == 1
                                                       else "")
            verdict = f"**{r['verdict']}**" if r["verdict"] != "within noise" else r["verdict"]
            boot = f"[{r['bootstrap_lo']:+.1f}, {r['bootstrap_hi']:+.1f}]"
        else:
            here = "--" if "gap" not in r else f"{r['gap']:+.1f}"
            size = boot = "--"
            verdict = r["verdict"] + (f" ({r['reason']})" if "reason" in r else "")
        lines.append(f"| {claim} | {r['comparison']} | {r['benchmark']} | {paper} | {here} "
                     f"| {size} | {verdict} | {boot} |")
    tally = Counter(r["verdict"] for r in rows)
    lines += ["", "Verdicts: " + ", ".join(f"{tally[v]} {v}" for v in
                                           (*stats.VERDICTS, "no interval", "not run")
                                           if tally[v]) + "."]
    notes = [NOTES[c] for c in dict.fromkeys(r["claim"] for r in rows) if c in NOTES]
    return [*lines, *(part for note in notes for part in ("", note))]


WIDENED = ("the interval is widened by the prompt-sampling variance they share, which "
           "their spread cannot show: (MS prompts - MS residual) / (seeds x prompts) from a "
           "two-way analysis of variance, kept at 0 or above, scaled by its own t quantile "
           "(prompts - 1 degrees of freedom) and added in quadrature")
OWN_PROMPTS = "the spread of the per-seed means already holds the prompt sampling"


def method_lines(results: Results, seeds: tuple[int, ...]) -> list[str]:
    """How the intervals and verdicts are computed, and what they cover here."""
    designs = {len({o.prompts for o in found}) == 1 for runs in results.values()
               for bench in _benches(runs)
               if (found := outcomes(runs, CLAIM_POLICY, bench)) and len(found) > 1}
    shared, drawn = (
        (f"Every seed was scored on the same test prompts, so {WIDENED}.",
         "one draw of prompts serves all drawn seeds") if designs == {True} else
        (f"Each seed was scored on test prompts of its own, so {OWN_PROMPTS}.",
         "prompts are drawn within each drawn seed") if designs == {False} else
        (f"Where seeds were scored on the same test prompts, {WIDENED}; where each seed had "
         f"prompts of its own, {OWN_PROMPTS}.",
         "prompts are shared across seeds where they are the same, drawn within each seed "
         "where not"))
    return [
        "## Method", "",
        f"Seeds: {', '.join(map(str, seeds))}; a cell with fewer shows how many it has. Each "
        "accuracy is the mean over the seeds a cell finished and over the test prompts "
        "(greedy Mean@1: a prompt counts 1 if its answer is right; Mean@k: the share of its "
        "k samples that are). Its 95% interval (seed-t) is Student's t over the seeds: the "
        "spread of the per-seed means over their number, seeds - 1 degrees of freedom. "
        f"{shared} With one seed the interval covers the choice of prompts only (a t "
        "interval over the per-prompt values), marked \"prompts only\".",
        "",
        "Every gap (to BF16 in the tables, and each comparison in the claims table) is "
        "paired: the two cells' outcomes are subtracted prompt by prompt at each seed both "
        "finished (a cell with 3 seeds is compared with one of 5 on those 3, never on "
        "unequal sets), and the same interval is taken of the differences, so what the two "
        "runs share (an easy prompt, a lucky data order) cancels. A claim **holds** when its "
        "interval lies entirely on the paper's side of 0, is **reversed** when it lies "
        "entirely on the other side, and is **within noise** when it contains 0.",
        "",
        f"The columns marked \"{SECONDARY}\" give the two-way bootstrap the verdicts used "
        f"before: {stats.RESAMPLES} resamples each draw the seeds with replacement and the "
        f"prompts with replacement ({drawn}); the interval runs from the 2.5th to the "
        "97.5th percentile of the resampled means, with a fixed generator seed "
        f"({stats.RNG_SEED}). It is shown for comparison only: resampling a handful of "
        "seeds understates their spread, and in simulated grids of 300 prompts with a "
        "seed-to-seed spread of 10 points it covered the true gap about 81% (3 seeds) and "
        "87% (5 seeds) of the time, where the seed-t interval covered 95% "
        "(`tests/experiments/test_stats.py`).",
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
    quantile = float(stats.student_t_quantile((1 + stats.LEVEL) / 2, seeds - 1))
    return (f"With {seeds} seeds the t quantile is wide ({quantile:.2f} standard errors for "
            "95%, against 1.96 with many): few seeds buy little certainty, and the "
            "intervals say so.")


def _benches(runs: Runs) -> set[str]:
    return {b for r in runs.values() for b in r.get(CLAIM_POLICY, {})}


def _legend(cell: Cell) -> str:
    if cell.fmt is None:
        return "BF16"
    return f"{format_label(cell.fmt)} (no recovery)" if cell.row == "--" else cell.row


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
        ax.set_title(f"{title}: {format_label(fmt)}", fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean training reward (moving average)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TITLES = {"precision": "Train x rollout precision", "recovery": "Rollout recovery",
          "field": "The field's FP4 RL recipes beside the paper's"}


def mismatch_table(results: Results, cells: list[Cell]) -> list[str]:
    """Each cell's NeMo-RL mismatch metrics, means over its steps and seeds, against
    NeMo-RL's CI limits (a cell whose runs logged none is left out)."""
    rows = []
    for cell in cells:
        runs = [r["mismatch"] for r in results.get(cell.name, {}).values() if r.get("mismatch")]
        if not runs:
            continue
        means = {k: mean(r[k] for r in runs if k in r) for k in NEMO_RL_LIMITS
                 if any(k in r for r in runs)}
        values = [f"{means[k]:.4g} {'ok' if means[k] < limit else 'OVER'}" if k in means
                  else "--" for k, limit in NEMO_RL_LIMITS.items()]
        rows.append(f"| {cell.name} | {len(runs)} | {' | '.join(values)} |")
    if not rows:
        return []
    heads = " | ".join(f"{k.split('/')[-1]} (< {v:g})" for k, v in NEMO_RL_LIMITS.items())
    return ["## Rollout/trainer mismatch (NeMo-RL's metrics and CI limits)", "",
            "Means over each run's steps and over the seeds; OVER: at or above the limit "
            "NeMo-RL's CI gates its NVFP4 recipe on.", "",
            f"| cell | seeds | {heads} |", "| --- | --- |" + " --- |" * len(NEMO_RL_LIMITS),
            *rows, ""]


def _cost_lines(results: Results, cells: list[Cell]) -> list[str]:
    done = [r for c in cells for r in results.get(c.name, {}).values()]
    if not done:
        return []
    train = sum(r["train_seconds"] for r in done) / 3600
    evals = sum(r["eval_seconds"] for r in done) / 3600
    return [f"Wall clock of the {len(done)} finished runs: {train:.2f} h training + "
            f"{evals:.2f} h evaluation (torch threads per cell: "
            f"{sorted({r['torch_threads'] for r in done})})."]


class AccuracySummary(TypedDict, total=False):
    """A cell's accuracy (%) on one benchmark in the report's JSON: the mean over its seeds,
    and its intervals where it has per-prompt outcomes."""

    mean: Required[float]
    lo: float
    hi: float
    seeds: int
    bootstrap_lo: float
    bootstrap_hi: float


class RunSummary(TypedDict):
    """A run in the report's JSON: its scores less the per-prompt lists, its reward curve,
    its times and its mismatch metrics."""

    rollout: dict[str, Scores]
    bf16: dict[str, Scores]
    initial: dict[str, Scores]
    rewards: list[float]
    train_seconds: float
    eval_seconds: float
    mismatch: dict[str, float]


def _summary(runs: Runs | None, benches: list[str]
             ) -> dict[Policy, dict[str, AccuracySummary | None]]:
    """A cell's accuracies and intervals for the report's JSON (no per-prompt lists:
    those stay in the cells' result files): policy -> benchmark -> accuracy, None where
    no seed has finished."""
    out: dict[Policy, dict[str, AccuracySummary | None]] = {}
    for policy, _ in SCORED_AS:
        for bench in benches:
            value = accuracy(runs, policy, bench)
            est = interval(runs, policy, bench)
            # read only where ``est`` is an estimate, and then so is ``boot`` (same cells)
            boot = cast(stats.Estimate, interval(runs, policy, bench, stats.bootstrap))
            out.setdefault(policy, {})[bench] = (
                None if value is None else {"mean": value} if isinstance(est, str)
                else {"mean": est.mean, "lo": est.lo, "hi": est.hi, "seeds": est.seeds,
                      "bootstrap_lo": boot.lo, "bootstrap_hi": boot.hi})
    return out


def _run_json(result: CellResult) -> RunSummary:
    def strip(scores: dict[str, Scores]) -> dict[str, Scores]:
        return {b: {k: v for k, v in s.items() if k != "correct"} for b, s in scores.items()}

    # the policies in SCORED_AS's order
    return {"rollout": strip(result["rollout"]), "bf16": strip(result["bf16"]),
            "initial": strip(result["initial"]), "rewards": result["rewards"],
            "train_seconds": result["train_seconds"], "eval_seconds": result["eval_seconds"],
            "mismatch": result.get("mismatch", {})}


def write_report(exp: Experiment, cells: list[Cell], results: Results,
                 command: list[str] | None = None) -> Path:
    """``<output>/<kind>.md``, ``<kind>_rewards.png`` and ``<kind>.json``; returns the .md."""
    out = exp.output
    seeds = exp.run_seeds
    benches = [e.name for e in exp.benchmarks()]
    title = TITLES[exp.kind]
    plot = out / f"{exp.kind}_rewards.png"
    plot_rewards(results, cells, plot, title)
    cmd = shlex.join(command if command is not None else ["fp4rl", *sys.argv[1:]])
    done = sum(len(results.get(c.name, {})) for c in cells)
    lines = [f"# {title} ({exp.plan.name} plan)", "", f"Command: `{cmd}`", "",
             f"{exp.plan.description}. Runs finished: {done} of {len(cells) * len(seeds)} "
             f"({len(cells)} cells x {len(seeds)} seeds); '--' marks a cell not run yet.", ""]
    some = next((r for runs in results.values() for r in runs.values()), None)
    if some and some.get("config"):
        cfg = some["config"]
        lines += [f"Model {cfg['model']}, {cfg['run']['steps']} steps, lr "
                  f"{cfg['grpo']['learning_rate']}, G = {cfg['grpo']['num_generations']}, "
                  f"{cfg['grpo']['batch_size']} prompts per step, Mean@"
                  f"{cfg['eval']['mean_at_k']}.", ""]
    lines += method_lines(results, seeds)
    names = {c.name for c in cells}  # a plan's cut of the grid settles its own claims
    claims = [c for c in grid_claims(exp.kind, exp.formats)
              if c.better in names and c.worse in names]
    rows = claim_rows(results, claims, benches)
    whose = "The comparisons" if exp.kind == "field" else "The paper's claims"  # it predates them
    lines += [f"## {whose} (paired, as the rollout policy)", "",
              *claims_table(rows), ""]
    for policy, label in SCORED_AS:
        lines += [f"## Accuracy (%), {label}", ""]
        if exp.kind == "precision":
            for bench in benches:
                lines += [f"{bench}:", "",
                          *precision_table(results, exp.formats, bench, policy, len(seeds),
                                           names), ""]
        else:
            head = "Recipe" if exp.kind == "field" else "Recovery"
            lines += [*recovery_table(results, cells, benches, policy, len(seeds), head), ""]
    band = "; the band spans the lowest to the highest seed" if len(seeds) > 1 else ""
    lines += ["## Training reward (Figure 4)", "",
              f"Mean over seeds of the moving-average training reward{band}.", "",
              f"![rewards]({plot.name})", "", *mismatch_table(results, cells),
              *_cost_lines(results, cells), ""]
    path = out / f"{exp.kind}.md"
    path.write_text("\n".join(lines))
    write_json(out / f"{exp.kind}.json", {
        "kind": exp.kind, "plan": exp.plan.name, "formats": list(exp.formats),
        "benchmarks": benches, "command": cmd, "seeds": list(seeds),
        "method": {"interval": "seed-t", "level": stats.LEVEL,
                   "secondary": {"interval": "bootstrap", "resamples": stats.RESAMPLES,
                                 "rng_seed": stats.RNG_SEED},
                   "claims_policy": CLAIM_POLICY},
        "claims": rows,
        "cells": [{"cell": c.name, "format": c.fmt, "row": c.row,
                   "accuracy": _summary(results.get(c.name), benches),
                   "runs": {str(s): _run_json(r) for s, r in results.get(c.name, {}).items()}}
                  for c in cells]})
    return path
