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
from fp4rl.integrations.vllm import EngineSpec, engine_model, make_llm, refit  # noqa: E402
from fp4rl.models import load_model  # noqa: E402
from fp4rl.nn import quantize_model  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

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


def test_llm_serves_the_export_as_a_refit_engine_runs_it(exported, smollm_dir):
    """The export holds the packed Q(W) of the FP32 weights, at most half the bf16 export;
    served, it is the policy an engine refit from fp4rl's own model runs, token for token."""
    from vllm import LLM

    config = json.loads(Path(exported, "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp4rl"
    on_disk = sum(f.stat().st_size for f in Path(exported).glob("*.safetensors"))
    model, _ = load_model("smollm2-135m")
    bf16 = sum(p.numel() * 2 for p in model.parameters())  # tied lm_head counted once
    assert on_disk <= 0.5 * bf16, (on_disk, bf16)
    served = LLM(model=exported, dtype=torch.bfloat16, seed=0, kv_cache_memory_bytes=1 << 30,
                 enforce_eager=True, max_model_len=512)
    layers = [m for m in engine_model(served).modules() if hasattr(m, "fp4rl")]
    assert len(layers) == 30 * 4  # qkv, o, gate_up, down in each of the 30 blocks
    assert all(m.weight.numel() == 0 and m.fp4rl.store is not None for m in layers)
    out = greedy(served)
    assert all(len(ids) == 24 for ids in out)
    quantize_model(model, RECIPE)
    reference = make_llm(EngineSpec(smollm_dir, get_recipe(RECIPE), dtype=torch.bfloat16, seed=0,
                                    max_model_len=512))
    refit(reference, model)
    assert greedy(reference) == out
