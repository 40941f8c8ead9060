"""Test-wide settings.

Tests run tiny tensors and models, where a parallel region costs more than it saves and
oversubscribes a shared 2-core machine; one intra-op thread keeps the suite fast and its
timings steady. Without a GPU the Triton kernels run in Triton's interpreter, which must
be chosen before any kernel is defined. Tests never reach the network: the Hub is offline
and its telemetry off (TRL's trainers send telemetry from a thread at construction; where
name resolution fails, that thread has crashed the process).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_registries():
    """Formats, recovery methods, rewards, rollout engines and export formats a test (or a
    benchmark it runs) registers do not leak into the next test."""
    import fp4rl.export
    import fp4rl.recovery
    import fp4rl.rl.rewards
    import fp4rl.rollout  # noqa: F401  (their built-in entries are registered before)
    from fp4rl.registry import scratch

    with scratch():
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes the embedded model's directory runs the real model: slow."""
    for item in items:
        if "smollm_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _embedded_model_in_slow_tests_only(request, monkeypatch):
    """``slow`` means "runs the real embedded model" (``make test-fast`` leaves those
    out): a test not marked ``slow`` or ``long`` that loads it in the test's process
    fails, saying so. (A test that loads it in a child process is marked by hand.)"""
    marks = {m.name for m in request.node.iter_markers()}
    if marks & {"slow", "long"}:
        yield
        return
    from fp4rl.models import registry

    loaded: list[str] = []
    load_cached = registry.load_cached

    def recording(name, *args, **kwargs):
        loaded.append(name)
        return load_cached(name, *args, **kwargs)

    monkeypatch.setattr(registry, "load_cached", recording)
    yield
    if loaded:
        pytest.fail(f"loads the embedded model {loaded[0]!r}: mark it @pytest.mark.slow")


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The embedded model as a Hugging Face directory vLLM loads (the vLLM and verl
    suites)."""
    from fp4rl.integrations.vllm import model_dir

    return model_dir("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A saved tiny random Llama and its tokenizer: a checkpoint directory the commands
    load by path, as they would a real Hugging Face model. Tests only read it."""
    from fp4rl.models import tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    model, tok = tiny_model("llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
