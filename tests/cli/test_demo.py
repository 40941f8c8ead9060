"""The demo's before/after statistics: paired accuracy changes, the reward change, the
transfer to word problems, and the lines that say what the user is looking at."""

from __future__ import annotations

import io

import numpy as np
import pytest

from fp4rl.demo import (
    MEANING,
    REWARD,
    TRANSFER,
    TRANSFER_READING,
    DemoSize,
    Outcome,
    _rows,
    run_demo,
)
from fp4rl.experiments.stats import verdict
from fp4rl.rl.evaluate import EvalResult


def _result(correct: list[int], k: int = 1) -> EvalResult:
    return EvalResult(k=k, n=len(correct), mean=float(np.mean(correct)) / k,
                      best=float(np.mean(np.greater(correct, 0))), correct=correct,
                      prompts="p")


def _outcome(before: list[int], after: list[int], rewards: list[float],
             sampled: tuple[list[int], list[int]] | None = None,
             words: tuple[list[int], list[int]] | None = None) -> Outcome:
    history = [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
    history[0]["sampling/sampling_logp_difference/mean"] = 0.5
    s_before, s_after = sampled or ([0] * len(before), [0] * len(before))
    w_before, w_after = words or ([0] * len(before), [0] * len(before))
    return Outcome({"fp4": _result(before), "bf16": _result(before),
                    REWARD: _result(s_before, 4), TRANSFER: _result(w_before)},
                   {"fp4": _result(after), "bf16": _result(before),
                    REWARD: _result(s_after, 4), TRANSFER: _result(w_after)}, history)


def test_accuracy_change_is_paired_over_prompts():
    before = [0] * 80 + [1] * 20
    after = [1] * 30 + [0] * 50 + [1] * 20  # 30 prompts newly right, none lost
    change = _outcome(before, after, [0.1] * 6).change("fp4")
    assert change.mean == pytest.approx(30.0)
    assert 0 < change.lo < 30 < change.hi
    # a slow path: the same bootstrap over the per-prompt differences, by hand
    diffs = np.subtract(after, before)
    rng = np.random.default_rng(20260)
    rng.integers(0, 1, size=(4000, 1))  # the seed draw comes first (one seed)
    draws = rng.integers(0, 100, size=(4000, 100))
    slow = 100 * diffs[draws].mean(1)
    assert (change.lo, change.hi) == pytest.approx(tuple(np.percentile(slow, [2.5, 97.5])))
    assert _outcome(before, before, [0.1] * 6).change("fp4").mean == 0


def test_headline_says_what_moved_and_rows_tolerate_missing_mismatch():
    before = [0] * 90 + [1] * 10
    up = _outcome(before, [1] * 40 + [0] * 50 + [1] * 10, [0.0, 0.1, 0.1, 0.3, 0.4, 0.5])
    assert verdict(up.change("fp4")) == "holds"  # +30 points on 100 prompts
    line = up.headline("HiF4+resq-2:4", 100)
    assert "HiF4+resq-2:4 rollout policy" in line and MEANING["holds"] in line
    assert "6 steps" in line
    flat = _outcome(before, before, [0.1] * 6)
    assert verdict(flat.change("fp4")) == "within noise"
    assert MEANING["within noise"] in flat.headline("HiF4", 100)
    reward = up.training_reward_change()
    assert reward.mean == pytest.approx(0.45 - 0.05) and reward.lo > 0
    rows = _rows(up, "HiF4+resq-2:4")
    assert rows[0][0].startswith("accuracy, HiF4+resq-2:4 rollout policy")
    assert rows[-1][1:3] == ("0.500", "0.500")  # first and last step that measured it


def test_report_escapes_the_pipes_of_its_table_cells(tmp_path):
    from fp4rl.demo import _report
    from fp4rl.rl.config import load_config

    before = [0] * 90 + [1] * 10
    result = _outcome(before, [1] * 40 + [0] * 50 + [1] * 10, [0.0, 0.1, 0.2])
    _report(tmp_path, load_config("demo", None, {}), "demo", "HiF4+resq-2:4",
            {"layer": {"bf16": 0.0, "hif4": 0.3, "mxfp4": 0.3}}, result, 1.0, 100, "cpu")
    text = (tmp_path / "report.md").read_text()
    rows = [line for line in text.splitlines() if (line.startswith("| ") and "pt |" in line)
            or "log pi_old" in line]
    assert rows and all(line.replace("\\|", "").count("|") == 5 for line in rows)
    assert text.splitlines()[2].startswith("You are looking at the HiF4+resq-2:4 rollout")


def test_held_out_reward_change_is_paired_and_in_reward_units():
    """Per prompt, the share of its 4 samples that were right, after minus before,
    bootstrapped over the prompts; checked against a hand-written bootstrap."""
    rng = np.random.default_rng(3)
    s_before = rng.integers(0, 3, size=100).tolist()
    s_after = [min(4, c + int(i % 3 == 0)) for i, c in enumerate(s_before)]
    out = _outcome([0] * 100, [0] * 100, [0.1] * 6, (s_before, s_after))
    change = out.reward_change()
    diffs = np.subtract(s_after, s_before) / 4
    assert change.mean == pytest.approx(diffs.mean())
    draws = np.random.default_rng(20260)
    draws.integers(0, 1, size=(4000, 1))
    slow = diffs[draws.integers(0, 100, size=(4000, 100))].mean(1)
    assert (change.lo, change.hi) == pytest.approx(tuple(np.percentile(slow, [2.5, 97.5])))
    assert change.lo > 0
    assert (verdict(out.change("fp4")), verdict(change)) == ("within noise", "holds")
    line = out.headline("HiF4", 100)
    assert f"greedy accuracy {MEANING['within noise']}" in line
    assert f"reward, sampled as in training, {MEANING['holds']}" in line
    row = next(r for r in _rows(out, "HiF4") if r[0].startswith("mean reward"))
    assert "4 samples per held-out prompt" in row[0]
    assert row[1:3] == (f"{np.mean(s_before) / 4:.3f}", f"{np.mean(s_after) / 4:.3f}")


@pytest.mark.parametrize(("after", "expected", "shown"), [
    ([1] * 30 + [0] * 70, "holds", "(+20.0 ["),
    ([0] * 100, "reversed", "(-10.0 ["),
    ([1] * 11 + [0] * 89, "within noise", "(+1.0 ["),
])
def test_transfer_to_word_problems_is_paired_and_read_honestly(after, expected, shown):
    """Word problems the policy never trained on: the paired change over those prompts,
    and one line that says whether it transferred, fell or stayed within the noise."""
    words_before = [1] * 10 + [0] * 90
    out = _outcome([0] * 100, [0] * 100, [0.1] * 6, words=(words_before, after))
    change = out.change(TRANSFER)
    assert change.mean == pytest.approx(100 * (np.mean(after) - np.mean(words_before)))
    diffs = np.subtract(after, words_before)  # the same bootstrap as the task's, by hand
    draws = np.random.default_rng(20260)
    draws.integers(0, 1, size=(4000, 1))
    slow = 100 * diffs[draws.integers(0, 100, size=(4000, 100))].mean(1)
    assert (change.lo, change.hi) == pytest.approx(tuple(np.percentile(slow, [2.5, 97.5])))
    assert verdict(change) == expected
    line = out.transfer_line("HiF4")
    assert line.startswith("On 100 word problems it did not train on")
    assert f"{MEANING[expected]} {shown}" in line and TRANSFER_READING[expected] in line
    row = next(r for r in _rows(out, "HiF4") if "word problems" in r[0])
    assert row[1:3] == ("10.0%", f"{np.mean(after):.1%}")


def test_demo_end_to_end_scores_word_problems_before_and_after(tmp_path, tiny_llama_dir):
    """The whole demo on a tiny random model for one step: the word problems are scored
    before and after with the FP4 policy, and the report says whether they moved."""
    from rich.console import Console

    out = tmp_path / "demo"
    console = Console(file=io.StringIO(), width=120)
    assert run_demo(console, model=str(tiny_llama_dir), output=str(out),
                    size=DemoSize(steps=1, eval_prompts=6, reward_samples=2)) == 0
    report = (out / "report.md").read_text()
    assert "On 6 word problems it did not train on (synthetic-words, direct prompt)" in report
    assert "| accuracy, HiF4+resq-2:4 rollout policy, word problems it did not train on |" in (
        report)
    assert "6 synthetic-words test prompts" in report
    assert "word problems it did not train on" in console.file.getvalue()
