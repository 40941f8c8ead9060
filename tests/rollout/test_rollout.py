"""The rollout engine: batching, KV cache, sampling distributions and stopping."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import fp4rl
from fp4rl.models import tiny_model
from fp4rl.rollout import (
    RolloutBatch,
    SamplingConfig,
    generate,
    position_ids,
    sample_next,
)

ARCHS = ["llama", "qwen2"]
TEXTS = ["What is 2+2?", "Hi", "Count: 1 2 3", "x"]
GREEDY = SamplingConfig(greedy=True, max_new_tokens=12)


def _model(arch: str):
    # A wider init than the default makes the random model's next-token distributions
    # peaked and varied, so greedy paths differ between prompts and argmax has no near-ties.
    return tiny_model(arch, initializer_range=0.2)


def _prompts(tok) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for t in TEXTS]


def _run(model, tok, prompts, config, **kwargs) -> RolloutBatch:
    kwargs.setdefault("eos_token_ids", tok.eos_token_id)
    return generate(model, prompts, config, pad_token_id=tok.pad_token_id, **kwargs)


def _response(batch: RolloutBatch, row: int) -> list[int]:
    return batch.response_ids[row, : int(batch.response_lengths()[row])].tolist()


def _teacher_forced_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """Logits predicting each response token, from one forward over prompt + response."""
    ids, mask = batch.sequences()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    start = batch.prompt_ids.shape[1] - 1
    return logits[:, start:start + batch.response_ids.shape[1]].float()


def _reference_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                        ) -> list[dict[int, float]]:
    """Per row, the allowed tokens and their log-probs, computed one token at a time."""
    rows = []
    for row in logits.double():
        probs = (row / temperature).softmax(dim=-1).tolist()
        ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
        if top_k:
            ranked = ranked[:top_k]
        mass = sum(probs[i] for i in ranked)
        kept, cumulative = [], 0.0
        for i in ranked:
            kept.append(i)
            cumulative += probs[i] / mass
            if cumulative >= top_p:
                break
        total = sum(probs[i] for i in kept)
        rows.append({i: math.log(probs[i] / total) for i in kept})
    return rows


# --------------------------------------------------------------------------- batching


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_equals_each_prompt_alone(arch):
    model, tok = _model(arch)
    prompts = _prompts(tok)
    assert len({len(p) for p in prompts}) > 1, "prompts must need left padding"
    batch = _run(model, tok, prompts, GREEDY)
    assert (batch.prompt_mask[:, 0] == 0).any() and (batch.prompt_mask[:, -1] == 1).all()
    for row, prompt in enumerate(prompts):
        alone = _run(model, tok, [prompt], GREEDY)
        assert _response(batch, row) == _response(alone, 0)
        n = len(_response(alone, 0))
        torch.testing.assert_close(batch.logprobs[row, :n], alone.logprobs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_micro_batches_match_one_batch(arch):
    model, tok = _model(arch)
    prompts = _prompts(tok)
    whole = _run(model, tok, prompts, GREEDY)
    split = _run(model, tok, prompts, GREEDY, batch_size=3)
    for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "finished"):
        assert torch.equal(getattr(whole, field), getattr(split, field)), field
    torch.testing.assert_close(whole.logprobs, split.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(arch):
    model, tok = _model(arch)
    prompt = _prompts(tok)[0]
    config = SamplingConfig(greedy=True, max_new_tokens=20)
    ours = _run(model, tok, [prompt], config)
    theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                            do_sample=False, max_new_tokens=20, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    assert _response(ours, 0) == theirs[0, len(prompt):].tolist()


def test_the_kv_cache_goes_by_the_installed_transformers_name(caplog):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` and warns on the old name
    at every forward: the engine must pass whichever name the model takes, silently."""
    model, tok = _model("llama")
    caplog.set_level(logging.WARNING, logger="transformers")
    batch = _run(model, tok, _prompts(tok)[:2] * 2, SamplingConfig(greedy=True, max_new_tokens=6))
    assert batch.response_ids.shape[1] == 6
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text


# --------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_equal_teacher_forced_forward(arch):
    model, tok = _model(arch)
    prompts = _prompts(tok)
    # A frequent token as an extra EOS makes rows finish at different steps, so the
    # comparison also covers dropping finished rows from the cache.
    probe = _run(model, tok, prompts, SamplingConfig(max_new_tokens=16),
                 generator=torch.Generator().manual_seed(1))
    frequent = int(probe.response_ids[probe.response_mask.bool()].mode().values)
    batch = _run(model, tok, prompts, SamplingConfig(max_new_tokens=16),
                 eos_token_ids=[tok.eos_token_id, frequent],
                 generator=torch.Generator().manual_seed(1))
    lengths = batch.response_lengths()
    assert lengths.min() < lengths.max(), "rows should stop at different steps"

    logits = _teacher_forced_logits(model, batch)
    expected = logits.log_softmax(-1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    expected = expected * batch.response_mask
    torch.testing.assert_close(batch.logprobs, expected, atol=1e-4, rtol=0)
    assert batch.logprobs.dtype == torch.float32


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(0.7, 5, 1.0), (1.3, 0, 0.6), (0.8, 10, 0.7)])
def test_filtered_logprobs_and_support(arch, temperature, top_k, top_p):
    model, tok = _model(arch)
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=16)
    batch = _run(model, tok, _prompts(tok), config, generator=torch.Generator().manual_seed(0))
    logits = _teacher_forced_logits(model, batch)
    for row in range(len(TEXTS)):
        n = int(batch.response_lengths()[row])
        allowed = _reference_logprobs(logits[row, :n], temperature, top_k, top_p)
        for step, token in enumerate(_response(batch, row)):
            assert token in allowed[step]
            assert batch.logprobs[row, step].item() == pytest.approx(allowed[step][token],
                                                                     abs=1e-4)


def test_sample_next_matches_reference_on_random_logits():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3)) * 3
    config = SamplingConfig(temperature=0.9, top_k=12, top_p=0.8)
    tokens, logprobs = sample_next(logits, config, torch.Generator().manual_seed(4))
    for row, allowed in enumerate(_reference_logprobs(logits, 0.9, 12, 0.8)):
        assert tokens[row].item() in allowed
        assert logprobs[row].item() == pytest.approx(allowed[tokens[row].item()], abs=1e-5)


def test_greedy_logprob_is_unscaled_softmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    config = SamplingConfig(greedy=True, temperature=0.1, top_k=2)
    tokens, logprobs = sample_next(logits, config)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).max(-1).values)


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_samples_other_seed_differs(arch):
    model, tok = _model(arch)
    config = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=16)

    def sample(seed: int) -> RolloutBatch:
        generator = torch.Generator().manual_seed(seed)
        return _run(model, tok, _prompts(tok), config, generator=generator)

    first, again, other = sample(7), sample(7), sample(8)
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.equal(first.logprobs, again.logprobs)
    responses = [_response(first, row) for row in range(len(TEXTS))]
    assert responses != [_response(other, row) for row in range(len(TEXTS))]


# --------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_stops_a_row(arch):
    model, tok = _model(arch)
    prompts = _prompts(tok)
    free = _run(model, tok, prompts, GREEDY, eos_token_ids=[])
    assert not free.finished.any()
    eos = _response(free, 0)[3]  # a token row 0 emits, used as EOS: row 0 stops there
    stopped = _run(model, tok, prompts, GREEDY, eos_token_ids=eos)
    for row in range(len(prompts)):
        full = _response(free, row)
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert _response(stopped, row) == expected
        assert stopped.finished[row].item() == (eos in full)
        n = len(expected)
        assert stopped.response_mask[row, :n].all() and not stopped.response_mask[row, n:].any()
        assert (stopped.response_ids[row, n:] == tok.pad_token_id).all()
        assert not stopped.logprobs[row, n:].any()
    assert stopped.finished[0]
    assert len(_response(stopped, 0)) <= 4


@pytest.mark.parametrize("arch", ARCHS)
def test_max_new_tokens_limits_length(arch):
    model, tok = _model(arch)
    batch = _run(model, tok, _prompts(tok), SamplingConfig(greedy=True, max_new_tokens=5),
                 eos_token_ids=[])
    assert batch.response_ids.shape == (len(TEXTS), 5)
    assert batch.response_lengths().tolist() == [5] * len(TEXTS)
    assert not batch.finished.any()


@pytest.mark.parametrize("arch", ARCHS)
def test_stops_early_when_every_row_finished(arch):
    model, tok = _model(arch)
    prompts = _prompts(tok)
    firsts = _run(model, tok, prompts, SamplingConfig(greedy=True, max_new_tokens=1))
    eos = sorted(set(firsts.response_ids[:, 0].tolist()))
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        batch = _run(model, tok, prompts, SamplingConfig(greedy=True, max_new_tokens=50),
                     eos_token_ids=eos)
    finally:
        handle.remove()
    assert len(calls) == 1  # the prompt pass only
    assert batch.finished.all()
    assert batch.response_ids.shape == (len(prompts), 1)


# --------------------------------------------------------------------------- batch helpers


def test_batch_helpers():
    model, tok = _model("llama")
    prompts = _prompts(tok)
    batch = _run(model, tok, prompts, GREEDY)
    ids, mask = batch.sequences()
    assert ids.shape == mask.shape == (len(prompts),
                                       batch.prompt_ids.shape[1] + batch.response_ids.shape[1])
    for row, prompt in enumerate(prompts):
        assert ids[row][mask[row].bool()].tolist() == prompt + _response(batch, row)
    texts = batch.texts(tok)
    assert texts == [tok.decode(_response(batch, r), skip_special_tokens=True)
                     for r in range(len(prompts))]
    assert all("<|im_end|>" not in t for t in texts)


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_progress_callback_and_bar(capsys):
    model, tok = _model("llama")
    seen: list[int] = []
    batch = _run(model, tok, _prompts(tok), GREEDY, eos_token_ids=[], progress=seen.append)
    assert seen == [len(TEXTS)] * GREEDY.max_new_tokens
    assert sum(seen) == int(batch.response_lengths().sum())
    _run(model, tok, _prompts(tok), GREEDY, progress=True)
    assert "rollout" in capsys.readouterr().err


# --------------------------------------------------------------------------- FP4 policy


@pytest.mark.parametrize("arch", ARCHS)
def test_runs_on_patched_model_in_rollout_mode(arch):
    model, tok = _model(arch)
    prompts = _prompts(tok)
    config = SamplingConfig(temperature=1.0, max_new_tokens=12)
    reference = _run(model, tok, prompts, config, generator=torch.Generator().manual_seed(0))
    fp4rl.quantize_model(model, "hif4+resq-2:4")
    with fp4rl.rollout_mode(model):
        batch = _run(model, tok, prompts, config, generator=torch.Generator().manual_seed(0))
        logits = _teacher_forced_logits(model, batch)
    assert torch.isfinite(batch.logprobs).all()
    assert not torch.equal(batch.logprobs, reference.logprobs), "rollout policy not in effect"
    expected = logits.log_softmax(-1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(batch.logprobs, expected * batch.response_mask,
                               atol=1e-3, rtol=0)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_sampling_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_greedy_allows_zero_temperature():
    assert SamplingConfig(greedy=True, temperature=0.0).greedy


def test_generate_rejects_bad_arguments():
    model, tok = _model("llama")
    with pytest.raises(ValueError, match="at least one prompt"):
        _run(model, tok, [], GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        _run(model, tok, [[1, 2], []], GREEDY)
    with pytest.raises(ValueError, match="batch_size"):
        _run(model, tok, [[1, 2]], GREEDY, batch_size=0)
