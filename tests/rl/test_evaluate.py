"""Evaluation (Mean@k, best@k, per level) on outcomes known in advance: a scripted engine
answers each prompt, so the scoring is checked against the script."""

from __future__ import annotations

import pytest
import torch

from fp4rl.models import tiny_model


class _ScriptedEngine:
    """A rollout engine that answers each prompt's samples from a script, in order: the
    scoring is then checked on outcomes known in advance."""

    name = "scripted"

    def __init__(self, tok, answers: list[list[str]]) -> None:
        self.tok, self.answers, self.seeds, self.sampling = tok, answers, [], []

    def generate(self, chunks, seeds, sampling, progress=False):
        from fp4rl.rollout import RolloutBatch, left_pad

        self.sampling.append(sampling)

        out, pending = [], [a for row in self.answers for a in row]
        for chunk, chunk_seeds in zip(chunks, seeds, strict=True):
            self.seeds += chunk_seeds
            texts, pending = pending[:len(chunk)], pending[len(chunk):]
            ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            width = max(map(len, ids))
            response = torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in ids])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
            prompt_ids, prompt_mask = left_pad(chunk, self.tok.pad_token_id, torch.device("cpu"))
            out.append(RolloutBatch(prompt_ids, prompt_mask, response, mask,
                                    torch.zeros(response.shape),
                                    torch.ones(len(chunk), dtype=torch.bool)))
        return out


def test_mean_at_k_and_best_at_k_on_known_outcomes():
    """Prompt 0 answered right 4 times of 4, prompt 1 once, prompt 2 never: Mean@4 counts
    samples (5 of 12), best@4 prompts (2 of 3); levels average their prompts; every sample
    of every prompt has its own seed, whatever the chunking."""
    from fp4rl.data import Example
    from fp4rl.rl.evaluate import evaluate

    _, tok = tiny_model("llama")
    examples = [Example(f"What is {i} + 1?", f"#### {i + 1}", "gsm8k", "t", i,
                        {"level": 1 + (i > 0)}) for i in range(3)]
    prompts = [tok(e.prompt)["input_ids"] for e in examples]
    script = [["#### 1"] * 4, ["#### 7", "#### 2", "no", "#### 3"], ["#### 4"] * 4]
    engine = _ScriptedEngine(tok, script)
    res = evaluate(None, tok, examples, prompts, k=4, seed=0, batch_size=5, engine=engine)
    assert (res.k, res.n, res.name) == (4, 3, "mean@4")
    assert res.correct == [4, 1, 0]
    assert res.mean == pytest.approx(5 / 12) and res.best == pytest.approx(2 / 3)
    assert res.per_level == {"1": 1.0, "2": pytest.approx(0.125)}
    assert len(set(engine.seeds)) == 12


def test_k_1_decodes_greedily_and_scores_mean_at_1():
    """k=1 asks the engine for one greedy response per prompt (Mean@1), whatever
    eval.temperature says; k=4 samples at that temperature."""
    from fp4rl.data import Example
    from fp4rl.rl.evaluate import evaluate

    _, tok = tiny_model("llama")
    examples = [Example(f"What is {i} + 1?", f"#### {i + 1}", "gsm8k", "t", i, {"level": 1})
                for i in range(3)]
    prompts = [tok(e.prompt)["input_ids"] for e in examples]
    engine = _ScriptedEngine(tok, [["#### 1"], ["#### 5"], ["#### 3"]])
    greedy = evaluate(None, tok, examples, prompts, k=1, temperature=0.7, engine=engine)
    assert (greedy.name, greedy.correct, greedy.mean) == ("mean@1", [1, 0, 1],
                                                           pytest.approx(2 / 3))
    assert all(s.greedy for s in engine.sampling)
    engine = _ScriptedEngine(tok, [["#### 1"] * 4, ["#### 5"] * 4, ["#### 3"] * 4])
    sampled = evaluate(None, tok, examples, prompts, k=4, temperature=0.7, engine=engine)
    assert not any(s.greedy for s in engine.sampling)
    assert {s.temperature for s in engine.sampling} == {0.7} and sampled.mean == greedy.mean


def test_an_unresolved_mixed_precision_is_refused_not_resolved_again():
    """``auto`` is resolved once, where the device is known (the run's plan, or the
    command's edge); evaluate takes the result."""
    from fp4rl.errors import UserError
    from fp4rl.rl.evaluate import evaluate

    with pytest.raises(UserError, match="resolved mixed_precision") as err:
        evaluate(None, None, [], [], mixed_precision="auto")
    assert "\n" not in str(err.value)
