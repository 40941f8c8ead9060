"""Run by tests/kernels/test_triton_compile.py in a process of its own, with TRITON_INTERPRET
unset (compiled kernels, not interpreted ones): compiles every kernel variant of the
registered formats for sm_90 and sm_100, and computes the specialization key of each
operation's launches at several token counts. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

import torch

from fp4rl.formats import get_format, list_formats
from fp4rl.gemm import PackedOperand
from fp4rl.kernels import aot, dispatch, triton_decode, triton_packed_mm, triton_quant

TOKENS = (1, 2, 16, 33, 64, 248, 4096)
os.environ["FP4RL_QUANTIZE_ON_LOAD"] = "1"  # the training GEMMs' kernel is launched too
WIDTH = 256


OPS = ("rows_bf16", "rows", "cols", "cols_bf16", "resq", "resq_terms", "resq_terms_nm", "decode",
       "packed_mm", "packed_mm_resq", "packed_mm_resq_nm", "both", "both_bf16", "operand_rows",
       "operand_cols", "qmm_forward", "qmm_input_grad", "qmm_weight_grad")
#: the rows of the weight the packed GEMM multiplies
OUT = 96


def run_op(op: str, fmt, x: torch.Tensor) -> None:
    """One operation of a GPU step on ``x``'s rows, through fp4rl's own functions."""
    from fp4rl.gemm import quantize_operand
    from fp4rl.kernels import resq_rows, resq_terms

    if op == "rows_bf16":
        quantize_operand(x.bfloat16(), fmt)
    elif op in ("rows", "cols", "cols_bf16"):
        triton_quant.quantize_2d(fmt, x if op != "cols_bf16" else x.bfloat16(),
                                 1 if op == "rows" else 0)
    elif op == "resq":
        resq_rows(fmt, x, 2, 4)
    elif op == "resq_terms":
        resq_terms(fmt, x.bfloat16(), 2, 4)
    elif op == "resq_terms_nm":
        dispatch.resq_terms_nm(fmt, x.bfloat16(), 2, 4)
    elif op.startswith("operand_"):  # a GEMM operand written in bf16 (a weight's)
        quantize_operand(x, fmt, -1 if op == "operand_rows" else 0, out_dtype=torch.bfloat16)
    elif op.startswith("both"):  # an operand and its backward's, as a training step
        from fp4rl.gemm import quantize_operand_pair

        if fmt.vector_scales or "both" not in fmt.kernels.triton:
            return  # each axis on its own: the operand ops above
        if op == "both":
            quantize_operand_pair(x, fmt, torch.bfloat16)
        else:
            quantize_operand_pair(x.bfloat16(), fmt)
    elif op.startswith("packed_mm"):
        packed_mm(fmt, x, op.removeprefix("packed_mm_"))
    elif op.startswith("qmm_"):
        qmm(op.removeprefix("qmm_"), fmt, x)
    else:
        decode(fmt, x.shape[0])


def launches_by_op(launched: set) -> dict[str, set[str]]:
    """Each operation a GPU step runs, at every token count; the specialization keys of
    its launches (the kernels are not run), and the variants launched, into
    ``launched``."""
    keys: dict[str, set[str]] = {}
    op = ""

    def record(variant, grid, *args):
        keys.setdefault(op, set()).add(f"{variant.kernel.__name__} "
                                       f"{aot.specialization(variant, args)}")
        launched.add(variant)

    with mock.patch.object(triton_quant.Variant, "launch", record), \
            mock.patch.object(dispatch, "triton_for", lambda device: triton_quant):
        for n in TOKENS:
            x = torch.randn(n, WIDTH)
            for f in (get_format(name) for name in list_formats()):
                for name in OPS if f.kernels is not None else ():
                    op = f"{f.name}.{name}"
                    if name.startswith("packed_mm"):  # a tile height per token range
                        op += f".h{triton_packed_mm.height(n, 2 if 'resq' in name else 1)}"
                    run_op(name, f, x)
    return keys


def decode(fmt, rows: int) -> None:
    """A packed weight of ``rows`` rows to bf16 values, as a packed engine does."""
    if fmt.kernels is not None and "decode" in fmt.kernels.triton:
        packed = PackedOperand(fmt.encode(torch.randn(rows, WIDTH), dim=-1,
                                          **({"per_tensor_scale": False}
                                             if fmt.has_tensor_scale else {})), None)
        triton_decode.decode_2d(fmt, packed.row_fields(), rows, WIDTH, torch.bfloat16)


def packed_mm(fmt, x: torch.Tensor, resq: str) -> None:
    """``x``'s rows (bf16, a scale a row), or (``resq``) ResQ's two terms of them with a
    bias (``resq_nm``: the second n:m sparse, 2:4), times a packed weight, through
    :func:`fp4rl.gemm.mm_packed` and :func:`fp4rl.gemm.packed_gemm` (the fused kernel at
    every token count; at one token it splits K, and its reduction runs too)."""
    from fp4rl.gemm import NMOperand, Operand, PackedCall, mm_packed, packed_gemm

    if fmt.kernels is None or "packed_mm" not in fmt.kernels.triton:
        return
    w = PackedOperand(fmt.encode(torch.randn(OUT, WIDTH), dim=-1,
                                 **({"per_tensor_scale": False}
                                    if fmt.has_tensor_scale else {})),
                      torch.tensor(2.0) if fmt.has_tensor_scale else None)
    a = Operand(x.bfloat16(), torch.ones(x.shape[0], 1))
    if resq == "resq_nm":
        groups = -(-WIDTH // 4)
        nm = NMOperand(x.bfloat16()[:, :groups * 2].contiguous(),
                       torch.full((x.shape[0], groups), 0b0101, dtype=torch.uint8), 2, 4, WIDTH)
        packed_gemm([a, nm], PackedCall.of(w), torch.bfloat16,
                    torch.zeros(OUT, dtype=torch.bfloat16))
    elif resq:
        mm_packed([a, a], w, torch.bfloat16, torch.zeros(OUT, dtype=torch.bfloat16))
    else:
        mm_packed(a, w, torch.bfloat16)


def qmm(gemm: str, fmt, x: torch.Tensor) -> None:
    """One of a linear's three training GEMMs on ``x``'s rows quantized on load, with the
    scales the layer computes for it (fp4rl.nn.linear: both axes' scales of X in the
    forward, of dY in the backward), through :func:`fp4rl.gemm.mm_on_load`: the forward
    from float32 with a float32 bias, the input gradient from bf16 into float32, the
    weight gradient along the tokens (its scales made in the other two)."""
    from fp4rl.gemm import OnLoad, Operand, mm_on_load, quantizes_on_load

    if not quantizes_on_load(fmt, x, torch.bfloat16):
        return
    w = Operand(torch.randn(OUT, WIDTH).bfloat16())
    g = torch.randn(x.shape[0], OUT).bfloat16()
    if gemm == "forward":
        rows, _ = fmt.tensor_scales(x)
        mm_on_load(OnLoad(x, fmt, rows), w.t(), torch.bfloat16, torch.zeros(OUT))
    elif gemm == "input_grad":
        rows, _ = fmt.tensor_scales(g)
        mm_on_load(OnLoad(g, fmt, rows), w, torch.bfloat16, out_dtype=torch.float32)
    else:
        vector = fmt.vector_scales
        g_cols = torch.ones(1, OUT) if vector else torch.ones(())
        x_cols = torch.ones(1, WIDTH) if vector else torch.ones(())
        mm_on_load(OnLoad(g, fmt, g_cols).t(), OnLoad(x, fmt, x_cols), torch.bfloat16,
                   out_dtype=torch.float32)


def to_compile(variants: list, formats: list) -> list:
    """The variants compiled: all of them under ``FP4RL_AOT_ALL=1`` (``make test-long``);
    otherwise the quantize-on-load GEMM's :func:`~fp4rl.kernels.triton_qmm.qmm_representatives`
    stand for its variants (the others differ only in a pointer's element type), which
    keeps this file's compile within minutes."""
    from fp4rl.kernels.triton_qmm import _qmm_kernel, qmm_representatives

    if os.environ.get("FP4RL_AOT_ALL") == "1":
        return variants
    picked = {v for f in formats if f.kernels is not None and "qmm" in f.kernels.triton
              for v in qmm_representatives(f)}
    return [v for v in variants if v.kernel is not _qmm_kernel or v in picked]


def main() -> None:
    formats = [get_format(n) for n in list_formats()]
    variants = aot.variants(formats)
    chosen = to_compile(variants, formats)
    compiled = aot.compile_all(chosen, keep_ir=True)
    narrow = {f"{c.kernel} {c.constants}": aot.narrow_offsets(c.ttir)
              for c in compiled if c.target == "sm_90" and not c.error}
    launched: set = set()
    keys = launches_by_op(launched)
    print(json.dumps({
        "triton": __import__("triton").__version__,
        "variants": len(variants),
        "chosen": len(chosen),
        "compiled": [{"kernel": c.kernel, "constants": c.constants, "target": c.target,
                      "pointers": c.pointers, "cubin_bytes": c.cubin_bytes,
                      "error": c.error, "fp64": c.fp64, "local": c.local,
                      "fp64_examples": list(c.fp64_examples)} for c in compiled],
        "narrow_offsets": {k: v for k, v in narrow.items() if v},
        "keys": {op: sorted(k) for op, k in keys.items()},
        "launched": len(launched),
        "not_in_table": [f"{v.kernel.__name__} {v.pointers} {v.constants}"
                         for v in launched if v not in set(variants)]}))


if __name__ == "__main__":
    sys.exit(main())
