"""Data: published layouts, bad-record reporting, prompts and the synthetic task."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import _paths
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp4rl.data import (
    LAYOUTS,
    LEVELS,
    SYNTHETIC_TASKS,
    DataError,
    DataWarning,
    Example,
    PromptTemplate,
    build_prompt,
    get_layout,
    load_examples,
    synthetic_dataset,
)
from fp4rl.errors import UserError
from fp4rl.rl.rewards import get_reward

FIXTURES = _paths.FIXTURES / "data"


def _parquet_from_json(name: str, directory: Path) -> Path:
    """Write a JSON fixture's rows as parquet, the way the dataset is published."""
    rows = json.loads((FIXTURES / name).read_text())
    path = directory / name.replace(".json", ".parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _load_with_warnings(*args: Any, **kwargs: Any) -> tuple[list[Example], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        examples = load_examples(*args, **kwargs)
    assert all(issubclass(w.category, DataWarning) for w in caught)
    return examples, [str(w.message) for w in caught]


# --------------------------------------------------------------------------- layouts


def test_gsm8k_answers_become_canonical_references() -> None:
    examples = load_examples("gsm8k", FIXTURES / "gsm8k.jsonl")
    assert [e.answer for e in examples] == ["#### 14", "#### 850", "#### -5"]
    assert examples[1].prompt.startswith("A farm has 1,200 chickens")
    assert {(e.reward, e.source) for e in examples} == {("gsm8k", "gsm8k")}
    assert [e.index for e in examples] == [0, 1, 2]


def test_math500_keeps_latex_answers_and_metadata() -> None:
    examples = load_examples("MATH-500", FIXTURES / "math500.jsonl")
    assert [e.answer for e in examples] == [
        "\\frac{1}{2}",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "2",
    ]
    assert examples[0].meta == {
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/901.json",
    }
    assert examples[0].reward == "math"
    assert examples[0].source == "math-500"


@pytest.mark.parametrize(
    ("name", "file", "answers", "first_words"),
    [
        ("aime-2024", "aime2024.jsonl", ["15", "1"], "Find the number"),  # Problem/Answer, int
        ("aime2025", "aime2025.jsonl", ["84", "9"], "Find the sum"),  # question/answer
        ("AMC_2023", "amc2023.jsonl", ["21", "7.5"], "What is the value"),  # float answers
    ],
)
def test_competition_layouts_accept_each_release_naming(
    name: str, file: str, answers: list[str], first_words: str
) -> None:
    examples = load_examples(name, FIXTURES / file)
    assert [e.answer for e in examples] == answers
    assert examples[0].prompt.startswith(first_words)
    assert examples[0].source == get_layout(name).name


def test_competition_answers_are_graded_by_their_reward() -> None:
    example = load_examples("amc-2023", FIXTURES / "amc2023.jsonl")[1]
    reward = get_reward(example.reward)
    assert reward("So the product is \\boxed{\\frac{15}{2}}.", example.answer) == 1.0


def test_user_field_mapping_overrides_the_layout() -> None:
    fields = {"problem": "statement", "answer": "final_answer"}
    [example] = load_examples("aime-2024", FIXTURES / "custom_fields.jsonl", fields=fields)
    assert example.prompt == "What is the smallest prime greater than 20?"
    assert example.answer == "23"


def test_field_mapping_with_unknown_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown field mapping keys"):
        load_examples("aime-2024", FIXTURES / "aime2024.jsonl", fields={"question": "Problem"})


def test_dapo_parquet_gives_chat_prompts_and_nested_ground_truth(tmp_path: Path) -> None:
    path = _parquet_from_json("dapo_math_17k.json", tmp_path)
    examples = load_examples("dapo-math-17k", path)
    assert [e.answer for e in examples] == ["6", "17"]
    first = examples[0]
    assert first.is_chat
    assert [turn["role"] for turn in first.prompt] == ["user"]
    assert "How many positive divisors does $12$ have?" in first.prompt[0]["content"]
    assert first.meta == {"data_source": "math_dapo"}
    assert first.reward == "math"


def test_limit_stops_after_that_many_examples() -> None:
    assert len(load_examples("gsm8k", FIXTURES / "gsm8k.jsonl", limit=2)) == 2


def test_layout_names_ignore_case_and_punctuation() -> None:
    assert get_layout("MATH500") is LAYOUTS["math-500"]
    assert get_layout("dapo_math_17k") is LAYOUTS["dapo-math-17k"]


# --------------------------------------------------------------------------- bad input


def test_bad_jsonl_lines_are_reported_by_line_and_skipped() -> None:
    path = FIXTURES / "gsm8k_bad.jsonl"
    examples, messages = _load_with_warnings("gsm8k", path)
    assert [(e.index, e.answer) for e in examples] == [(0, "#### 5"), (8, "#### 70")]
    lines = [int(re.search(r": line (\d+): ", m).group(1)) for m in messages]
    assert lines == [2, 3, 4, 6, 7, 8]
    reasons = dict(zip(lines, messages, strict=True))
    assert "invalid JSON" in reasons[2]
    assert "missing field 'answer'" in reasons[3]
    assert "no '####' final answer" in reasons[4]
    assert "field 'question' must be non-empty text, got int" in reasons[6]
    assert "expected a JSON object, got list" in reasons[7]
    assert "no number after '####'" in reasons[8]
    assert all(m.startswith(str(path)) and m.endswith("; skipped") for m in messages)


def test_strict_mode_raises_at_the_first_bad_line() -> None:
    with pytest.raises(DataError, match=r"gsm8k_bad\.jsonl: line 2: invalid JSON"):
        load_examples("gsm8k", FIXTURES / "gsm8k_bad.jsonl", strict=True)


def test_bad_parquet_rows_are_reported_by_row(tmp_path: Path) -> None:
    path = _parquet_from_json("dapo_math_17k_bad.json", tmp_path)
    examples, messages = _load_with_warnings("dapo-math-17k", path)
    assert [(e.index, e.answer) for e in examples] == [(0, "4"), (3, "9")]
    assert len(messages) == 2
    null_answer = "field 'reward_model.ground_truth' must be text or a number, got null"
    assert f": row 1: {null_answer}" in messages[0]
    assert ": row 2: field 'prompt' must be a non-empty message list" in messages[1]
    with pytest.raises(DataError, match=": row 1: "):
        load_examples("dapo-math-17k", path, strict=True)


def test_unknown_dataset_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'gsm9k'.*gsm8k, math-500"):
        load_examples("gsm9k", FIXTURES / "gsm8k.jsonl")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"dataset file not found: .*nope\.jsonl"):
        load_examples("gsm8k", tmp_path / "nope.jsonl")


def test_unsupported_file_type_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\n")
    with pytest.raises(DataError, match=r"unsupported file type; expected one of \.jsonl"):
        load_examples("gsm8k", path)


def test_corrupt_parquet_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="unreadable parquet file"):
        load_examples("dapo-math-17k", path)


# --------------------------------------------------------------------------- prompts


class _ChatTokenizer:
    """Records how ``apply_chat_template`` is called, as an instruct tokenizer would be."""

    chat_template = "{% for m in messages %}...{% endfor %}"

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict[str, str]], dict[str, Any]]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        self.calls.append((messages, kwargs))
        return "<chat>" + "|".join(f"{m['role']}:{m['content']}" for m in messages)


class _BaseTokenizer:
    chat_template = None


def _text_example(reward: str, problem: str = "What is {x} if x = 2?") -> Example:
    return Example(prompt=problem, answer="2", reward=reward, source="test", index=0)


def test_plain_prompt_uses_the_reward_s_answer_marker() -> None:
    gsm8k = build_prompt(_text_example("gsm8k"))
    assert gsm8k.startswith("What is {x} if x = 2?\n\n")
    assert "after '####'" in gsm8k and gsm8k.endswith("#### 42\n")
    boxed = build_prompt(_text_example("math"), _BaseTokenizer())
    assert boxed == (
        "What is {x} if x = 2?\n\nSolve the problem step by step, "
        "then put your final answer within \\boxed{}.\n"
    )


def test_chat_template_is_applied_with_a_generation_prompt() -> None:
    tokenizer = _ChatTokenizer()
    text = build_prompt(_text_example("math"), tokenizer)
    [(messages, kwargs)] = tokenizer.calls
    assert kwargs == {"add_generation_prompt": True, "tokenize": False}
    assert [m["role"] for m in messages] == ["user"]
    assert messages[0]["content"].startswith("What is {x} if x = 2?")
    assert text.startswith("<chat>user:What is {x}")


def test_custom_template_with_system_turn() -> None:
    template = PromptTemplate("Q: {problem}\nA:", system="Be brief.")
    assert build_prompt(_text_example("math"), template=template) == (
        "Be brief.\n\nQ: What is {x} if x = 2?\nA:\n"
    )


def test_chat_examples_are_sent_verbatim(tmp_path: Path) -> None:
    example = load_examples("dapo-math-17k", _parquet_from_json("dapo_math_17k.json", tmp_path))[0]
    tokenizer = _ChatTokenizer()
    build_prompt(example, tokenizer, template="gsm8k")
    [(messages, _)] = tokenizer.calls
    assert messages == [dict(turn) for turn in example.prompt]


def test_template_errors_are_explicit() -> None:
    with pytest.raises(ValueError, match="unknown prompt template 'fancy'; choose one of: boxed"):
        build_prompt(_text_example("math"), template="fancy")
    with pytest.raises(ValueError, match="placeholder"):
        PromptTemplate("no slot for the problem")
    with pytest.raises(UserError, match="'direkt' \\(did you mean 'direct'\\?\\)"):
        build_prompt(_text_example("math"), template="direkt")


def test_direct_template_asks_for_the_number_only() -> None:
    text = build_prompt(_text_example("math"), template="direct")
    assert text.rstrip().endswith("?\n\nGive only the final answer as a number.")
    assert "boxed" not in text and "####" not in text


# --------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_by_seed() -> None:
    first = synthetic_dataset("train", 60, levels=(1, 2, 4), seed=3)
    assert first == synthetic_dataset("train", 60, levels=(4, 2, 1), seed=3)
    assert first != synthetic_dataset("train", 60, levels=(1, 2, 4), seed=4)


def test_synthetic_splits_never_share_a_question() -> None:
    for level in LEVELS:
        size = 40 if level in (1, 2) else 400
        train = synthetic_dataset("train", size, levels=(level,), seed=0)
        tests = [synthetic_dataset("test", size // 4, levels=(level,), seed=s) for s in (0, 1)]
        train_questions = {e.meta["expression"] for e in train}
        for test in tests:
            assert train_questions.isdisjoint(e.meta["expression"] for e in test)
            assert {e.prompt for e in train}.isdisjoint(e.prompt for e in test)


def test_smallest_level_is_fully_partitioned() -> None:
    """All of level 1 (a + b over 0..30, order ignored) sits in exactly one split."""
    train, test = (
        synthetic_dataset(split, n, levels=(1,)) for split, n in (("train", 401), ("test", 95))
    )
    canonical = {
        tuple(sorted(map(int, e.meta["expression"].split(" + ")))) for e in [*train, *test]
    }
    assert len(canonical) == len(train) + len(test) == 31 * 32 // 2
    with pytest.raises(ValueError, match="level 1 has only 95 distinct test questions"):
        synthetic_dataset("test", 96, levels=(1,))


def test_synthetic_answers_are_exact_and_gradable() -> None:
    reward = get_reward("gsm8k")
    examples = synthetic_dataset("test", 120, levels=tuple(LEVELS), seed=7)
    for example in examples:
        value = eval(example.meta["expression"])  # built by the generator, digits and + - * /
        assert value == int(example.answer.removeprefix("#### "))
        assert reward(f"\\boxed{{{int(value)}}}", example.answer) == 1.0
        assert reward(f"\\boxed{{{int(value) + 1}}}", example.answer) == 0.0


def test_synthetic_spreads_n_over_levels_and_indexes_examples() -> None:
    examples = synthetic_dataset("train", 11, levels=(3, 1, 2), seed=1)
    levels = [e.meta["level"] for e in examples]
    assert (levels.count(1), levels.count(2), levels.count(3)) == (4, 4, 3)
    assert [e.index for e in examples] == list(range(11))
    assert {(e.source, e.reward) for e in examples} == {("synthetic", "gsm8k")}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "valid"}, "unknown split 'valid'"),
        ({"levels": (0,)}, "levels must be a non-empty subset"),
        ({"levels": ()}, "levels must be a non-empty subset"),
        ({"n": -1}, "n must be >= 0"),
    ],
)
def test_synthetic_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        synthetic_dataset(**kwargs)


# --------------------------------------------------------------------------- word problems


def test_word_problems_are_sentences_with_exact_answers() -> None:
    reward = get_reward("gsm8k")
    examples = synthetic_dataset("test", 80, levels=(1, 2, 4, 5), seed=2,
                                 source="synthetic-words")
    assert {(e.source, e.reward) for e in examples} == {("synthetic-words", "gsm8k")}
    assert {e.meta["level"] for e in examples} == {1, 2, 4, 5}
    for example in examples:
        assert example.prompt.endswith("?") and len(example.prompt.split()) >= 10
        value = eval(example.meta["expression"])  # built by the generator
        assert value == int(example.answer.removeprefix("#### "))
        assert reward(f"#### {int(value)}", example.answer) == 1.0


def test_word_problem_splits_are_disjoint_and_hold_hundreds_of_test_questions() -> None:
    test = synthetic_dataset("test", 400, levels=(1, 2), seed=0, source="synthetic-words")
    for seed in (0, 1, 2):
        train = synthetic_dataset("train", 800, levels=(1, 2), seed=seed,
                                  source="synthetic-words")
        assert {e.prompt for e in train}.isdisjoint(e.prompt for e in test)
    synthetic_dataset("test", 206, levels=(2,), source="synthetic-words")
    with pytest.raises(ValueError, match="level 2 has only 206 distinct test questions"):
        synthetic_dataset("test", 207, levels=(2,), source="synthetic-words")


def test_word_variant_keeps_the_multi_step_levels_and_their_split() -> None:
    """Levels 4-5 are the same templates in both sources, and a question's split does not
    depend on the source it was drawn from."""
    assert SYNTHETIC_TASKS["synthetic-words"][4] is LEVELS[4]
    words = synthetic_dataset("test", 100, levels=(4,), seed=5, source="synthetic-words")
    arithmetic = synthetic_dataset("train", 400, levels=(4,), seed=5)
    assert {e.meta["expression"] for e in words}.isdisjoint(
        e.meta["expression"] for e in arithmetic)
    assert words != synthetic_dataset("test", 100, levels=(4,), seed=5)


def test_word_variant_is_a_data_source() -> None:
    from fp4rl.rl.config import DataConfig
    from fp4rl.rl.datasets import load_split

    cfg = DataConfig(source="synthetic-words", levels=[1, 2], train_size=6, test_size=4)
    assert [e.source for e in load_split(cfg, "train", seed=1)] == ["synthetic-words"] * 6
    assert load_split(cfg, "test", seed=1) == synthetic_dataset(
        "test", 4, levels=(1, 2), seed=1, source="synthetic-words")
    with pytest.raises(ValueError, match="levels must be a non-empty subset of \\[1, 2, 4, 5\\]"):
        synthetic_dataset("test", 4, levels=(3,), source="synthetic-words")
    with pytest.raises(ValueError, match="unknown synthetic source 'synthetic-poems'"):
        synthetic_dataset("test", 4, source="synthetic-poems")
