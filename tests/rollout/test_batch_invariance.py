"""A token's rollout log-probs do not depend on the other rows of its batch.

A serving engine under CUDA graphs pads each batch to a captured size with stale rows, and
batches requests together, so a token must score the same whatever shares its batch.
Block formats scale each block alone; NVFP4's per-tensor scale is the amax of the whole
activation, so another row moves it: ``nvfp4_per_token`` (one FP32 scale per token, as
vLLM's ``nvfp4_per_token``, NeMo-RL and Miles use) is the recipe for an engine that pads.
"""

from __future__ import annotations

import pytest
import torch

import fp4rl
from fp4rl.formats import list_formats
from fp4rl.gemm import mm, operand_format, quantize_operand
from fp4rl.models import tiny_model
from fp4rl.nn import get_recipe, quantize_model
from fp4rl.recovery import Recovery, make_recovery
from fp4rl.recovery.ops import TracedActivation

#: every quantized format, each as a whole recipe (MXFP8 serves as W4A8 activations)
RECIPES = {"hif4": "hif4", "mxfp4": "mxfp4", "nvfp4": "nvfp4",
           "nvfp4_per_token": "nvfp4_per_token", "nvfp4_4o6": "nvfp4_4o6",
           "nvfp4_per_token_4o6": "nvfp4_per_token_4o6", "nvfp4_2d": "nvfp4_2d",
           "mxfp8_e4m3": "hif4:fp4/w4a8", "nvfp4_pow2": "nvfp4_pow2",
           "nvfp4_static": "nvfp4_static", "nvfp4_per_token_pow2": "nvfp4_per_token_pow2",
           "nvfp4_per_token_4o6_pow2": "nvfp4_per_token_4o6_pow2"}
#: the formats whose scale is the whole batch's (a tile's: 16 tokens)
BATCH_SCALED = {"nvfp4", "nvfp4_4o6", "nvfp4_2d", "nvfp4_pow2"}
#: batch-scaled, but to a power of two: rows of a similar range beside them leave it as it
#: is as often as not, so only the row-local formats' equality is asserted
POW2_SCALED = {"nvfp4_pow2"}
#: a static scale is a layer's, fixed by its first forward: a layer's rows are their own
#: after it, an operator's (which keeps no scale) see the batch's
OPERATOR_BATCH_SCALED = BATCH_SCALED | {"nvfp4_static"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_every_quantized_format_is_covered():
    assert set(RECIPES) == set(list_formats()) - {"bf16"}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("recovery", ["", "+resq-2:4"])
@pytest.mark.parametrize("fmt", RECIPES)
def test_real_rows_logits_do_not_see_the_rows_padded_beside_them(fmt, recovery, dtype):
    if fmt == "nvfp4_static" and recovery:
        pytest.skip("a static scale takes no recovery method (the recipe refuses it)")
    torch.manual_seed(0)
    model = quantize_model(tiny_model("llama")[0].eval(), get_recipe(RECIPES[fmt] + recovery))
    ids = torch.randint(0, 128, (3, 12))
    garbage = torch.randint(0, 128, (2, 12))
    with fp4rl.rollout_mode(model), torch.no_grad(), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        alone = model(ids).logits
        padded = model(torch.cat([ids, garbage])).logits[:3]
    if fmt not in POW2_SCALED:
        assert torch.equal(alone, padded) is (fmt not in BATCH_SCALED)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", ["", "resq-2:4"])
@pytest.mark.parametrize("fmt", RECIPES)
def test_the_engines_activation_operator_is_row_wise(fmt, spec, dtype):
    """The operator a compiled engine runs (``fp4rl::rollout_activation``) and the GEMM
    after it, with stale rows of any magnitude after the real ones."""
    method = make_recovery(Recovery.parse(spec), operand_format(fmt), 64, 0,
                           weight_format=operand_format("hif4"))
    op = TracedActivation(method)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    stale = torch.randn(27, 64, generator=g) * 1e4
    w = quantize_operand(torch.randn(32, 64, generator=g), operand_format("hif4")).to(dtype)
    alone = mm(op(x.to(dtype), dtype), w.t(), dtype)
    padded = mm(op(torch.cat([x, stale]).to(dtype), dtype), w.t(), dtype)[:5]
    if fmt not in POW2_SCALED:
        assert torch.equal(alone, padded) is (fmt not in OPERATOR_BATCH_SCALED)
