"""Figures for diagnostics, fidelity and training runs (matplotlib, PNG, no display)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from fp4rl.analysis.diagnose import LayerDiagnosis
from fp4rl.analysis.gradients import GEMMS, LayerGradients
from fp4rl.formats import quantize

if TYPE_CHECKING:  # fidelity imports the training stack; the figures need only its rows
    from fp4rl.analysis.fidelity import FidelityRow

COLORS = {"bf16": "#555555", "hif4": "#1f77b4", "mxfp4": "#d62728", "nvfp4": "#2ca02c",
          "mxfp8_e4m3": "#9467bd"}
_BLOCK = re.compile(r"layers\.(\d+)\.(\w+)\.(\w+)$")


def _parse(name: str) -> tuple[int, str]:
    match = _BLOCK.search(name)
    return (int(match.group(1)), match.group(3)) if match else (0, name)


def per_layer_type(layers: list[LayerDiagnosis], series: Sequence[str],
                   value: Callable[[LayerDiagnosis, str], float], ylabel: str, title: str,
                   path: Path) -> None:
    """One panel per projection type (q, k, v, o, gate, up, down), x = transformer block."""
    kinds = list(dict.fromkeys(_parse(d.name)[1] for d in layers))
    cols = min(4, len(kinds))
    rows = -(-len(kinds) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.6 * rows), squeeze=False,
                             sharey=True)
    for ax, kind in zip(axes.flat, kinds, strict=False):
        chosen = sorted((d for d in layers if _parse(d.name)[1] == kind),
                        key=lambda d: _parse(d.name)[0])
        blocks = [_parse(d.name)[0] for d in chosen]
        for s in series:
            ax.plot(blocks, [100 * value(d, s) for d in chosen], marker="o", ms=2.5, lw=1.2,
                    color=COLORS.get(s), label=s)
        ax.set_title(kind, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(kinds):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    for ax in axes[-1, :]:
        ax.set_xlabel("transformer block")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gemm_sqnr(layers: Sequence[LayerGradients], schemes: Sequence[str], title: str,
                   path: Path) -> None:
    """SQNR (dB) of every training GEMM against its unquantized result: one heatmap per
    backward scheme and GEMM, projection type x transformer block, one colour scale (an
    exact GEMM, infinite SQNR, takes the top colour)."""
    kinds = list(dict.fromkeys(_parse(d.name)[1] for d in layers))
    blocks = sorted({_parse(d.name)[0] for d in layers})
    grids = {(s, g): np.full((len(kinds), len(blocks)), np.nan) for s in schemes for g in GEMMS}
    for d in layers:
        block, kind = _parse(d.name)
        for s in schemes:
            for g in GEMMS:
                grids[s, g][kinds.index(kind), blocks.index(block)] = d.gemm_sqnr[s][g]
    finite = np.concatenate([v[np.isfinite(v)] for v in grids.values()])
    low, high = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    panel = max(3.0, 0.16 * len(blocks))
    fig, axes = plt.subplots(len(schemes), len(GEMMS), squeeze=False, sharex=True, sharey=True,
                             figsize=(1.5 + panel * len(GEMMS),
                                      1.2 + (0.5 + 0.22 * len(kinds)) * len(schemes)))
    for (s, g), ax in zip(grids, axes.flat, strict=True):
        grid = np.where(np.isposinf(grids[s, g]), high, grids[s, g])
        img = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=low, vmax=high,
                        interpolation="nearest")
        ax.set_title(f"{g}, {s}: median {np.nanmedian(grids[s, g]):.1f} dB", fontsize=9)
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ticks = range(0, len(blocks), max(1, len(blocks) // 8))
    for ax in axes[-1, :]:
        ax.set_xticks(ticks, [str(blocks[i]) for i in ticks])
        ax.set_xlabel("transformer block")
    fig.colorbar(img, ax=axes, label="SQNR vs unquantized GEMM (dB)", shrink=0.9)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_sparsify_error(layers: list[LayerDiagnosis], formats: Sequence[str],
                        path: Path) -> None:
    """Mean RMSE of 2:4-sparsifying Q(X) versus Q(X - Q(X)), per projection type."""
    kinds = list(dict.fromkeys(_parse(d.name)[1] for d in layers))
    fig, axes = plt.subplots(1, len(formats), figsize=(4.5 * len(formats), 3), squeeze=False)
    width = 0.38
    for ax, fmt in zip(axes[0], formats, strict=True):
        for offset, part, color in ((-width / 2, "qx", "#999999"), (width / 2, "residual",
                                                                     COLORS.get(fmt))):
            means = [_mean(d.sparsify_rmse[fmt][part] for d in layers
                           if _parse(d.name)[1] == k) for k in kinds]
            ax.bar([i + offset for i in range(len(kinds))], means, width, color=color,
                   label="S(Q(X))" if part == "qx" else "S(Q(X - Q(X)))")
        ax.set_xticks(range(len(kinds)), kinds, rotation=30, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{fmt}: RMSE of 2:4 sparsification", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heatmaps(x: torch.Tensor, fmt: str, name: str, path: Path, tokens: int = 48,
                  channels: int = 128) -> None:
    """|Q(X)| and |Q(X - Q(X))| of one layer's input, log colour scale (paper's Fig. 5)."""
    x = x[:tokens, :channels]
    qx = quantize(x, fmt)
    panels = {"|X|": x, f"|Q(X)| ({fmt})": qx, "|Q(X - Q(X))|": quantize(x - qx, fmt)}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    floor = x.abs()[x != 0].min().item() if (x != 0).any() else 1e-8
    vmax = x.abs().max().item()
    for ax, (title, t) in zip(axes, panels.items(), strict=True):
        img = ax.imshow(t.abs().clamp_min(floor).log10().numpy(), aspect="auto",
                        cmap="magma", vmin=torch.tensor(floor).log10().item(),
                        vmax=torch.tensor(vmax).log10().item())
        zeros = (t == 0).float().mean().item()
        ax.set_title(f"{title}: {zeros:.0%} zeros", fontsize=9)
        ax.set_xlabel("input channel")
    axes[0].set_ylabel("token")
    fig.colorbar(img, ax=axes, label="log10 magnitude", shrink=0.9)
    fig.suptitle(name, fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_fidelity(rows: Sequence[FidelityRow], path: Path) -> None:
    """KL to the unquantized policy and greedy accuracy, one bar per method."""
    names = [r.method for r in rows]
    colors = [COLORS.get(n.split("+")[0], "#777777") for n in names]
    fig, (ax_kl, ax_acc) = plt.subplots(2, 1, figsize=(max(6, 0.55 * len(rows)), 6),
                                        sharex=True)
    ax_kl.bar(names, [r.kl for r in rows], color=colors)
    ax_kl.set_ylabel("per-token KL to unquantized")
    ax_acc.bar(names, [100 * r.accuracy for r in rows], color=colors)
    ax_acc.set_ylabel("greedy accuracy %")
    ax_acc.tick_params(axis="x", rotation=60, labelsize=8)
    for ax in (ax_kl, ax_acc):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else float("nan")
