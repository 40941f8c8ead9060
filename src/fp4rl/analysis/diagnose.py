"""Per-layer diagnosis of what FP4 does to rollout activations (the paper's Figs. 2, 3, 5).

For every linear layer inside the transformer blocks, on the inputs it sees for a set
of prompts, quantized along the reduction axis:

- ``zero_frac``: share of values exactly zero, unquantized ("bf16") and per format;
- ``outlier_block_frac``: share of blocks (at each format's block size) that hold an
  outlier, with the rule of :func:`fp4rl.recovery.outliers.outlier_blocks`: a block whose
  max |x| is at least 24 x its median |x|, the ratio at which a median-sized value of a
  block scaled to E2M1's top code 6 falls to 0.25 and rounds to zero;
- ``sparsify_mse`` / ``sparsify_rmse``: the error of 2:4-sparsifying ``Q(X)`` versus the
  residual ``Q(X - Q(X))`` (why ResQ sparsifies the residual, not the activation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from fp4rl.analysis.activations import zero_fraction
from fp4rl.formats import get_format, quantize
from fp4rl.recovery.outliers import outlier_block_fraction
from fp4rl.recovery.sparsity import sparsify


@dataclass
class LayerDiagnosis:
    name: str
    tokens: int
    in_features: int
    max_over_median: float
    zero_frac: dict[str, float] = field(default_factory=dict)
    outlier_block_frac: dict[str, float] = field(default_factory=dict)
    sparsify_mse: dict[str, dict[str, float]] = field(default_factory=dict)
    sparsify_rmse: dict[str, dict[str, float]] = field(default_factory=dict)


def _sparsify_error(t: torch.Tensor, pattern: str = "2:4") -> float:
    return (sparsify(t, pattern) - t).pow(2).mean().item()


def diagnose_activations(name: str, x: torch.Tensor,
                         formats: Sequence[str]) -> LayerDiagnosis:
    """All statistics of one layer's captured input ``x`` (tokens, in_features)."""
    a = x.abs()
    ratio = (a.max() / a.median().clamp_min(1e-30)).item()
    diag = LayerDiagnosis(name, x.shape[0], x.shape[1], ratio,
                          zero_frac={"bf16": zero_fraction(x, "bf16")})
    for fmt in formats:
        qx = quantize(x, fmt)
        residual = quantize(x - qx, fmt)
        diag.zero_frac[fmt] = (qx == 0).float().mean().item()
        block = get_format(fmt).block_size
        usable = x.shape[1] - x.shape[1] % block
        diag.outlier_block_frac[fmt] = outlier_block_fraction(x[:, :usable], block)
        mse = {"qx": _sparsify_error(qx), "residual": _sparsify_error(residual)}
        diag.sparsify_mse[fmt] = mse
        diag.sparsify_rmse[fmt] = {k: math.sqrt(v) for k, v in mse.items()}
    return diag


def report(model_name: str, formats: Sequence[str],
           layers: list[LayerDiagnosis]) -> dict[str, object]:
    """The JSON record of a diagnosis (written with ``fp4rl.paths.write_json``)."""
    return {"model": model_name, "formats": list(formats),
            "outlier_rule": "block max|x| >= 24 * block median|x|",
            "layers": [asdict(d) for d in layers]}


def summarize(layers: list[LayerDiagnosis], formats: Sequence[str],
              kind: str = "") -> dict[str, dict[str, float]]:
    """Mean statistics over the layers whose name contains ``kind``."""
    chosen = [d for d in layers if kind in d.name]
    keys = ["bf16", *formats]
    out: dict[str, dict[str, float]] = {
        "zero_frac": {k: sum(d.zero_frac[k] for d in chosen) / len(chosen) for k in keys},
        "outlier_block_frac": {f: sum(d.outlier_block_frac[f] for d in chosen) / len(chosen)
                               for f in formats},
    }
    for part in ("qx", "residual"):
        out[f"sparsify_rmse_{part}"] = {
            f: sum(d.sparsify_rmse[f][part] for d in chosen) / len(chosen) for f in formats}
    return out
