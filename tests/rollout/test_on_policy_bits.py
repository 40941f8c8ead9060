"""On-policy to the bit: under ``batch_invariant`` the engine's reported log-probs are the
trainer's, bit for bit, wherever a recipe makes the two policies one function.

The engine prefills each distinct prompt once, left-padded to its micro-batch, then
decodes one token per running row against its KV cache, rows dropping out at EOS; the
trainer scores ``[left-padded prompt | right-padded response]`` in micro-batches of any
size. Every one of those shapes must give a token the same bits.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np
import pytest
import torch

import fp4rl
from fp4rl.kernels.cpu import _Panels, bi_gemm, bi_softmax, drop_panels, keep_panels, load_library
from fp4rl.models import tiny_model
from fp4rl.nn import FP4Linear, Mode, get_recipe, quantize_model
from fp4rl.nn.invariant import is_batch_invariant, tokens_fed
from fp4rl.nn.recipe import scale_rule
from fp4rl.rl.logprobs import response_logprobs
from fp4rl.rollout.batch import RolloutBatch, SamplingConfig
from fp4rl.rollout.kv_cache import generate
from fp4rl.rollout.sampling import row_generators

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: recipes whose two policies are one function and whose activation scales are row-local
ROW_LOCAL = ["bf16", "hif4", "mxfp4", "nvfp4_per_token", "miles-nvfp4"]
#: per-tensor NVFP4 recipes: one function with a static second-level scale
PER_TENSOR = ["nvfp4", "nemo-rl-nvfp4", "torchao-nvfp4"]
EOS = [2, 7, 9]


def _model(recipe: str, scale: str, invariant: bool, layers: int = 2) -> torch.nn.Module:
    """A tiny random Llama (8 blocks where a recipe leaves boundary blocks in BF16)."""
    model = tiny_model("llama", num_hidden_layers=layers)[0].eval()
    return quantize_model(model, get_recipe(recipe).with_nvfp4_scale(scale_rule(scale)),
                          batch_invariant=invariant)


def _prompts() -> list[list[int]]:
    """Three prompts of different lengths, a group of three samples each."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 128, (n,), generator=g).tolist() for n in (5, 9, 13)]
    return [p for p in prompts for _ in range(3)]


def _autocast(dtype: torch.dtype) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def _rollout(model: torch.nn.Module, dtype: torch.dtype, prompts: list[list[int]],
             pad: int = 3, eos: list[int] = EOS, new_tokens: int = 12) -> RolloutBatch:
    """The engine's rollout of ``prompts`` (one prefill per distinct prompt, then KV-cache
    decode steps, rows dropping out at EOS), each row under its own seed."""
    with torch.no_grad(), fp4rl.rollout_mode(model), _autocast(dtype):
        return generate(model, prompts, SamplingConfig(max_new_tokens=new_tokens), pad_token_id=pad,
                        eos_token_ids=eos, generator=row_generators(range(len(prompts))))


def _scored(model: torch.nn.Module, batch: RolloutBatch, dtype: torch.dtype,
            micro_batches: tuple[int, ...], policy=fp4rl.train_mode) -> list[torch.Tensor]:
    """The log-probs of ``batch``'s sampled tokens as the trainer scores them, in ``policy``,
    at each micro-batch size (the response tokens alone)."""
    ids, attention = batch.sequences()
    mask = batch.response_mask.bool()
    scored = []
    with torch.no_grad(), policy(model), _autocast(dtype):
        for size in micro_batches:
            parts = [response_logprobs(model, ids[i:i + size], attention[i:i + size],
                                       batch.prompt_ids.shape[1])[0]
                     for i in range(0, len(ids), size)]
            scored.append(torch.cat(parts)[mask])
    return scored


def _engine_and_trainer(model: torch.nn.Module, dtype: torch.dtype,
                        micro_batches: tuple[int, ...] = (9, 4, 1)
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The engine's log-probs of its sampled tokens, and the trainer's log-probs of the
    same tokens at each micro-batch size."""
    batch = _rollout(model, dtype, _prompts())
    assert not bool(batch.finished.all()) and bool(batch.finished.any())  # EOS mid-batch
    return batch.logprobs[batch.response_mask.bool()], _scored(model, batch, dtype,
                                                               micro_batches)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("recipe", ROW_LOCAL)
def test_row_local_recipes_score_the_engines_tokens_with_its_bits(recipe, dtype):
    engine, trainer = _engine_and_trainer(_model(recipe, "dynamic", True), dtype)
    for scored in trainer:
        assert torch.equal(scored, engine)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("recipe", PER_TENSOR)
def test_per_tensor_nvfp4_with_a_static_scale_scores_with_the_engines_bits(recipe, dtype):
    layers = 8 if recipe == "nemo-rl-nvfp4" else 2  # it keeps the first 2 and last 4 in BF16
    engine, trainer = _engine_and_trainer(_model(recipe, "static", True, layers), dtype)
    for scored in trainer:
        assert torch.equal(scored, engine)


def test_a_dynamic_per_tensor_scale_differs_by_definition():
    """The trainer's batch holds prompts and responses, a decode step one token: the
    batch-wide amax differs, and with it the tokens' scores (docs/training.md)."""
    engine, trainer = _engine_and_trainer(_model("nvfp4", "dynamic", True), torch.float32,
                                          (9,))
    assert not torch.equal(trainer[0], engine)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_resq_the_rollout_policy_scored_by_the_trainer_reproduces_the_engine(dtype):
    """ResQ's two policies differ by design: the trainer scoring with the rollout policy
    reproduces the engine to the bit, so what is left is that designed mismatch."""
    model = _model("hif4+resq-2:4", "dynamic", True)
    batch = _rollout(model, dtype, _prompts())
    engine = batch.logprobs[batch.response_mask.bool()]
    [rollout_scored] = _scored(model, batch, dtype, (9,), fp4rl.rollout_mode)
    [train_scored] = _scored(model, batch, dtype, (9,))
    assert torch.equal(rollout_scored, engine)
    assert not torch.equal(train_scored, engine)


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "scale", "dtype"), [
    ("hif4", "dynamic", torch.float32), ("torchao-nvfp4", "static", torch.bfloat16)])
def test_the_embedded_model_scores_the_engines_tokens_with_its_bits(recipe, scale, dtype):
    """SmolLM2-135M: four built-in prompts of different lengths, three samples each."""
    from fp4rl.analysis.prompts import BUILTIN_PROMPTS, encode_prompts
    from fp4rl.models import load_model

    model, tok = load_model("smollm2-135m")
    quantize_model(model.eval(), get_recipe(recipe).with_nvfp4_scale(scale_rule(scale)),
                   batch_invariant=True)
    prompts = [p.reshape(-1).tolist() for p in encode_prompts(tok, BUILTIN_PROMPTS[:4])]
    batch = _rollout(model, dtype, [p for p in prompts for _ in range(3)], tok.pad_token_id,
                     [tok.eos_token_id], 16)
    engine = batch.logprobs[batch.response_mask.bool()]
    for scored in _scored(model, batch, dtype, (12, 5)):
        assert torch.equal(scored, engine)


def test_the_gemms_a_gpu_runs_are_the_ops_vllms_batch_invariant_mode_replaces():
    """fp4rl's GEMM (the vLLM method's on a GPU, where no prepacked CPU kernel applies)
    issues ``aten.mm`` / ``aten.addmm`` alone: the ops vLLM's batch-invariant mode
    (``VLLM_BATCH_INVARIANT=1``) replaces, so the method is batch-invariant under it. On a
    CPU a bf16 GEMM with an fp32 output is ``fp4rl::c_mm_fp32``, batch-invariant itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp4rl.gemm import mm, quantize_operand

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(32, 64, generator=g)
    bias = torch.randn(32, generator=g)
    for fmt in ("hif4", "nvfp4", "nvfp4_per_token"):
        for dtype in (torch.bfloat16, torch.float32):
            qx = quantize_operand(x, fp4rl.get_format(fmt)).to(dtype)
            qw = quantize_operand(w, get_recipe(fmt).rollout.weights).to(dtype)
            with Ops() as ops:
                mm([qx, qx], qw.t(), dtype, bias.to(dtype))  # ResQ's two terms
                mm(qx, qw.t(), dtype, bias.to(dtype))
            gemms = {op for op in ops.seen if "mm" in op or "matmul" in op or "dot" in op}
            # on a CPU, bf16 with an fp32 output is fp4rl's own fixed-order GEMM (which no
            # mode need replace: tests/kernels/test_invariant_*.py); a GPU's is aten.mm
            allowed = {"aten.mm", "aten.addmm", "fp4rl.c_mm_fp32"}
            assert gemms and gemms <= allowed, (fmt, dtype, gemms)


def _gemm_depends_on_rows() -> bool:
    """Whether this machine's default fp32 GEMM gives one row different bits alone than
    beside others, at the tiny model's shapes (most BLAS libraries do)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 64, generator=g), torch.randn(128, 64, generator=g)
    together = x @ w.t()
    alone = torch.cat([x[i:i + 1] @ w.t() for i in range(len(x))])
    return not torch.equal(together, alone)


def test_without_batch_invariance_the_scores_drift():
    """The same comparison with ``batch_invariant: false`` shows today's mismatch, where
    the machine's GEMM depends on its row count (the test must be able to fail)."""
    if not _gemm_depends_on_rows():
        pytest.skip("this machine's fp32 GEMM gives a row the same bits at any row count")
    engine, trainer = _engine_and_trainer(_model("bf16", "dynamic", False), torch.float32)
    assert not all(torch.equal(scored, engine) for scored in trainer)


def test_the_model_keeps_its_flag_and_a_plain_model_takes_it_too():
    model = _model("hif4", "dynamic", True)
    assert is_batch_invariant(model)
    assert model.config._attn_implementation == "eager"
    quantize_model(model, get_recipe("hif4"))  # None leaves it as it is
    assert is_batch_invariant(model)
    plain = fp4rl.set_batch_invariant(tiny_model("qwen2")[0].eval())
    ids = torch.randint(10, 128, (4, 11))
    with torch.no_grad():
        together = plain(ids).logits
        alone = torch.cat([plain(ids[i:i + 1]).logits for i in range(4)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("mode", ["train", "rollout"])
def test_pad_rows_stay_out_of_a_layers_per_tensor_scale(mode):
    """A pad row of huge activations beside real rows: the real rows' outputs are those of
    the real rows alone, in either policy."""
    layer = FP4Linear(64, 32, recipe=get_recipe("nvfp4"))
    layer.mode = Mode(mode)
    g = torch.Generator().manual_seed(5)
    real = torch.randn(1, 5, 64, generator=g)
    padded = torch.cat([torch.randn(1, 3, 64, generator=g) * 1e4, real], dim=1)
    rows = torch.tensor([False] * 3 + [True] * 5)
    with torch.no_grad():
        with tokens_fed(torch.ones(5, dtype=torch.bool)):
            alone = layer(real)
        with tokens_fed(rows):
            beside = layer(padded)[:, 3:]
        unmasked = layer(padded)[:, 3:]
    assert torch.equal(alone, beside)
    assert not torch.equal(alone, unmasked)


def test_a_left_padded_prompt_scores_as_the_prompt_alone_under_a_per_tensor_scale():
    """The model's forward tells its layers which rows are padding (from the attention
    mask): a prompt left-padded with a token of spiky activations scores as it does
    alone."""
    model = _model("nvfp4", "dynamic", True)
    embed = model.get_input_embeddings()
    embed.weight.data[3] = 0.0
    embed.weight.data[3, 0] = 1.0  # after RMSNorm: one component of sqrt(hidden)
    ids = torch.randint(10, 128, (1, 9))
    padded = torch.cat([torch.full((1, 4), 3), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)],
                     dim=1)
    with torch.no_grad(), fp4rl.rollout_mode(model):
        alone = model(ids, attention_mask=torch.ones_like(ids)).logits
        beside = model(padded, attention_mask=mask,
                       position_ids=(mask.cumsum(1) - 1).clamp_min(0)).logits[:, 4:]
    assert torch.equal(alone, beside)


# ----- the kernels, against an independent slow path ---------------------------------

def _fma32(a: float, b: float, c: float) -> np.float32:
    """IEEE 754's fusedMultiplyAdd in float32, ``a * b + c`` rounded once to nearest even,
    from the exact rational value (an independent slow path: no hardware FMA)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:  # an exact zero sum is +0 unless both terms are -0
        negative = math.copysign(1.0, a) * math.copysign(1.0, b) < 0 and math.copysign(1.0, c) < 0
        return np.float32(-0.0 if negative else 0.0)
    guess = np.float32(float(exact))
    near = [np.nextafter(guess, np.float32(-np.inf)), guess,
            np.nextafter(guess, np.float32(np.inf))]
    return min(near, key=lambda v: (abs(Fraction(float(v)) - exact),
                                    int(np.array(v).view(np.int32)) & 1))


def _sequential(a: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    """The batch-invariant GEMM's definition, one output at a time in float32: products
    summed in increasing k by fused multiply-adds, in runs of ``chunk`` (0: one run) whose
    sums are added in order."""
    m, k = a.shape
    n = b.shape[1]
    a64, b64 = a.double().tolist(), b.double().tolist()
    out = torch.zeros(m, n, dtype=torch.float32)
    step = chunk or k
    for i in range(m):
        for j in range(n):
            total = np.float32(0.0)
            for k0 in range(0, k, step):
                part = np.float32(0.0)
                for kk in range(k0, min(k0 + step, k)):
                    part = _fma32(a64[i][kk], b64[kk][j], float(part))
                total = np.float32(total + part) if chunk else part
            out[i, j] = float(total)
    return out


def test_the_reference_fma_rounds_once():
    x = 1.0 + 2.0 ** -12  # x * x = 1 + 2^-11 + 2^-24: rounded alone, its last term is lost
    assert _fma32(x, x, -1.0) == np.float32(2.0 ** -11 + 2.0 ** -24)
    assert np.float32(np.float32(x) * np.float32(x)) - np.float32(1.0) == np.float32(2.0 ** -11)
    assert _fma32(1.0, 1.0, 2.0 ** -24) == np.float32(1.0)  # a tie: to the even neighbour
    assert _fma32(1.0, 1.0, 3 * 2.0 ** -24) == np.float32(1.0 + 2.0 ** -22)
    assert math.copysign(1.0, _fma32(-1.0, 0.0, 0.0)) == 1.0  # -0 + +0 is +0


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("chunk", [0, 4])
def test_the_gemm_is_its_definition(chunk, dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(7, 11, generator=g).to(dtype)
    w = torch.randn(19, 11, generator=g).to(dtype)
    bias = torch.randn(19, generator=g).to(dtype)
    expected = _sequential(a, w.t(), chunk)
    assert torch.equal(bi_gemm(a, w.t(), chunk=chunk, out_dtype=torch.float32), expected)
    with_bias = bi_gemm(a, w.t(), bias, chunk=chunk)
    assert torch.equal(with_bias, (expected + bias.float()).to(dtype))


def test_a_rows_result_does_not_depend_on_its_neighbours_or_the_threads():
    g = torch.Generator().manual_seed(2)
    a, w = torch.randn(37, 300, generator=g), torch.randn(70, 300, generator=g)
    together = bi_gemm(a, w.t())
    assert torch.equal(torch.cat([bi_gemm(a[i:i + 1], w.t()) for i in range(37)]), together)
    assert torch.equal(bi_gemm(torch.cat([a, a]), w.t())[37:], together)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(bi_gemm(a, w.t()), together)
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(together, a @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("m", "n", "k"), [(0, 40, 64), (5, 0, 64), (5, 40, 0)])
def test_an_empty_gemm_is_empty_or_the_bias(m, n, k, dtype):
    a, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    bias = torch.ones(n).to(dtype)
    out = bi_gemm(a, w.t(), bias)
    assert out.shape == (m, n) and torch.equal(out, bias.expand(m, n))


def test_kept_panels_give_the_same_bits_and_follow_the_weight():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(21, 256, generator=g).bfloat16()
    w = torch.randn(300, 256, generator=g).bfloat16()
    fresh = bi_gemm(a, w.t())
    with keep_panels():
        assert torch.equal(bi_gemm(a, w.t()), fresh)  # packed and kept
        assert torch.equal(bi_gemm(a[:3], w.t()), fresh[:3])  # read from the kept panels
        assert torch.equal(bi_gemm(a, w.t(), chunk=0), bi_gemm(a, w.t().contiguous(), chunk=0))
        w.mul_(2)  # a write that bumps the version: packed again
        assert torch.equal(bi_gemm(a, w.t()), bi_gemm(a, w.t().contiguous()))
        assert torch.equal(bi_gemm(a, w.t()).float(), (fresh.float() * 2))
        drop_panels()
    assert not _Panels.kept


def test_a_sequential_sum_ignores_masked_keys_anywhere():
    """P V with zero probabilities before, between and after the real keys (left padding,
    a decode step's cache) gives the real keys' bits."""
    g = torch.Generator().manual_seed(3)
    p, v = torch.rand(2, 1, 6, generator=g), torch.randn(2, 6, 8, generator=g)
    padded_p = torch.cat([torch.zeros(2, 1, 3), p, torch.zeros(2, 1, 2)], dim=2)
    padded_v = torch.cat([torch.randn(2, 3, 8, generator=g), v,
                          torch.randn(2, 2, 8, generator=g)], dim=1)
    assert torch.equal(bi_gemm(padded_p, padded_v, chunk=0), bi_gemm(p, v, chunk=0))


@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows_are_their_own(log):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 1000, generator=g) * 5
    out = bi_softmax(x, log)
    assert torch.equal(torch.cat([bi_softmax(x[i:i + 1], log) for i in range(9)]), out)
    ref = torch.log_softmax(x.double(), -1) if log else torch.softmax(x.double(), -1)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)


# ----- the GPU path: the Triton kernels, interpreted ---------------------------------

#: interpreted, a recipe takes 20 s (bf16) to 200 s (Miles's, three blocks): CI runs bf16
#: and HiF4, ``make test-long`` every one, with ``static`` NVFP4 too
TRITON_RECIPES = [pytest.param(r, s, marks={"bf16": (), "hif4": pytest.mark.slow}.get(
                      r, pytest.mark.long), id=r if s == "dynamic" else f"{r}-{s}")
                  for r, s in [*((r, "dynamic") for r in ROW_LOCAL), ("nvfp4", "static")]]


@pytest.fixture
def triton_path(monkeypatch):
    """Every kernel a GPU runs (the quantizers, the GEMMs, attention's sums, softmax and
    the row means) through Triton on CPU tensors, interpreted."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter")
    monkeypatch.setenv("FP4RL_KERNELS", "triton")
    from fp4rl.nn.invariant import invariant_backend

    assert invariant_backend("cpu") == "triton"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("recipe", "scale"), TRITON_RECIPES)
def test_on_the_triton_path_the_trainer_scores_the_engines_tokens_with_its_bits(
        triton_path, recipe, scale, dtype):
    """One block (three for Miles's recipe, which keeps boundary blocks in BF16); the
    engine's prompts left-padded by 8, 4 and 0 in its prefill, rolled out in chunks of 4
    that ``concat_batches`` re-pads; the trainer's micro-batches of 9, 4 and 1 pad them
    again otherwise. Every sampled token: the engine's bits."""
    model = _model(recipe, scale, True, layers=3 if recipe == "miles-nvfp4" else 1)
    prompts = _prompts()
    with torch.no_grad(), fp4rl.rollout_mode(model), _autocast(dtype):
        batch = generate(model, prompts, SamplingConfig(max_new_tokens=5), pad_token_id=3,
                         eos_token_ids=EOS, generator=row_generators(range(len(prompts))),
                         batch_size=4)
    engine = batch.logprobs[batch.response_mask.bool()]
    for scored in _scored(model, batch, dtype, (9, 4, 1)):
        assert torch.equal(scored, engine)
