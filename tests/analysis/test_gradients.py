"""Gradient-side diagnostics: the measures against independent formulas, the probe
against the layer's own GEMMs, the GRPO objective, and the command on a tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import fp4rl
from fp4rl.analysis import gradients as G
from fp4rl.cli import main
from fp4rl.models import tiny_model
from fp4rl.nn import FP4Linear, Recipe, TrainPrecision, fp4_layers, get_recipe, quantize_model
from fp4rl.rl.grpo import LossConfig, grpo_loss
from fp4rl.rl.logprobs import response_logprobs
from fp4rl.rollout import RolloutBatch


def _np_sqnr(approx: torch.Tensor, ref: torch.Tensor) -> float:
    r, a = ref.double().numpy(), approx.double().numpy()
    return float(10 * np.log10(np.sum(r * r) / np.sum((a - r) ** 2)))


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_sqnr_and_cosine_match_independent_formulas():
    ref = torch.ones(100)
    assert G.sqnr_db(ref * 1.1, ref) == pytest.approx(20.0)  # noise 1, signal 100
    assert G.sqnr_db(ref, ref) == math.inf
    x, y = _randn(50, 30, seed=0), _randn(50, 30, seed=1)
    assert G.sqnr_db(x + 0.1 * y, x) == pytest.approx(_np_sqnr(x + 0.1 * y, x))
    a, b = x.double().numpy().ravel(), y.double().numpy().ravel()
    want = float(a @ b / np.sqrt((a @ a) * (b @ b)))
    assert G.cosine(x, y) == pytest.approx(want)
    assert G.cosine(x, -2 * x) == pytest.approx(-1.0)
    assert math.isnan(G.cosine(x, torch.zeros_like(x)))


@pytest.mark.parametrize("scheme", ["requantize", "reuse_forward"])
def test_gemm_stats_match_independent_products(scheme):
    x, w, dy = _randn(96, 128, seed=2), _randn(64, 128, seed=3), _randn(96, 64, seed=4)
    dy[:10] = 0.0  # rows reaching no loss term
    p = TrainPrecision(weights="hif4", activations="hif4", gradients="hif4",
                       backward_operands=scheme)
    q = lambda t, d: fp4rl.quantize(t, "hif4", dim=d)  # noqa: E731
    w_axis, x_axis = (0, 0) if scheme == "requantize" else (-1, -1)
    assert G.forward_sqnr(x, w, p) == pytest.approx(_np_sqnr(q(x, -1) @ q(w, -1).t(), x @ w.t()))
    sqnr, zeros = G.backward_stats(x, w, dy, p)
    assert sqnr["dX"] == pytest.approx(_np_sqnr(q(dy, -1) @ q(w, w_axis), dy @ w))
    assert sqnr["dW"] == pytest.approx(_np_sqnr(q(dy, 0).t() @ q(x, x_axis), dy.t() @ x))
    assert 5 < sqnr["dX"] < 40 and 5 < sqnr["dW"] < 40
    assert zeros["dY"] == pytest.approx(10 / 96)
    for gemm, dim in (("dX", -1), ("dW", 0)):
        qdy = q(dy, dim)
        assert zeros[f"QdY_{gemm}"] == pytest.approx((qdy == 0).double().mean().item())
        flushed = ((qdy == 0) & (dy != 0)).sum().item() / (dy != 0).sum().item()
        assert zeros[f"flushed_{gemm}"] == pytest.approx(flushed)
        assert 0 < zeros[f"flushed_{gemm}"] < zeros[f"QdY_{gemm}"] < 1


def test_unquantized_gemms_have_infinite_sqnr():
    x, w, dy = _randn(32, 64, seed=5), _randn(64, 64, seed=6), _randn(32, 64, seed=7)
    p = TrainPrecision()
    assert G.forward_sqnr(x, w, p) == math.inf
    sqnr, zeros = G.backward_stats(x, w, dy, p)
    assert sqnr == {"dX": math.inf, "dW": math.inf}
    assert zeros["flushed_dX"] == zeros["flushed_dW"] == 0


@pytest.mark.parametrize("scheme", ["requantize", "reuse_forward"])
def test_probe_measures_the_gemms_the_layer_computed(scheme):
    """The probe's dX and dW SQNRs are those of the gradients the layer itself produced."""
    torch.manual_seed(0)
    train = TrainPrecision(weights="mxfp4", activations="mxfp4", gradients="mxfp4",
                           backward_operands=scheme)
    layer = FP4Linear.from_linear(nn.Linear(128, 64, bias=False), Recipe(train=train))
    x, dy = _randn(2, 48, 128, seed=8).requires_grad_(), _randn(2, 48, 64, seed=9)
    with G.GemmProbe(layer) as probe:
        y = layer(x)
        y.backward(dy)
    x2, g, w = x.detach().reshape(-1, 128), dy.reshape(-1, 64), layer.weight.detach()
    stats = probe.sqnr[""]
    assert stats["Y"] == pytest.approx(G.sqnr_db(y.detach().reshape(-1, 64), x2 @ w.t()))
    assert stats["dX"] == pytest.approx(G.sqnr_db(x.grad.reshape(-1, 128), g @ w))
    assert stats["dW"] == pytest.approx(G.sqnr_db(layer.weight.grad, g.t() @ x2))


@pytest.fixture(scope="module")
def tiny_batch():
    torch.manual_seed(0)
    model, tok = tiny_model("llama")
    batch = G.sample_batch(model, tok, "hif4", prompts=2, group=3, max_new_tokens=12)
    return model, batch


def test_surrogate_has_the_gradient_of_the_grpo_loss(tiny_batch):
    """At ratio 1 (pi_old = pi_theta, the first update step) GRPO's clipped loss with
    token-level TIS has the gradient of the fixed-weight surrogate."""
    model, batch = tiny_batch
    quantize_model(model, get_recipe("hif4"))
    grads = []
    for use_grpo in (False, True):
        model.zero_grad(set_to_none=True)
        if use_grpo:
            with fp4rl.train_mode(model):
                logp, _ = response_logprobs(model, batch.ids, batch.attention,
                                            batch.prompt_width, batch.temperature)
            rollout = logp.detach() - batch.weights.log()  # weights = min(pi_old/mu, C)
            loss, _ = grpo_loss(logp, logp.detach(), rollout, batch.advantages, batch.mask,
                                LossConfig())
            loss = loss * batch.scale
        else:
            loss = G.surrogate_loss(model, batch)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)
    assert grads[0].abs().sum() > 0


def test_batch_keeps_the_sequences_with_advantage(monkeypatch):
    """As the trainer, the batch leaves out zero-advantage groups and keeps the loss's
    denominator (scale = kept share), without padding columns no kept row needs."""
    torch.manual_seed(0)
    model, tok = tiny_model("qwen2")
    calls = iter(range(100))
    monkeypatch.setattr(G, "get_reward", lambda _: lambda *_: float(next(calls) == 1))
    batch = G.sample_batch(model, tok, "mxfp4", prompts=3, group=2, max_new_tokens=10)
    assert batch.rewards.tolist() == [0, 1, 0, 0, 0, 0]
    assert batch.advantage_source == "group-normalized rewards"
    assert batch.ids.shape[0] == 2 and batch.scale == pytest.approx(1 / 3)
    assert (batch.advantages != 0).all() and batch.advantages[1] > 0 > batch.advantages[0]
    assert batch.attention[:, 0].any() and batch.mask[:, -1].any()  # no all-padding column


def test_batch_keeps_at_most_max_sequences_whole_groups():
    torch.manual_seed(0)
    model, tok = tiny_model("llama")
    batch = G.sample_batch(model, tok, "hif4", prompts=3, group=2, max_new_tokens=6,
                           max_sequences=5)
    assert batch.advantage_source.startswith("random")  # a random model answers nothing
    assert batch.ids.shape[0] == 4 and batch.scale == pytest.approx(4 / 6)


def test_rows_drop_padding_only():
    ids = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [0, 0, 0, 4]])
    pmask = (ids != 0).long()
    rids = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]])
    rmask = (rids != 0).long()
    rollout = RolloutBatch(ids, pmask, rids, rmask, rmask.float(), torch.ones(3, dtype=bool))
    kept = G._rows(rollout, torch.tensor([0, 1]))
    assert kept.prompt_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert kept.response_ids.tolist() == [[1, 2], [3, 0]]
    assert kept.response_mask.tolist() == [[1, 1], [1, 0]]


def test_advantages_fall_back_to_random_signs_without_signal():
    adv, source = G._advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), 3, seed=0)
    assert source == "group-normalized rewards" and adv[0] > 0 > adv[1]
    adv, source = G._advantages(torch.zeros(6), 3, seed=0)
    assert source.startswith("random +/-1") and set(adv.tolist()) <= {-1.0, 1.0}


def test_diagnosis_on_a_tiny_model(tiny_batch):
    model, batch = tiny_batch
    reference, probe = G.variant_gradients(model, batch, TrainPrecision(), probe=True)
    assert all(v == math.inf for s in probe.sqnr.values() for v in s.values())
    again, _ = G.variant_gradients(model, batch, TrainPrecision())
    assert G._total_cosine(reference, again, list(reference)) == pytest.approx(1.0)
    (result,) = [G.diagnose_format(model, batch, "hif4", reference)]
    assert len(result.layers) == len(fp4_layers(model)) == 14
    for layer in result.layers:
        for scheme in G.SCHEMES:
            assert set(layer.gemm_sqnr[scheme]) == set(G.GEMMS)
            assert all(3 < v < 60 for v in layer.gemm_sqnr[scheme].values())
            assert all(0 <= v <= 1 for v in layer.zeros[scheme].values())
        cosines = [c for inner in layer.grad_cosine.values() for c in inner.values()]
        assert all(-1 <= c <= 1 for c in cosines)
    assert set(result.update_cosine) == set(G.variants("hif4"))
    assert set(result.update_cosine["fp4_forward"]) == {"bf16"}
    for cos in result.update_cosine.values():
        assert all(-1 <= c < 1 for c in cos.values())


def test_report_writes_infinity_as_null():
    record = G.report("m", {}, [G.FormatGradients("hif4", {"x": {"bf16": math.inf}})])
    assert record["formats"][0]["update_cosine"]["x"]["bf16"] is None
    json.dumps(record, allow_nan=False)


def test_diagnose_gradients_cli(tiny_llama_dir, tmp_path):
    out, js = tmp_path / "g", tmp_path / "g.json"
    assert main(["diagnose", "--gradients", "--model", str(tiny_llama_dir), "--format",
                 "nvfp4", "--n", "2", "--num-generations", "2", "--max-new-tokens", "8",
                 "--out", str(out), "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert data["batch"]["sequences"] == 4
    (fmt,) = data["formats"]
    assert fmt["format"] == "nvfp4" and len(fmt["layers"]) == 14
    assert set(fmt["layers"][0]["gemm_sqnr"]) == set(G.SCHEMES)
    assert (out / "gradient_sqnr_nvfp4.png").stat().st_size > 1000


@pytest.mark.parametrize(("argv", "message"), [
    (["--gradients", "--prompts", "p.txt"], "--prompts chooses the prompts"),
    (["--n", "3"], "only with --gradients: --n"),
    (["--gradients", "--num-generations", "1"],
     "argument --num-generations: must be at least 2, got 1"),
    (["--gradients", "--levels", "9"], "--levels: choose among [1, 2, 3"),
])
def test_diagnose_refuses_options_of_the_other_diagnosis(argv, message, capsys):
    assert main(["diagnose", *argv]) == 2
    assert message in capsys.readouterr().err
