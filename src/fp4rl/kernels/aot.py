"""Ahead-of-time compilation of the Triton kernels, and their specialization keys, on a
machine without a GPU.

Triton's interpreter runs a kernel's Python, not the compiler: code the interpreter
accepts can still be refused when a GPU first compiles it (a plain global read inside
``@triton.jit``, say). ``triton.compile`` with a :class:`GPUTarget` goes from the kernel to
a cubin for any NVIDIA architecture on a CPU (ptxas ships in Triton's wheel), so every
variant the launchers can produce (:func:`variants`) is
compiled here for the GPUs users run. The specialization key Triton computes at each
launch (which binary a launch needs) is computed here too, from the launch's own
arguments, to show that a token count never asks for a new binary.

Must run with ``TRITON_INTERPRET`` unset (the kernels are then compiled, not
interpreted).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fp4rl.kernels.base import KernelFormat
    from fp4rl.kernels.triton_quant import Variant

#: (architecture, warp size) of Hopper (H100/H200) and Blackwell (B200)
TARGETS = {"sm_90": (90, 32), "sm_100": (100, 32)}


@dataclass(frozen=True)
class Compiled:
    """One variant compiled for one target: its cubin's size, or the compiler's error."""

    kernel: str
    constants: dict[str, int | bool]
    pointers: tuple[str, ...]
    target: str
    cubin_bytes: int = 0
    error: str = ""
    ttir: str = ""
    #: SASS instructions that compute in float64 (opcode D*, or a conversion to or from
    #: .F64), and that read or write local memory (LDL/STL: register spills, or a
    #: stack), counted in the cubin by nvdisasm; -1 where nvdisasm is missing
    fp64: int = -1
    local: int = -1
    #: the first few such instructions, to say where
    fp64_examples: tuple[str, ...] = ()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def variants(formats: Iterable[KernelFormat]) -> list[Variant]:
    """Every kernel variant the launchers can produce for ``formats`` (the registered
    ones, say): quantize, ResQ, the per-tensor amax, the packed decode, the packed
    GEMM (each tile height, and the reduction of its split of K) and the quantize-on-load
    training GEMM (a linear's three, with its activations and gradients in one format, as
    every registered recipe that can take it has them)."""
    from fp4rl.kernels.base import QUANTIZE, Operation
    from fp4rl.kernels.triton_decode import decode_variants
    from fp4rl.kernels.triton_packed_mm import packed_mm_variants
    from fp4rl.kernels.triton_qmm import qmm_variants
    from fp4rl.kernels.triton_quant import (
        FLOATS,
        amax_variant,
        quantize_variants,
        vector_amax_variant,
    )

    seen: dict[Variant, None] = {}
    for fmt in formats:
        seen.update(dict.fromkeys(quantize_variants(fmt)))
        seen.update(dict.fromkeys(decode_variants(fmt)))
        seen.update(dict.fromkeys(packed_mm_variants(fmt)))
        if fmt.kernels is not None and Operation.QMM in fmt.kernels.triton:
            seen.update(dict.fromkeys(qmm_variants(fmt)))
        if fmt.kernels is not None and fmt.has_tensor_scale and fmt.kernels.triton & QUANTIZE:
            seen.update(dict.fromkeys(amax_variant(dtype) for dtype in FLOATS))
            if getattr(fmt, "vector_scales", False):  # one scale a token
                seen.update(dict.fromkeys(vector_amax_variant(dtype, cols)
                                           for dtype in FLOATS for cols in (False, True)))
    return list(seen)


def compile_variant(variant: Variant, target: str, keep_ir: bool = False) -> Compiled:
    """``variant`` (a :class:`~fp4rl.kernels.triton_quant.Variant`) compiled to a cubin
    for ``target`` (a key of :data:`TARGETS`); the compiler's error, not an exception,
    where it fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if _interpreted():
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    arch, warp = TARGETS[target]
    consts = dict(variant.constants)
    record = {"kernel": variant.kernel.__name__, "constants": consts, "target": target,
              "pointers": tuple(str(p).removeprefix("torch.") for p in variant.pointers)}
    try:
        source = ASTSource(variant.kernel, variant.signature(), constexprs=consts)
        done = triton.compile(source, target=GPUTarget("cuda", arch, warp),
                              options=dict(variant.options))
    except Exception as err:  # the compiler's refusal is the result
        return Compiled(**record, error=f"{type(err).__name__}: {err}"[:2000])
    fp64, local, examples = sass_counts(done.asm["cubin"])
    return Compiled(**record, cubin_bytes=len(done.asm["cubin"]),
                    ttir=done.asm["ttir"] if keep_ir else "", fp64=fp64, local=local,
                    fp64_examples=examples)


#: SASS opcodes that compute in float64 (Hopper and Blackwell): adds, multiplies, fused
#: multiply-adds, comparisons, min/max, and the float64 reciprocal helpers
FP64_OPCODES = ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DMMA", "DSET")


def nvdisasm() -> str | None:
    """The nvdisasm that ships in Triton's wheel (None where the wheel has none)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    return path if os.access(path, os.X_OK) else None


def sass(cubin: bytes) -> str:
    """The SASS of a cubin, as nvdisasm prints it ("" where nvdisasm is missing)."""
    import subprocess
    import tempfile

    tool = nvdisasm()
    if tool is None:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_counts(cubin: bytes) -> tuple[int, int, tuple[str, ...]]:
    """(float64 instructions, local-memory instructions, a few float64 examples) in a
    cubin's SASS; (-1, -1, ()) where nvdisasm is missing."""
    text = sass(cubin)
    if not text:
        return -1, -1, ()
    fp64: list[str] = []
    local = 0
    for line in text.splitlines():
        code = line.split("*/", 1)[-1].strip().lstrip("@!P0123456789T ").strip()
        opcode = code.split(" ", 1)[0].rstrip(";")
        if not opcode or not opcode[0].isalpha():
            continue
        if opcode.split(".")[0] in FP64_OPCODES or ".F64" in opcode:
            fp64.append(code.rstrip(" ;"))
        if opcode.split(".")[0] in ("LDL", "STL"):
            local += 1
    return len(fp64), local, tuple(fp64[:3])


_JOBS: list[tuple[Variant, str, bool]] = []


def _compile_job(index: int) -> Compiled:
    return compile_variant(*_JOBS[index])


def compile_all(variants: Iterable[Variant], targets: Iterable[str] = tuple(TARGETS),
                keep_ir: bool = False, processes: int | None = None) -> list[Compiled]:
    """Every variant for every target, on ``processes`` forked workers (default: one a
    core; a compile is single-threaded and takes a second or more)."""
    jobs = [(v, t, keep_ir) for v in variants for t in targets]
    processes = processes or os.cpu_count() or 1
    if processes == 1 or len(jobs) < 2:
        return [compile_variant(*job) for job in jobs]
    _JOBS[:] = jobs  # the forked workers inherit the kernels (JIT functions do not pickle)
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            return pool.map(_compile_job, range(len(jobs)), chunksize=1)
    finally:
        _JOBS.clear()


def narrow_offsets(ttir: str) -> list[str]:
    """The lines of a kernel's Triton IR that offset a pointer by 32-bit integers: an
    element offset that is a product of sizes overflows there past 2^31 elements."""
    narrow = []
    for line in ttir.splitlines():
        if "tt.addptr" not in line or " : " not in line:
            continue
        offset = line.split(" : ", 1)[1].split(", ")[-1].split(" loc(")[0].strip()
        if offset == "i32" or offset.endswith("xi32>"):
            narrow.append(line.strip())
    return narrow


def specialization(variant: Variant, args: tuple[object, ...], target: str = "sm_90"
                   ) -> str:
    """The key Triton's launcher computes from ``args`` for ``variant`` on ``target``:
    argument types and the traits it specializes on (an integer equal to 1, multiples of
    16, 16-byte aligned pointers). Launches of one key share one binary; a new key means a
    compile at launch. Computed as the launcher does, without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = variant.kernel
    backend = make_backend(GPUTarget("cuda", *TARGETS[target]))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    _, key, _ = binder(*args, **dict(variant.constants))
    return repr(key)


__all__ = ["FP64_OPCODES", "TARGETS", "Compiled", "compile_all", "compile_variant",
           "narrow_offsets", "nvdisasm", "sass", "sass_counts", "specialization"]
