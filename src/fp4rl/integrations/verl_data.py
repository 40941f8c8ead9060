"""GSM8K in verl's parquet layout, written by fp4rl from the GSM8K files a user has.

verl trains from parquet files whose rows carry the chat prompt and what its reward reads
(verl's own ``examples/data_preprocess/gsm8k.py`` writes them; neither verl's wheel nor
fp4rl ships that script). This module writes the same layout from any GSM8K file fp4rl's
loader reads (``.jsonl`` or ``.parquet``, local or ``hf://datasets/...``):

- ``data_source``: ``openai/gsm8k``, which selects verl's GSM8K reward
  (``verl.utils.reward_score.gsm8k``: 1 when the last ``#### N`` of the completion equals
  the reference, else 0);
- ``prompt``: the chat turns fp4rl's ``qwen2.5-3b-gsm8k`` preset gives the policy (the
  ``gsm8k`` prompt: solve step by step, then the answer after ``####``), so verl's run
  is prompted as fp4rl's own is;
- ``ability``: ``math``; ``reward_model``: ``{"style": "rule", "ground_truth": N}``;
  ``extra_info``: the split, the row's index, the question and the reference answer.

``python -m fp4rl.integrations.verl_data --train TRAIN --test TEST --output DIR`` writes
``DIR/train.parquet`` and ``DIR/test.parquet``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TypedDict

from fp4rl.data.answers import GSM8K_MARKER
from fp4rl.data.example import Example
from fp4rl.data.loaders import load_examples
from fp4rl.data.prompts import prompt_messages
from fp4rl.errors import UserError

#: the ``data_source`` verl's ``default_compute_score`` maps to its GSM8K reward
DATA_SOURCE = "openai/gsm8k"
#: the columns of verl's GSM8K files, in its order
COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


class VerlRow(TypedDict):
    """One row of verl's GSM8K parquet (:data:`COLUMNS`)."""

    data_source: str
    prompt: list[dict[str, str]]
    ability: str
    reward_model: dict[str, str]
    extra_info: dict[str, str | int]


def verl_row(example: Example, split: str) -> VerlRow:
    """One row of verl's GSM8K layout for a GSM8K ``example`` (fp4rl's loader gives its
    answer as ``#### N``; verl's reward compares ``N`` as a string)."""
    if isinstance(example.prompt, tuple):
        raise UserError(f"GSM8K row {example.index} ships chat turns; verl's GSM8K layout "
                        "is built from a question")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [dict(turn) for turn in prompt_messages(example)],
        "ability": "math",
        "reward_model": {"style": "rule",
                         "ground_truth": example.answer.removeprefix(GSM8K_MARKER).strip()},
        "extra_info": {"split": split, "index": example.index, "question": example.prompt,
                       "answer": example.answer},
    }


def write_split(source: str | Path, split: str, output: Path,
                limit: int | None = None) -> Path:
    """``output/{split}.parquet`` from the GSM8K file ``source``; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [verl_row(e, split) for e in load_examples("gsm8k", source, limit=limit)]
    output.mkdir(parents=True, exist_ok=True)
    path = output / f"{split}.parquet"
    table = pa.Table.from_pylist(rows).select(list(COLUMNS))
    pq.write_table(table, path)
    return path


def main(argv: list[str] | None = None) -> int:
    """Write verl's train and test parquet files; one line on a bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m fp4rl.integrations.verl_data",
        description="GSM8K files -> verl's parquet layout (train.parquet, test.parquet)")
    parser.add_argument("--train", required=True, help="GSM8K train file (.jsonl, .parquet, "
                        "hf://datasets/openai/gsm8k/main/train-00000-of-00001.parquet)")
    parser.add_argument("--test", required=True, help="GSM8K test file, as --train")
    parser.add_argument("--output", required=True, type=Path, help="directory to write to")
    parser.add_argument("--limit", type=int, default=None, help="first N rows of each file")
    args = parser.parse_args(argv)
    try:
        for split, source in (("train", args.train), ("test", args.test)):
            path = write_split(source, split, args.output, args.limit)
            print(f"{path}")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
