"""Build and call the fused C kernels through ctypes: quantization (``quant.c``) and the
batch-invariant GEMM and row reductions (``invariant.c``).

The library is compiled on first use with the system C compiler and cached under
``$FP4RL_CACHE/kernels`` (default ``~/.cache/fp4rl``), keyed by the source, the
compiler flags and the CPU model, so a cached build never runs on a CPU it was
not built for. If no compiler is available the callers fall back to the
reference path, with a warning, rather than fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from collections.abc import Iterator
from functools import cache, partial
from pathlib import Path
from typing import ClassVar

import torch

from fp4rl.kernels.codes import c_defines
from fp4rl.paths import cache_root

SOURCE = Path(__file__).with_name("quant.c")
#: the batch-invariant GEMM, softmax and mean (fp4rl.nn.invariant), built into the same library
INVARIANT_SOURCE = Path(__file__).with_name("invariant.c")
SOURCES = (SOURCE, INVARIANT_SOURCE)
#: below this many elements a kernel runs on one thread: a parallel region costs a few
#: microseconds, which a 32-row decode step of a 576-wide model (18k values) already repays
PARALLEL_MIN_ELEMENTS = 1 << 13
#: ``-ffp-contract=off``: a product and a sum are rounded one by one, as the reference's
#: float64 steps are, unless the source asks for a fused multiply-add by name (the
#: batch-invariant GEMM does: one rounding, the same on every ISA)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-ffp-contract=off", *c_defines())


def build_flags(march: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a library for ``march``; by default this process's: the
    CPU's own unless ``FP4RL_MARCH`` names another target (``x86-64-v3``: the AVX2 code a
    CPU without AVX-512 runs, to measure or test it on one that has it)."""
    march = march or os.environ.get("FP4RL_MARCH", "").strip() or "native"
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _library_path() -> Path:
    key = hashlib.sha256()
    parts = [src.read_bytes() for src in SOURCES]
    for part in (*parts, " ".join(build_flags()).encode(), _cpu_model().encode(),
                 platform.machine().encode()):
        key.update(part)
    return cache_root() / "kernels" / f"quant-{key.hexdigest()[:16]}.so"


def _compile(target: Path, march: str | None = None) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *build_flags(march), *map(str, SOURCES), "-o", str(out), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            names = " and ".join(src.name for src in SOURCES)
            march = os.environ.get("FP4RL_MARCH", "").strip()
            hint = f" (FP4RL_MARCH={march}: unset it, or name a target {compiler} knows)" \
                if march else ""
            raise RuntimeError(f"compiling {names} failed{hint}:\n{proc.stderr}")
        os.replace(out, target)  # atomic: a concurrent reader sees all or nothing


@cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with a warning) when it cannot be built."""
    if os.environ.get("FP4RL_DISABLE_KERNELS") == "1":
        return None
    path = _library_path()
    try:
        if not path.exists():
            _compile(path)
        lib = _declared(ctypes.CDLL(str(path)))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"fp4rl: fused CPU kernel unavailable, using the slow reference path "
                      f"({err})", RuntimeWarning, stacklevel=2)
        return None
    # FP4RL_AMX=0: the batch-invariant GEMM's bf16 operands stay on the FMA tile, whose
    # bits every CPU shares (the tile unit's sums are its own)
    lib.fp4rl_bi_allow_amx(int(os.environ.get("FP4RL_AMX", "1") != "0"))
    return lib


def build_for(march: str, directory: Path) -> ctypes.CDLL:
    """The library compiled into ``directory`` for another ``-march`` (``x86-64``: SSE2,
    ``x86-64-v3``: AVX2 + FMA, ``x86-64-v4``: AVX-512): what a CPU of that kind runs, so
    one machine can check that every build computes the same bits."""
    target = directory / f"quant-{march}.so"
    _compile(target, march)
    return _declared(ctypes.CDLL(str(target)))


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with its functions' argument and result types."""
    lib.fp4rl_quantize.restype = ctypes.c_int
    lib.fp4rl_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    lib.fp4rl_quantize_cols.restype = ctypes.c_int
    lib.fp4rl_quantize_cols.argtypes = lib.fp4rl_quantize.argtypes
    lib.fp4rl_resq.restype = ctypes.c_int
    lib.fp4rl_resq.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.fp4rl_resq_terms.restype = ctypes.c_int
    lib.fp4rl_resq_terms.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.fp4rl_resq_terms_bf16.restype = ctypes.c_int
    lib.fp4rl_resq_terms_bf16.argtypes = lib.fp4rl_resq_terms.argtypes
    lib.fp4rl_quantize_bf16.restype = ctypes.c_int
    lib.fp4rl_quantize_bf16.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.fp4rl_quantize_values.restype = ctypes.c_int
    lib.fp4rl_quantize_values.argtypes = [flag, ptr, flag, i64, i64, ptr, ptr, flag,
                                          ctypes.c_float, flag]
    lib.fp4rl_bi_gemm.restype = ctypes.c_int
    lib.fp4rl_bi_gemm.argtypes = [i64, i64, i64, i64, ptr, flag, i64, i64, i64,
                                  ptr, flag, i64, i64, i64, ptr, ptr, flag, i64, i64, i64, flag,
                                  ptr]
    lib.fp4rl_bi_pack.restype = ctypes.c_int
    lib.fp4rl_bi_pack.argtypes = [i64, i64, ptr, flag, i64, i64, ptr, flag, flag]
    lib.fp4rl_bi_layout.restype = flag
    lib.fp4rl_bi_layout.argtypes = [flag, flag, i64]
    lib.fp4rl_bi_packed_floats.restype = i64
    lib.fp4rl_bi_packed_floats.argtypes = [i64, i64, flag]
    lib.fp4rl_bi_amx.restype = flag
    lib.fp4rl_bi_amx.argtypes = []
    lib.fp4rl_bi_allow_amx.restype = None
    lib.fp4rl_bi_allow_amx.argtypes = [flag]
    lib.fp4rl_bi_softmax.restype = ctypes.c_int
    lib.fp4rl_bi_softmax.argtypes = [ptr, flag, ptr, flag, i64, i64, flag, flag]
    lib.fp4rl_bi_row_mean.restype = ctypes.c_int
    lib.fp4rl_bi_row_mean.argtypes = [ptr, flag, ptr, flag, i64, i64, flag]
    return lib


def _threads(t: torch.Tensor) -> int:
    """A parallel region costs more than it saves on small tensors (decode steps)."""
    return torch.get_num_threads() if t.numel() >= PARALLEL_MIN_ELEMENTS else 1


def _run(kernel: str, code: int, *args: object, refused: str = "") -> bool:
    """Call the exported C function ``kernel`` with a format's ``code`` (its
    :class:`fp4rl.kernels.FormatKernels` code) and ``args``: False where the library is
    unavailable; a non-zero status (a format or group the kernel does not take) raises."""
    lib = load_library()
    if lib is None:
        return False
    if getattr(lib, kernel)(code, *args) != 0:
        raise ValueError(f"the C kernel {kernel} refused format code {code}{refused}")
    return True


def resq_rows_cpu(code: int, rows: torch.Tensor, keep: int,
                  group: int) -> torch.Tensor | None:
    """Fused ``Q(x) + S(Q(x - Q(x)))`` over contiguous float32 rows (None if unavailable)."""
    out = torch.empty_like(rows)
    ran = _run("fp4rl_resq", code, rows.data_ptr(), out.data_ptr(), rows.shape[0],
               rows.shape[1], keep, group, _threads(rows), refused=f" / group {group}")
    return out if ran else None


def resq_terms_cpu(code: int, rows: torch.Tensor, keep: int,
                   group: int) -> torch.Tensor | None:
    """ResQ's two bf16 GEMM operands ``Q(x)`` and ``S(Q(x - Q(x)))`` of contiguous float32
    or bfloat16 rows, stacked in one (2 * rows, len) bf16 tensor, ``Q(x)`` first (None if
    unavailable)."""
    n = rows.shape[0]
    out = torch.empty(2 * n, rows.shape[1], dtype=torch.bfloat16)
    kernel = "fp4rl_resq_terms_bf16" if rows.dtype == torch.bfloat16 else "fp4rl_resq_terms"
    ran = _run(kernel, code, rows.data_ptr(), out.data_ptr(), out[n:].data_ptr(), n,
               rows.shape[1], keep, group, _threads(rows), refused=f" / group {group}")
    return out if ran else None


def quantize_bf16_cpu(code: int, rows: torch.Tensor) -> torch.Tensor | None:
    """``Q(x)`` of contiguous bfloat16 rows along the rows, nearest rounding, block-only
    scaling, as bfloat16 (None if unavailable)."""
    out = torch.empty_like(rows)
    ran = _run("fp4rl_quantize_bf16", code, rows.data_ptr(), out.data_ptr(),
               rows.shape[0], rows.shape[1], _threads(rows))
    return out if ran else None


#: the dtypes :func:`quantize_values_cpu` reads and writes, as the C side's bf16 flag
_VALUE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def quantize_values_cpu(code: int, x: torch.Tensor, rows: bool, cols: bool,
                        tensor_scale: float | None, out_dtype: torch.dtype
                        ) -> list[torch.Tensor] | None:
    """The block values ``Q(x / g)`` of a contiguous float32 or bfloat16 matrix along its
    rows and/or along its columns (nearest rounding, ``g`` = ``tensor_scale`` left
    outside), written straight into ``out_dtype`` (float32 or bfloat16) in one call:
    ``[along rows, along columns]``, whichever were asked for (None if the library is
    unavailable)."""
    outs = [torch.empty(x.shape, dtype=out_dtype) for wanted in (rows, cols) if wanted]
    pointers = iter(out.data_ptr() for out in outs)
    y_rows = next(pointers) if rows else None
    y_cols = next(pointers) if cols else None
    ran = _run("fp4rl_quantize_values", code, x.data_ptr(), _VALUE_DTYPES[x.dtype],
               x.shape[0], x.shape[1], y_rows, y_cols, _VALUE_DTYPES[out_dtype],
               tensor_scale or 0.0, _threads(x))
    return outs if ran else None


def quantize_rows_cpu(code: int, rows: torch.Tensor, noise: torch.Tensor | None,
                      tensor_scale: float | None, axis: int = 1) -> torch.Tensor | None:
    """Fake-quantize a contiguous float32 CPU matrix along ``axis`` (1: rows, 0: columns)
    with the fused kernel (None if unavailable). ``noise`` is laid out as rows along the
    axis; ``tensor_scale`` g quantizes ``x / g`` and multiplies the result by g (NVFP4).
    """
    out = torch.empty_like(rows)
    noise_ptr, noise_stride = (None, 0) if noise is None else (noise.data_ptr(), noise.shape[1])
    kernel = "fp4rl_quantize" if axis == 1 else "fp4rl_quantize_cols"
    ran = _run(kernel, code, rows.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1],
               noise_ptr, noise_stride, tensor_scale or 0.0, _threads(rows))
    return out if ran else None


#: the run of k's the batch-invariant GEMM sums apart (a linear layer's reduction)
BI_CHUNK = 64
#: ``chunk`` for no runs: each output's products in one sum, in the hardware's fastest order
#: (on AMX the tiles accumulate every step; elsewhere chunk 0's sequential sum)
BI_NO_RUNS = -1
#: dtypes the batch-invariant kernels take, as the C side's bf16 flag
_BI_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def bi_supported(*tensors: torch.Tensor) -> bool:
    """Whether the batch-invariant kernels take these tensors: on the CPU, float32 or
    bfloat16, and the library built."""
    return all(t.device.type == "cpu" and t.dtype in _BI_DTYPES for t in tensors) and \
        load_library() is not None


class _Panels:
    """The batch-invariant GEMM's B operands packed into its panels, kept per tensor while a
    :func:`keep_panels` scope is open: a decode step multiplies a few rows by every weight,
    so packing each weight at every call would cost as much as the products."""

    depth = 0
    #: id(base tensor) -> (a weak reference to it, {view geometry: (version, panels)}); the
    #: reference's callback drops the entry with the tensor
    kept: ClassVar[dict[int, tuple[weakref.ref[torch.Tensor], dict[tuple[object, ...],
                                                                  tuple[tuple[int, int],
                                                                        torch.Tensor]]]]] = {}
    #: below this many values a B operand is packed per call (cheap next to a lookup)
    min_values = 1 << 15

    @classmethod
    def _forget(cls, key: int, _: object) -> None:
        cls.kept.pop(key, None)

    @classmethod
    def of(cls, b: torch.Tensor, layout: int, threads: int) -> torch.Tensor | None:
        """``b``'s packed panels in ``layout`` (``fp4rl_bi_layout``'s: the FMA tile's or the
        tile unit's), kept or packed now and kept; None outside a scope or for a small or
        batched ``b``."""
        if cls.depth == 0 or b.dim() != 2 or b.numel() < cls.min_values:
            return None
        base = b._base if b._base is not None else b
        key = id(base)
        entry = cls.kept.get(key)
        if entry is None or entry[0]() is not base:
            entry = (weakref.ref(base, partial(cls._forget, key)), {})
            cls.kept[key] = entry
        geometry = (b.data_ptr(), *b.shape, *b.stride(), b.dtype, layout)
        version = (base._version, base.data_ptr())
        hit = entry[1].get(geometry)
        if hit is not None and hit[0] == version:
            return hit[1]
        lib = load_library()
        assert lib is not None
        k, n = b.shape
        panels = torch.empty(lib.fp4rl_bi_packed_floats(k, n, layout), dtype=torch.float32)
        if lib.fp4rl_bi_pack(k, n, b.data_ptr(), _BI_DTYPES[b.dtype], b.stride(0),
                             b.stride(1), panels.data_ptr(), threads, layout) != 0:
            raise AssertionError(f"the GEMM's packing refused layout {layout} for {b.dtype}")
        entry[1][geometry] = (version, panels)
        return panels


@contextlib.contextmanager
def keep_panels() -> Iterator[None]:
    """Within the block the batch-invariant GEMM keeps its B operands packed, per tensor and
    version (:func:`fp4rl.nn.hold_weights` opens it: there a weight changes only by writes
    that bump its version or move its storage, and optimizer steps, which call
    :func:`drop_panels`). Leaving the outermost scope drops them."""
    _Panels.depth += 1
    try:
        yield
    finally:
        _Panels.depth -= 1
        if _Panels.depth == 0:
            drop_panels()


def drop_panels() -> None:
    """Forget every kept packed B operand (an optimizer step may have changed any weight,
    even without bumping its version: a fused optimizer writes the storage directly)."""
    _Panels.kept.clear()


def bi_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, chunk: int = BI_CHUNK) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-D or batched 3-D ``a`` (.., M, K) and ``b`` (.., K, N) of
    any strides, each output's products summed in increasing k by fused multiply-adds (see
    ``invariant.c``): a row's result is the same bits whatever else is computed beside it.
    ``bias`` (N,) is added in float32 before the one rounding to ``out_dtype`` (default
    ``a``'s dtype). ``chunk``: the run of k's summed apart before joining the total (a
    fixed order set by K alone); 0 for one sequential sum, which zeros anywhere along k
    leave unchanged (attention's masked keys); :data:`BI_NO_RUNS` for one sum in the
    hardware's fastest order (still row-local, for a caller that fixes no order). bf16
    operands in runs of a multiple of 32, or in no runs, take the tile unit on a CPU with
    AMX (``fp4rl_bi_layout``): batch-invariant the same way, with the hardware's own sum
    of each step's 32 products. Inside
    :func:`keep_panels` a 2-D ``b`` is packed once per version."""
    lib = load_library()
    assert lib is not None, "check bi_supported() first"
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a[None], b[None])
    batch, m, k = a3.shape
    n = b3.shape[2]
    dtype = out_dtype or a.dtype
    out = torch.empty((batch, m, n), dtype=dtype)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    threads = torch.get_num_threads() if batch * m * n * k >= PARALLEL_MIN_ELEMENTS * 64 else 1
    layout = lib.fp4rl_bi_layout(_BI_DTYPES[a.dtype], _BI_DTYPES[b.dtype], chunk)
    packed = None if batched else _Panels.of(b, layout, torch.get_num_threads())
    status = lib.fp4rl_bi_gemm(
        batch, m, n, k,
        a3.data_ptr(), _BI_DTYPES[a.dtype], a3.stride(0), a3.stride(1), a3.stride(2),
        b3.data_ptr(), _BI_DTYPES[b.dtype], b3.stride(0), b3.stride(1), b3.stride(2),
        None if bias32 is None else bias32.data_ptr(), out.data_ptr(), _BI_DTYPES[dtype],
        out.stride(0), out.stride(1), chunk, threads,
        None if packed is None else packed.data_ptr())
    if status != 0:
        raise MemoryError("the batch-invariant GEMM could not allocate its packed operands")
    return out if batched else out[0]


def _row_kernel(kernel: str, x: torch.Tensor, reduce: bool, out_dtype: torch.dtype | None,
                *flags: int) -> torch.Tensor:
    """Run the C row kernel ``kernel`` over the rows along ``x``'s last axis, writing a
    row of the same length or (``reduce``) one value a row, the axis kept."""
    lib = load_library()
    assert lib is not None, "check bi_supported() first"
    rows = x.contiguous()
    length = rows.shape[-1] if rows.dim() else 1
    out = torch.empty((*rows.shape[:-1], 1) if reduce else rows.shape,
                      dtype=out_dtype or x.dtype)
    getattr(lib, kernel)(rows.data_ptr(), _BI_DTYPES[rows.dtype], out.data_ptr(),
                         _BI_DTYPES[out.dtype], rows.numel() // max(length, 1), length, *flags,
                         _threads(rows))
    return out


def bi_softmax(x: torch.Tensor, log: bool, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """Softmax (or log-softmax) along the last axis, each row on its own (see
    ``invariant.c``)."""
    return _row_kernel("fp4rl_bi_softmax", x, False, out_dtype, int(log))


def bi_logsumexp(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``max + log(sum(exp(x - max)))`` along the last axis, the axis kept (size 1), each
    row on its own: what :func:`bi_softmax`'s log-softmax subtracts."""
    return _row_kernel("fp4rl_bi_softmax", x, True, out_dtype, 2)


def bi_row_mean(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The mean along the last axis, the axis kept (size 1), each row on its own."""
    return _row_kernel("fp4rl_bi_row_mean", x, True, out_dtype)
