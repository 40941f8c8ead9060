"""Curves and a short report of a training run, from its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fp4rl.rl.rundir import Metrics, RunDir
from fp4rl.rollout.mismatch import NEMO_RL_LIMITS, nemo_rl_means, nemo_rl_verdict

PANELS = (
    ("reward_mean", "mean reward"),
    ("loss", "GRPO loss"),
    ("completions/mean_length", "response length"),
    ("clip_ratio/region_mean", "clip fraction"),
    ("sampling/sampling_logp_difference/mean", "|log pi_old - log mu| (mean)"),
    ("sampling/importance_sampling_ratio/mean", "truncated IS weight (mean)"),
    ("mismatch/token_mult_prob_error", "NeMo-RL token_mult_prob_error"),
    ("mismatch/gen_kl_error", "NeMo-RL gen_kl_error"),
)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start): a noisy per-step
    reward made readable without shifting it in time."""
    return [mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def plot_curves(rows: list[Metrics], path: Path, title: str = "") -> None:
    fig, axes = plt.subplots(2, 4, figsize=(16, 6))
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes.flat, PANELS, strict=True):
        values = [r.get(key, float("nan")) for r in rows]
        ax.plot(steps, values, lw=1, color="#9ecae1" if key == "reward_mean" else "#1f77b4")
        if key == "reward_mean" and len(values) >= 5:
            ax.plot(steps, moving_average(values, 5), lw=2, color="#1f77b4",
                    label="5-step mean")
            ax.legend(fontsize=8)
        if key in NEMO_RL_LIMITS:  # NeMo-RL's CI limit, dashed
            ax.axhline(NEMO_RL_LIMITS[key], ls="--", lw=1, color="#d62728", label="NeMo-RL limit")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_run_report(run_dir: str | Path) -> Path:
    """``curves.png`` of the run's metrics; returns its path."""
    run = Path(run_dir)
    rows = RunDir(run).read_metrics()
    path = run / "curves.png"
    plot_curves(rows, path, title=str(run))
    return path


def mismatch_line(run_dir: str | Path) -> str:
    """The run's NeMo-RL mismatch metrics (means over its steps) against NeMo-RL's CI
    limits, or "" where no step logged them (or the run kept no metrics)."""
    run = RunDir(Path(run_dir))
    if not run.metrics_file.is_file():
        return ""
    means = nemo_rl_means(run.read_metrics())
    return f"rollout/trainer mismatch over the run: {nemo_rl_verdict(means)}" if means else ""
