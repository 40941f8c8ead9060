"""Rewards: exact scores on crafted completions, and never an exception on any text."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4rl.data.answers import last_boxed
from fp4rl.rl.rewards import (
    auto_reward,
    get_reward,
    gsm8k_reward,
    list_rewards,
    math_reward,
    register_reward,
)


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("So she spends 14 dollars.", "Some working.\n#### 14", 1.0),
        ("So she spends 14 dollars.", "#### 15", 0.0),
        ("The total is $1,200.", "#### 1200", 1.0),
        ("The total is 1,200", "#### 1,200", 1.0),
        ("It is 72.", "#### 72", 1.0),
        ("It is 72.0 now", "#### 72", 1.0),
        ("It is 0.50", "#### .5", 0.0),  # a reference must start with a digit
        ("It is 0.50", "#### 0.5", 1.0),
        ("The temperature is -5 degrees.", "#### -5", 1.0),
        ("The temperature is \u22125 degrees.", "#### -5", 1.0),
        ("10 - 5 = 5", "#### 5", 1.0),  # the minus of "10 - 5" is not a sign
        ("3-5", "#### -5", 0.0),  # nor is a hyphen between digits
        ("-$7 is the change", "#### -7", 1.0),
        # The last box wins over later numbers, "####" over the last number.
        ("\\boxed{12} because 3 * 4 = 12 and 99 is unrelated", "#### 12", 1.0),
        ("First \\boxed{3}, corrected: \\boxed{4}. Done after 5 steps.", "#### 4", 1.0),
        ("#### 8\nQuestion: what is 9?", "#### 8", 1.0),
        ("\\boxed{x = 5}", "#### 5", 1.0),
        ("\\boxed{5 \\text{ cm}^2}", "#### 5", 1.0),
        ("\\boxed{\\$1,000}", "#### 1000", 1.0),
        ("\\boxed{\\frac{1}{2}}", "#### 2", 0.0),  # the box says a fraction, not 2
        ("\\boxed{no number}", "#### 3", 0.0),
        ("unclosed \\boxed{7", "#### 7", 1.0),  # truncated box: fall back to last number
        ("The answer is 5", "5", 1.0),  # bare references are accepted too
        ("no digits at all", "#### 5", 0.0),
        ("", "#### 0", 0.0),
        (None, "#### 0", 0.0),
        ("42", "#### no number", 0.0),
    ],
)
def test_gsm8k_reward_on_crafted_completions(
    completion: str | None, reference: str, expected: float
) -> None:
    assert gsm8k_reward(completion, reference) == expected


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("\\boxed{a{b}c} and \\boxed{d}", "d"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\fbox{3} then \\boxed{4}", "4"),
        ("\\boxed{4} then \\fbox{3}", "3"),
        ("\\boxed{open", None),
        ("plain text", None),
    ],
)
def test_last_boxed_balances_braces(text: str, content: str | None) -> None:
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("Thus the answer is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("Thus the answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
        ("Thus the answer is $\\boxed{\\frac{1}{3}}$.", "\\frac{1}{2}", 0.0),
        ("So $\\boxed{(3, \\pi/2)}$.", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("So $\\boxed{(3, \\pi)}$.", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
        ("We get \\boxed{6 - 5i}", "6-5i", 1.0),
        ("Answer: 17", "17", 1.0),
        ("The answer is \\boxed{21}", "21", 1.0),
        # A full solution works as the reference: its boxed answer is used.
        ("\\boxed{2}", "Factor to $(x-2)^2$, so $x = \\boxed{2}$.", 1.0),
        ("\\boxed{3}", "Factor to $(x-2)^2$, so $x = \\boxed{2}$.", 0.0),
        ("", "2", 0.0),
        ("   ", "2", 0.0),
        (None, "2", 0.0),
        ("\\boxed{2}", "", 0.0),
    ],
)
def test_math_reward_on_crafted_completions(
    completion: str | None, reference: str, expected: float
) -> None:
    assert math_reward(completion, reference) == expected


@pytest.mark.parametrize(
    "answer",
    ["9^{9^{9^{9}}}", "10^{10^{10}}", "123456789^{123456789}", "9999999!", "(x+1)^{100000}"],
)
def test_math_reward_rejects_expressions_too_costly_to_compare(answer: str) -> None:
    """Without a timeout these would hang sympy; they must score 0 at once instead."""
    start = time.perf_counter()
    assert math_reward(f"The answer is $\\boxed{{{answer}}}$", "5") == 0.0
    assert math_reward("\\boxed{5}", answer) == 0.0
    assert time.perf_counter() - start < 2.0


def test_math_reward_keeps_ordinary_powers_and_factorials() -> None:
    assert math_reward("\\boxed{2^{10}}", "1024") == 1.0
    assert math_reward("\\boxed{5!}", "120") == 1.0


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_gsm8k_reward_never_raises(completion: str) -> None:
    assert gsm8k_reward(completion, "#### 7") in (0.0, 1.0)


@given(st.text(), st.integers(min_value=-(10**12), max_value=10**12))
@settings(max_examples=200, deadline=None)
def test_gsm8k_reward_trusts_a_final_box_after_any_text(prefix: str, value: int) -> None:
    assert gsm8k_reward(f"{prefix} \\boxed{{{value}}}", f"#### {value}") == 1.0


@given(st.integers(min_value=-(10**9), max_value=10**9), st.sampled_from(["{:,}", "${:,}", "{}."]))
@settings(max_examples=100, deadline=None)
def test_gsm8k_reward_reads_formatted_numbers(value: int, style: str) -> None:
    written = style.format(abs(value))
    sign = "-" if value < 0 else ""
    assert gsm8k_reward(f"The answer is {sign}{written}", f"#### {value}") == 1.0


@given(st.text(max_size=200))
@settings(max_examples=60, deadline=None)
def test_math_reward_never_raises(completion: str) -> None:
    assert math_reward(completion, "\\frac{1}{2}") in (0.0, 1.0)


@given(st.text(alphabet="0123456789+-*/^!{}()\\$ .,=boxedfrac", max_size=60))
@settings(max_examples=60, deadline=None)
def test_math_reward_never_raises_on_math_like_text(completion: str) -> None:
    assert math_reward(completion, "7") in (0.0, 1.0)


def test_registry_names_and_lookup() -> None:
    assert list_rewards() == ["auto", "gsm8k", "math"]
    assert get_reward("gsm8k") is gsm8k_reward
    assert get_reward("math") is math_reward
    assert get_reward("auto") is auto_reward


@pytest.mark.parametrize("name", ["GSM8K", "mathverify", ""])
def test_unknown_reward_name_lists_choices(name: str) -> None:
    with pytest.raises(ValueError, match=r"unknown reward .*auto, gsm8k, math"):
        get_reward(name)


def test_registered_rewards_are_found_refused_twice_and_replaceable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    register_reward("always", lambda completion, reference: 1.0)
    assert get_reward("always")(None, "") == 1.0
    with pytest.raises(ValueError, match=r"reward 'always' is already registered \(.*\); pass "
                                         r"replace=True"):
        register_reward("always", lambda completion, reference: 0.0)
    register_reward("always", lambda completion, reference: 0.0, replace=True)
    assert get_reward("always")(None, "") == 0.0
    assert list_rewards()[-1] == "always"

    @register_reward("never")
    def never(completion: str | None, reference: str) -> float:
        return 0.0

    assert get_reward("never") is never
    register_reward("never", never)  # the same function again: nothing to refuse
    with pytest.raises(ValueError, match="non-empty"):
        register_reward("", gsm8k_reward)
    with pytest.raises(TypeError, match="must be callable"):
        register_reward("broken", "not a function")  # type: ignore[arg-type]


def test_auto_reward_routes_by_reference_style() -> None:
    # "#### 3" goes to the numeric grader, which reads the trailing "3" ...
    assert auto_reward("2 + 1 = 3", "#### 3") == 1.0
    # ... while LaTeX references go to math_verify, which knows 2/4 = 1/2.
    assert auto_reward("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert auto_reward(None, "\\frac{1}{2}") == 0.0
