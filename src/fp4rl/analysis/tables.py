"""The tables ``fp4rl diagnose`` prints: per projection type, medians or means over the
layers of what :mod:`fp4rl.analysis.diagnose` and :mod:`fp4rl.analysis.gradients` measure."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

    from fp4rl.analysis.diagnose import LayerDiagnosis
    from fp4rl.analysis.gradients import FormatGradients

#: the rows of a table: all layers (""), then each projection of a Llama/Qwen2 block
LAYER_KINDS = ("", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj")


def activation_table(layers: list[LayerDiagnosis], formats: list[str]) -> Table:
    """Means over the layers of each projection type: share of zeros (bf16 and each
    format), of outlier blocks, and the 2:4 RMSE of the residual relative to that of
    Q(X)."""
    from rich.table import Table

    from fp4rl.analysis import diagnose

    series = ["bf16", *formats]
    table = Table(title="means over layers: share of zeros, of outlier blocks, and the 2:4 "
                        "RMSE of the residual relative to that of Q(X)")
    table.add_column("layers")
    for col in (*(f"0s {s}" for s in series), *(f"outl {f}" for f in formats),
                *(f"2:4 res/QX {f}" for f in formats)):
        table.add_column(col, justify="right")
    for kind in LAYER_KINDS:
        m = diagnose.summarize(layers, formats, kind)
        table.add_row(kind.removesuffix("_proj") or "all",
                      *(f"{m['zero_frac'][s]:.1%}" for s in series),
                      *(f"{m['outlier_block_frac'][f]:.1%}" for f in formats),
                      *(f"{m['sparsify_rmse_residual'][f] / m['sparsify_rmse_qx'][f]:.2f}"
                        for f in formats))
    return table


def gemm_table(result: FormatGradients) -> Table:
    """Per projection type, medians over layers: GEMM SQNR per scheme; zero shares of dY,
    of Q(dY) and of the non-zero dY entries flushed to zero (the requantize pass)."""
    return _kind_table(f"{result.format}: GEMM SQNR vs the unquantized GEMM of the same "
                       "operands (dB), zeros of dY and Q(dY) (median over layers)", result, {
        "Y": "gemm_sqnr/requantize/Y", "dX req": "gemm_sqnr/requantize/dX",
        "dX reuse": "gemm_sqnr/reuse_forward/dX", "dW req": "gemm_sqnr/requantize/dW",
        "dW reuse": "gemm_sqnr/reuse_forward/dW", "0s dY": "zeros/requantize/dY",
        "0s Q(dY) dX": "zeros/requantize/QdY_dX", "0s Q(dY) dW": "zeros/requantize/QdY_dW",
        "flushed dX": "zeros/requantize/flushed_dX",
        "flushed dW": "zeros/requantize/flushed_dW"})


def layer_cosine_table(result: FormatGradients) -> Table:
    """Per projection type: median cosine of each layer's weight gradient with the
    unquantized one and with the exact gradient of the FP4 forward."""
    short = {"fp4_forward": "fwd", "requantize": "req", "reuse_forward": "reuse",
             "weights_only": "W only", "activations_only": "X only"}
    columns = {f"{short[v]} | bf16": f"grad_cosine/{v}/bf16" for v in short}
    columns.update({f"{short[v]} | fwd": f"grad_cosine/{v}/fp4_forward"
                    for v in ("requantize", "reuse_forward")})
    return _kind_table(f"{result.format}: per-layer cosine of dW, variant | reference "
                       "(fwd: fp4_forward; median over layers)", result, columns)


def _kind_table(title: str, result: FormatGradients, columns: dict[str, str]) -> Table:
    from rich.table import Table

    from fp4rl.analysis.gradients import summarize

    table = Table(title=title)
    table.add_column("layers")
    for col in columns:
        table.add_column(col, justify="right")
    for kind in LAYER_KINDS:
        m = summarize(result, kind)
        table.add_row(kind.removesuffix("_proj") or "all",
                      *(f"{m[k]:.1%}" if k.startswith("zeros") else
                        f"{m[k]:.3f}" if "cosine" in k else f"{m[k]:.1f}"
                        for k in columns.values()))
    return table


def update_table(result: FormatGradients) -> Table:
    """Per variant: cosine of the whole update with each reference, and the median
    per-layer SQNR of the weight gradients against each."""
    from rich.table import Table

    from fp4rl.analysis.gradients import REFERENCES, summarize

    table = Table(title=f"{result.format}: the update direction (all gradients "
                        "concatenated; linears: the patched layers' weights only)")
    table.add_column("variant")
    for ref in REFERENCES:
        for col in (f"cos vs {ref}", f"cos linears vs {ref}", f"median SQNR vs {ref}"):
            table.add_column(col, justify="right")
    m = summarize(result)
    for variant, cos in result.update_cosine.items():
        cells = []
        for ref in REFERENCES:
            if ref not in cos:
                cells += ["", "", ""]
                continue
            cells += [f"{cos[ref]:.3f}",
                      f"{result.linear_cosine[variant][ref]:.3f}",
                      f"{m[f'grad_sqnr/{variant}/{ref}']:.1f} dB"]
        table.add_row(variant, *cells)
    return table
