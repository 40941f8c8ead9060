"""Build and call the fused C quantization kernel (``quant.c``) through ctypes.

The kernel is compiled on first use with the system C compiler and cached under
``$FP4RL_CACHE/kernels`` (default ``~/.cache/fp4rl``), keyed by the source, the
compiler flags and the CPU model, so a cached build never runs on a CPU it was
not built for. If no compiler is available the callers fall back to the
reference path, with a warning, rather than fail.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

from fp4rl.kernels.codes import c_defines
from fp4rl.paths import cache_root

SOURCE = Path(__file__).with_name("quant.c")
#: below this many elements a kernel runs on one thread: a parallel region costs a few
#: microseconds, which a 32-row decode step of a 576-wide model (18k values) already repays
PARALLEL_MIN_ELEMENTS = 1 << 13
#: ``-ffp-contract=off``: a product and a sum are rounded one by one, as the reference's
#: float64 steps are (a fused multiply-add would round them once, together)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-ffp-contract=off", *c_defines())


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
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), _cpu_model().encode(),
                 platform.machine().encode()):
        key.update(part)
    return cache_root() / "kernels" / f"quant-{key.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr}")
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
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"fp4rl: fused CPU kernel unavailable, using the slow reference path "
                      f"({err})", RuntimeWarning, stacklevel=2)
        return None
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
