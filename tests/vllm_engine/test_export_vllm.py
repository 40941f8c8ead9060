"""``fp4rl export --format vllm`` served by plain ``vllm.LLM(model=DIR)``: the plug-in is
found through its entry point, and the engine runs the same policy as ``make_llm``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.cli import main  # noqa: E402
from fp4rl.integrations.vllm import EngineSpec, engine_model, make_llm  # noqa: E402

RECIPE = "hif4+resq-2:4"
PROMPTS = ["What is 45 - 18?", "Tom has 12 apples and buys 7 more. How many apples",
           "A train travels 60 km per hour for 3 hours. How far does it go?"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("vllm-export") / "smollm2-135m"
    assert main(["export", "--model", "smollm2-135m", "--format", "vllm", "--recipe", RECIPE,
                 "--output", str(out)]) == 0
    return str(out)


def greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_llm_serves_the_export_as_make_llm_runs_it(exported, smollm_dir):
    from vllm import LLM

    config = json.loads(Path(exported, "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp4rl"
    served = LLM(model=exported, dtype=torch.bfloat16, seed=0, kv_cache_memory_bytes=1 << 30,
                 enforce_eager=True, max_model_len=512)
    layers = [m for m in engine_model(served).modules()
              if getattr(m, "fp4rl_shards", None) is not None]
    assert len(layers) == 30 * 4  # qkv, o, gate_up, down in each of the 30 blocks
    assert all(m.weight.dtype == torch.float32 for m in layers)
    out = greedy(served)
    assert all(len(ids) == 24 for ids in out)
    reference = make_llm(EngineSpec(smollm_dir, RECIPE, dtype=torch.bfloat16, seed=0,
                                    max_model_len=512))
    assert greedy(reference) == out
