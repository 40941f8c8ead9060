"""fp4rl writes verl's GSM8K parquet layout from a GSM8K file (fp4rl.integrations.verl_data):
the columns verl's RLHFDataset and reward read, fp4rl's own GSM8K prompt, and a
ground truth that verl's GSM8K reward matches."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq

from fp4rl.data.loaders import load_examples
from fp4rl.data.prompts import prompt_messages
from fp4rl.integrations.verl_data import COLUMNS, DATA_SOURCE, main

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day for 2 days. How many eggs?",
     "answer": "1,200 * 2 = 2,400\n#### 2,400"},
    {"question": "It is 5 degrees and drops 8. What is the temperature?",
     "answer": "5 - 8 = -3\n#### -3"},
]


def verl_strict_answer(completion: str) -> str | None:
    """verl 0.9.1's ``reward_score.gsm8k.extract_solution(method="strict")``: the last
    ``#### N``, commas and "$" dropped; its ``compute_score`` gives 1 when it equals the
    row's ``reward_model.ground_truth``."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", completion[-300:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_gsm8k_file_becomes_verl_s_layout(tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    out = tmp_path / "verl"
    assert main(["--train", str(train), "--test", str(test), "--output", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "train.parquet"),
                                               str(out / "test.parquet")]
    table = pq.read_table(out / "train.parquet")
    assert tuple(table.column_names) == COLUMNS
    rows = table.to_pylist()
    examples = load_examples("gsm8k", train)
    assert len(rows) == 3 and len(pq.read_table(out / "test.parquet")) == 1
    for row, example, raw in zip(rows, examples, ROWS, strict=True):
        assert row["data_source"] == DATA_SOURCE and row["ability"] == "math"
        # the prompt fp4rl's qwen2.5-3b-gsm8k preset gives the policy: the gsm8k template
        assert row["prompt"] == prompt_messages(example)
        assert row["prompt"][-1]["content"].startswith(raw["question"])
        assert "####" in row["prompt"][-1]["content"]
        assert row["reward_model"]["style"] == "rule"
        assert row["extra_info"]["split"] == "train"
        assert row["extra_info"]["question"] == raw["question"]
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    assert truths == ["7", "2400", "-3"]
    # what verl's reward extracts from a completion that states the reference's answer
    for raw, truth in zip(ROWS, truths, strict=True):
        assert verl_strict_answer("so the answer is\n" + raw["answer"].splitlines()[-1]) == truth


def test_the_limit_and_a_file_without_answers(tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    out = tmp_path / "verl"
    assert main(["--train", str(train), "--test", str(train), "--output", str(out),
                 "--limit", "2"]) == 0
    assert len(pq.read_table(out / "train.parquet")) == 2
    capsys.readouterr()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    assert main(["--train", str(bad), "--test", str(train), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
