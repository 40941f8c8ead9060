"""Prompt sets for diagnostics: built-in math word problems or a user file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from fp4rl.errors import MissingFileError, UserError

BUILTIN_PROMPTS = (
    "Tom has 12 apples and buys 7 more. How many apples does he have now?",
    "A train travels 60 km per hour for 3 hours. How far does it go?",
    "What is 45 - 18?",
    "Sara reads 15 pages a day. How many pages does she read in 4 days?",
    "There are 8 boxes with 6 pens each. How many pens are there?",
    "Compute 123 + 456.",
    "A shirt costs $25 and is on sale for 20% off. What is the sale price?",
    "If 5 workers build a wall in 10 days, how many days do 10 workers need?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "What is the sum of the first 10 positive integers?",
    "Solve for x: 3x + 5 = 20.",
    "A rectangle is 7 cm wide and 12 cm long. What is its area?",
)
PROMPT_FIELDS = ("prompt", "question", "problem", "text")


def load_prompts(path: str | Path | None) -> list[str]:
    """Prompts from a .txt (one per line) or .jsonl file (field prompt/question/problem/text).

    ``None`` gives the built-in set. Empty lines are skipped; a jsonl row without any
    of the fields is an error naming its line number.
    """
    if path is None:
        return list(BUILTIN_PROMPTS)
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"prompt file {p} does not exist")
    lines = [(i, line.strip()) for i, line in enumerate(p.read_text().splitlines(), 1)]
    if p.suffix != ".jsonl":
        prompts = [line for _, line in lines if line]
    else:
        prompts = [_jsonl_prompt(i, line, p) for i, line in lines if line]
    if not prompts:
        raise UserError(f"prompt file {p} holds no prompts")
    return prompts


def _jsonl_prompt(lineno: int, line: str, path: Path) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
    for key in PROMPT_FIELDS:
        if isinstance(row, dict) and isinstance(row.get(key), str):
            return row[key]
    raise UserError(f"{path}:{lineno}: no text field; expected one of {PROMPT_FIELDS}")


def encode_prompts(tokenizer: object, prompts: Sequence[str]) -> list[torch.Tensor]:
    """Token ids (1, T) per prompt, through the chat template when the tokenizer has one."""
    out = []
    for text in prompts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]  # a transformers tokenizer
                [{"role": "user", "content": text}], add_generation_prompt=True,
                return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]  # type: ignore[operator]  # a transformers tokenizer
        out.append(ids)
    return out
