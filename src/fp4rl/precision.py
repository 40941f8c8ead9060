"""The precision policy and the device of a run, decided in one place.

Master weights and optimizer state are always FP32. ``mixed_precision`` (accelerate's
name and meaning) only chooses the *compute* dtype:

- ``"no"``: every matmul in float32;
- ``"bf16"``: the model runs under ``torch.autocast(dtype=bfloat16)``; FP4 linear layers
  cast their quantized operands to bf16 (exact: every FP4 value fits in bf16) and multiply
  with fp32 accumulation; log-probs, losses, advantages and importance ratios stay fp32;
- ``"auto"``: ``bf16`` where the device does bf16 natively (a CUDA GPU with bf16, a CPU
  with avx512_bf16 or AMX), else ``no``.

A run resolves ``auto`` once and records the resolved value, so its saved config
reproduces it on any machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, get_args

import torch

from fp4rl.errors import UserError

#: the ``mixed_precision`` values (accelerate's names), declared once: the config's field
#: type and the check of a value given elsewhere (``fp4rl eval``, the demo) read it
MixedPrecision = Literal["no", "bf16", "auto"]
MIXED_PRECISION: tuple[MixedPrecision, ...] = get_args(MixedPrecision)
#: CPU feature flags that mean a bf16 GEMM runs natively (faster than fp32)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_info() -> tuple[str, tuple[str, ...]]:
    """The CPU model name and which of :data:`BF16_CPU_FLAGS` it has (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), ()
    model, flags = platform.processor() or platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model in ("", platform.machine()):
            model = value.strip()
        elif key.strip() == "flags":
            flags.update(value.split())
    return model, tuple(f for f in BF16_CPU_FLAGS if f in flags)


def describe_cpu() -> str:
    """One line for benchmark output: model and bf16 capability."""
    model, flags = cpu_info()
    native = ", ".join(flags) if flags else "none (bf16 GEMMs are emulated, slower than fp32)"
    if flags and not _kernels_use_bf16():
        native += (f" (unused: torch's kernels run {torch.backends.cpu.get_cpu_capability()}"
                   f", oneDNN ISA {os.environ.get('ONEDNN_MAX_CPU_ISA', 'ALL')})")
    return f"CPU: {model}; native bf16 flags: {native}"


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on ``device``: on a CPU, one of
    :data:`BF16_CPU_FLAGS` and kernels allowed to use it (``ATEN_CPU_CAPABILITY=avx2`` or
    ``ONEDNN_MAX_CPU_ISA=AVX2`` hold torch and oneDNN to the avx2 code path, where bf16 is
    emulated, as on a CPU without the flags)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(cpu_info()[1]) and _kernels_use_bf16()
    return False


def _kernels_use_bf16() -> bool:
    if not torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512"):
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return isa == "ALL" or "AVX512_CORE_BF16" in isa or "AMX" in isa


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """``auto`` (cuda when available), ``cpu``, ``cuda`` or ``cuda:N``; a clear error if the
    device is not there."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"device {spec!r} is not a device: use auto, cpu, cuda or cuda:N") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {spec!r} is not supported: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {spec!r} asked for, but no CUDA GPU is available here "
                            "(this torch build or machine has none): use device=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {spec!r} does not exist: this machine has "
                            f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_mixed_precision(value: str, device: torch.device) -> Literal["no", "bf16"]:
    """``auto`` -> ``bf16`` where ``device`` does bf16 natively, else ``no``."""
    if value not in MIXED_PRECISION:
        raise UserError(f"mixed_precision {value!r} is not one of {', '.join(MIXED_PRECISION)}")
    if value == "auto":
        return "bf16" if native_bf16(device) else "no"
    return "bf16" if value == "bf16" else "no"


def slow_bf16_note(mixed_precision: str, device: torch.device) -> str | None:
    """A one-line note when bf16 compute was asked for on a device that emulates it."""
    if mixed_precision == "bf16" and not native_bf16(device):
        return (f"note: mixed_precision=bf16 on a device without native bf16 ({device}); "
                "results are right but matmuls run slower than in fp32")
    return None


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype matmuls run in under a resolved ``mixed_precision``."""
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float32


@contextlib.contextmanager
def autocast(device: torch.device, compute: torch.dtype) -> Iterator[None]:
    """The run's compute context: bf16 autocast on ``device`` for a bf16 ``compute``
    dtype (:func:`compute_dtype`), or nothing for float32."""
    if compute != torch.bfloat16 or not torch.amp.is_autocast_available(device.type):
        yield  # a device without autocast (``meta``) runs each op in its inputs' dtype
        return
    with torch.autocast(device.type, dtype=torch.bfloat16):
        yield


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[None]:
    """Autocast switched off for ``device_type`` (nothing to switch where the device has
    no autocast, such as ``meta``)."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def active_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The compute dtype in force for ``x``: the autocast dtype if autocast is on for its
    device, else ``x``'s own floating dtype. FP4 layers follow it as ``nn.Linear`` does."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype if x.dtype.is_floating_point else torch.float32


__all__ = ["MIXED_PRECISION", "MixedPrecision", "active_compute_dtype", "autocast",
           "autocast_off",
           "compute_dtype", "cpu_info", "describe_cpu", "native_bf16", "resolve_device",
           "resolve_mixed_precision", "slow_bf16_note"]
