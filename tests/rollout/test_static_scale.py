"""A static NVFP4 activation scale is one per RL step, whatever the rollout's chunking.

The engine calibrates it from every prompt of a ``generate`` before sampling (the amax of
each layer's real input rows, the layers unquantized meanwhile), so a step rolled out in
chunks of 6 and one in chunks of 2 sample from one policy, and the trainer scores their
tokens with it. Before, the first chunk's prefill fixed it: the chunking chose the policy.
"""

from __future__ import annotations

import pytest
import torch

from fp4rl.kernels.cpu import load_library
from fp4rl.models import tiny_model
from fp4rl.nn import begin_step, fp4_layers, get_recipe, quantize_model
from fp4rl.nn.recipe import scale_rule
from fp4rl.rl.logprobs import response_logprobs
from fp4rl.rollout.batch import RolloutBatch, SamplingConfig, concat_batches
from fp4rl.rollout.kv_cache import KVCacheEngine

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler")

PAD, EOS = 3, [2, 7, 9]


def _model() -> torch.nn.Module:
    model = tiny_model("llama", num_hidden_layers=2)[0].eval()
    return quantize_model(model, get_recipe("torchao-nvfp4").with_nvfp4_scale(scale_rule("static")),
                          batch_invariant=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 128, (n,), generator=g).tolist() for n in (4, 11, 7, 9, 5, 13)]
    return [p for p in prompts for _ in range(2)]  # 6 groups of 2 samples


def _rollout(model: torch.nn.Module, size: int, dtype: torch.dtype
             ) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """The step's rollout in chunks of ``size`` rows, each row under its own seed, and the
    static scale every layer was given."""
    prompts = _prompts()
    chunks = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    seeds = [list(range(i, i + len(c))) for i, c in zip(range(0, len(prompts), size), chunks,
                                                         strict=True)]
    begin_step(model)
    engine = KVCacheEngine(model, PAD, EOS, compute_dtype=dtype)
    batches = engine.generate(chunks, seeds, SamplingConfig(max_new_tokens=10))
    scales = {name: layer._static for name, layer in fp4_layers(model).items()}
    return concat_batches(batches, PAD), scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_static_scale_and_the_rollout_do_not_depend_on_the_chunking(dtype):
    model = _model()
    six, six_scales = _rollout(model, 6, dtype)
    two, two_scales = _rollout(model, 2, dtype)
    assert all(s is not None for s in six_scales.values())
    for name, scale in six_scales.items():
        assert torch.equal(scale, two_scales[name]), name
    assert torch.equal(six.response_ids, two.response_ids)
    mask = six.response_mask.bool()
    assert torch.equal(six.logprobs[mask], two.logprobs[mask])
    # the trainer scores the step's tokens with the step's scale: the engine's bits
    ids, attention = six.sequences()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                         enabled=dtype == torch.bfloat16):
        scored = torch.cat([response_logprobs(model, ids[i:i + 4], attention[i:i + 4],
                                              six.prompt_ids.shape[1])[0]
                            for i in range(0, len(ids), 4)])
    assert torch.equal(scored[mask], six.logprobs[mask])


def test_the_first_chunk_alone_would_have_given_another_scale():
    """The case the calibration closes: the scale of the first chunk's prompts alone is
    not the step's (so a first-prefill rule made the chunking choose the policy)."""
    model = _model()
    _, whole = _rollout(model, 12, torch.float32)
    prompts = _prompts()
    begin_step(model)
    engine = KVCacheEngine(model, PAD, EOS)
    engine.generate([prompts[:2]], [[0, 1]], SamplingConfig(max_new_tokens=2))
    first = {name: layer._static for name, layer in fp4_layers(model).items()}
    assert any(not torch.equal(first[name], scale) for name, scale in whole.items())


def test_an_optimizer_step_elsewhere_between_rollout_and_scoring_keeps_the_steps_scale():
    """The case the old rule lost: the scale lived with the kept ``Q(W)``, which any
    optimizer step in the process drops (the step count is process-wide), so an optimizer
    stepping between the engine's rollout and the trainer's scoring (another model's, or a
    mini-batch's own) made the trainer's first micro-batch calibrate a scale of its own:
    two policies, tenths of a nat to thousands in ``token_mult_prob_error``. Now the scale
    is the step's, and only the next step's calibration replaces it."""
    model = _model()
    batch, scales = _rollout(model, 4, torch.float32)
    other = torch.zeros(3, requires_grad=True)
    other.grad = torch.ones(3)
    torch.optim.SGD([other], lr=0.1).step()
    ids, attention = batch.sequences()
    mask = batch.response_mask.bool()
    with torch.no_grad():
        scored = response_logprobs(model, ids, attention, batch.prompt_ids.shape[1])[0]
    assert all(torch.equal(layer._static, scales[name])
               for name, layer in fp4_layers(model).items())
    assert torch.equal(scored[mask], batch.logprobs[mask])
