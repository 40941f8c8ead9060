"""``fp4rl demo``: what 4-bit formats do to the embedded model, end to end on a CPU.

Loads the embedded default model, runs a few built-in math prompts, and measures the
paper's zero collapse on the inputs of every ``mlp.down_proj`` and the weight error of
each format; writes a markdown report and a plot to the run directory.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import mean

import torch
from rich.console import Console
from rich.table import Table

from fp4rl.analysis.activations import block_linears, capture_linear_inputs, zero_fractions
from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
from fp4rl.formats import quantize

FORMATS = ("bf16", "hif4", "mxfp4", "nvfp4")


def sqnr_db(x: torch.Tensor, fmt: str) -> float:
    """Signal-to-quantization-noise ratio of ``fmt`` on ``x`` (quantized along in_features)."""
    err = (quantize(x, fmt) - x).pow(2).sum()
    return (10 * torch.log10(x.pow(2).sum() / err.clamp_min(1e-30))).item()


def run_demo(console: Console, model: str = "smollm2-135m", output: str = "runs/demo") -> int:
    from fp4rl.models import load_model

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with console.status(f"loading {model} (first run converts the GGUF file, ~30 s)"):
        net, tok = load_model(model)
    console.print(f"loaded {model} in {time.perf_counter() - start:.1f} s")
    ids = encode_prompts(tok, BUILTIN_PROMPTS)
    with console.status("capturing mlp.down_proj inputs"):
        acts = capture_linear_inputs(net, ids, r"mlp\.down_proj$")
    zeros = zero_fractions(acts, FORMATS)
    weights = {n: m.weight.detach() for n, m in block_linears(net).items()}
    with console.status("quantizing every block weight in every format"):
        weight_sqnr = {f: mean(sqnr_db(w, f) for w in weights.values()) for f in FORMATS[1:]}
    _print_tables(console, zeros, weight_sqnr)
    _write_report(out, model, zeros, weight_sqnr)
    console.print(f"report: {out / 'report.md'}  plot: {out / 'zero_collapse.png'}")
    return 0


def _print_tables(console: Console, zeros: dict[str, dict[str, float]],
                  weight_sqnr: dict[str, float]) -> None:
    table = Table(title="zero collapse: share of mlp.down_proj inputs that are exactly 0")
    table.add_column("layer")
    for fmt in FORMATS:
        table.add_column(fmt, justify="right")
    names = list(zeros)
    for name in [*names[:3], names[len(names) // 2], *names[-2:]]:
        table.add_row(name.split(".")[2], *(f"{zeros[name][f]:.1%}" for f in FORMATS))
    table.add_row("mean", *(f"{mean(z[f] for z in zeros.values()):.1%}" for f in FORMATS))
    console.print(table)
    sq = Table(title="weight quantization (all block linears), mean SQNR")
    for fmt in weight_sqnr:
        sq.add_column(fmt, justify="right")
    sq.add_row(*(f"{v:.1f} dB" for v in weight_sqnr.values()))
    console.print(sq)


def _write_report(out: Path, model: str, zeros: dict[str, dict[str, float]],
                  weight_sqnr: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = range(len(zeros))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for fmt in FORMATS:
        ax.plot(layers, [100 * z[fmt] for z in zeros.values()], marker="o", ms=3, label=fmt)
    ax.set(xlabel="transformer block", ylabel="% exactly zero",
           title=f"{model}: mlp.down_proj inputs after quantization")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "zero_collapse.png", dpi=120)
    plt.close(fig)
    lines = [f"# fp4rl demo: {model}", "", "![zero collapse](zero_collapse.png)", "",
             "| layer | " + " | ".join(FORMATS) + " |", "|---" * (len(FORMATS) + 1) + "|"]
    for name, z in zeros.items():
        lines.append(f"| {name} | " + " | ".join(f"{z[f]:.1%}" for f in FORMATS) + " |")
    lines += ["", "Mean weight SQNR: " + ", ".join(f"{f} {v:.1f} dB"
                                                   for f, v in weight_sqnr.items()), ""]
    (out / "report.md").write_text("\n".join(lines))
