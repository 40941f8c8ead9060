"""The ``fp4rl`` method's two weight storages: the same logits bit for bit, and the memory
each takes against a plain bf16 engine (each engine measured in a fresh process)."""

from __future__ import annotations

import gc

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.cli import main  # noqa: E402
from fp4rl.integrations.vllm import EngineSpec, engine_model, make_llm  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

RECIPES = ("hif4+resq-2:4", "nvfp4")
PROMPTS = ["Question: what is 3 + 7? Answer:", "Tom has 4 apples and buys 9 more. How many?"]


@pytest.fixture(scope="module", params=RECIPES)
def exported(request, tmp_path_factory) -> tuple[str, str]:
    out = tmp_path_factory.mktemp("storage") / request.param
    assert main(["export", "--model", "smollm2-135m", "--format", "vllm", "--recipe",
                 request.param, "--output", str(out)]) == 0
    return request.param, str(out)


def logprobs(llm) -> list:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    return [[*o.prompt_logprobs[1:], *o.outputs[0].logprobs]
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def as_floats(rows: list) -> list:
    return [[{t: lp.logprob for t, lp in d.items()} for d in row] for row in rows]


def test_packed_and_dequantized_storage_give_the_same_logits(exported):
    recipe, directory = exported
    out = {}
    for storage in ("dequantized", "packed"):
        llm = make_llm(EngineSpec(directory, get_recipe(recipe), dtype=torch.bfloat16,
                                  max_model_len=256, kv_cache_bytes=128 << 20,
                                  weight_storage=storage))
        layers = [m for m in engine_model(llm).modules() if hasattr(m, "fp4rl")]
        assert layers and all(m.weight.numel() == 0 for m in layers)  # no weight beside Q(W)
        stores = {m.fp4rl.store.storage for m in layers}
        assert stores == {storage}
        out[storage] = as_floats(logprobs(llm))
        del llm
        gc.collect()
    assert out["packed"] == out["dequantized"]


@pytest.mark.long
def test_engine_memory_against_a_bf16_engine():
    """Process memory a built and refit engine adds. The default storage holds the block
    linears in exactly a bf16 engine's bytes (vLLM's prepacked weight is the one copy of
    Q(W)), and its process takes what a bf16 engine's does, give or take fp4rl's code and
    per-layer state (2%; measured: +1%); packed storage takes at least 100 MB less for
    SmolLM2-135M (4.5 bits per block-linear value, not 16). A refit moves at most half
    the model's bf16 bytes."""
    from fp4rl.bench.engine import run

    rows = {r["engine"]: r for r in run(batch=2, new_tokens=2, repeats=1)}
    mib = 2 ** 20
    print({k: round(r["rss_bytes"] / mib) for k, r in rows.items()})
    assert rows["dequantized"]["block_bytes_per_param"] == rows["bf16"]["block_bytes_per_param"]
    assert rows["dequantized"]["rss_bytes"] <= 1.02 * rows["bf16"]["rss_bytes"]
    assert rows["packed"]["rss_bytes"] <= rows["bf16"]["rss_bytes"] - 100 * mib
    assert rows["packed"]["block_bytes_per_param"] <= 0.3 * 2
    for storage in ("dequantized", "packed"):
        assert rows[storage]["refit_bytes"] <= 0.5 * rows["bf16"]["refit_bytes"]


def test_a_deleted_engine_frees_its_fp4rl_layers(smollm_dir):
    """Each fp4rl layer's loader is an attribute of the layer's own parameter. Were it to
    hold the layer strongly, the layer would sit in a reference cycle, which only the
    garbage collector frees, and vLLM freezes the collector's objects after building an
    engine: a process that builds engines one after another (benchmarks, experiment grids,
    this test suite) would keep every one."""
    import weakref

    llm = make_llm(EngineSpec(smollm_dir, get_recipe("hif4"), max_model_len=64,
                              kv_cache_bytes=32 << 20))
    state = weakref.ref(next(m.fp4rl for m in engine_model(llm).modules()
                             if hasattr(m, "fp4rl")))
    assert state() is not None
    del llm
    gc.collect()
    assert state() is None


AVX2_CHILD = """
import math, sys
import torch
from fp4rl.integrations.vllm import EngineSpec, engine_model, make_llm
from fp4rl.nn.recipe import get_recipe
if __name__ == "__main__":
    recipe = None if sys.argv[2] == "none" else get_recipe(sys.argv[2])
    llm = make_llm(EngineSpec(sys.argv[1], recipe, dtype=torch.bfloat16,
                              max_model_len=256, kv_cache_bytes=128 << 20))
    stores = [m.fp4rl.store for m in engine_model(llm).modules() if hasattr(m, "fp4rl")]
    assert recipe is None or (stores and all(k is None for s in stores for _, _, k in s.gemms()))
    from vllm import SamplingParams
    out = llm.generate(["1 + 1 ="], SamplingParams(max_tokens=4, temperature=0, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert all(math.isfinite(d[t].logprob) for t, d in zip(out.token_ids, out.logprobs))
    print("OK")
"""


def test_an_engine_starts_where_onednn_cannot_prepack_bf16(smollm_dir):
    """On a CPU without AVX-512 oneDNN cannot build vLLM's prepacked bf16 matmul: the
    store falls back to torch's GEMM, as vLLM's own linears do, instead of dying at start.
    ``ONEDNN_MAX_CPU_ISA=AVX2`` caps oneDNN, which does not make every CPU an AVX2 one (on
    Intel CPUs with AMX a plain bf16 engine dies of SIGILL under it): the fp4rl engine is
    held to a plain engine under the same environment, and skipped, with the plain
    engine's exit, where that cannot start."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    def start(recipe: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", AVX2_CHILD, smollm_dir, recipe],
                              env=env, capture_output=True, text=True, timeout=600)

    plain = start("none")
    if plain.returncode != 0 or "OK" not in plain.stdout:
        pytest.skip(f"a plain bf16 engine cannot start under ONEDNN_MAX_CPU_ISA=AVX2 on "
                    f"this CPU (exit {plain.returncode}): "
                    f"{(plain.stderr.strip().splitlines() or ['no output'])[-1][:200]}")
    run = start(RECIPES[0])
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]
