"""Declared record layouts of the published math datasets.

Each release stores the same two things, a problem and its final answer, under different
field names and encodings. A :class:`Layout` states where they are and how to turn the
stored answer into the string the reward grades, so loading is one generic routine rather
than per-dataset code. Field names are tried in order, which absorbs renamings between
releases (``Problem``/``problem``/``question``); ``Layout.with_fields`` pins them to what
a particular file uses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from fp4rl.data.answers import GSM8K_MARKER, gsm8k_reference_value
from fp4rl.errors import UserError

AnswerExtractor = Callable[[str], str]
"""Maps the stored answer text to the final answer; raises ``ValueError`` if there is none."""


def stripped(text: str) -> str:
    """Answer fields that already hold just the final answer."""
    return text.strip()


def gsm8k_reference(text: str) -> str:
    """Canonical ``#### N`` reference from a GSM8K solution (commas and "$" dropped).

    Keeping the marker makes the answer self-describing: ``auto`` grading and readers
    both see that it is a single number graded numerically.
    """
    if GSM8K_MARKER not in text:
        raise ValueError("no '####' final answer in the solution")
    value = gsm8k_reference_value(text)
    if value is None:
        raise ValueError("no number after '####'")
    return f"#### {value}"


@dataclass(frozen=True)
class Layout:
    """Where one dataset release keeps its problem and answer, and how to grade it.

    Attributes:
        name: canonical dataset name, also used as ``Example.source``.
        problem_fields: candidate field names for the problem, first present wins.
            A dotted name (``reward_model.ground_truth``) reaches into a dict column.
        answer_fields: candidate field names for the answer, same rules.
        reward: reward name the answers are meant for.
        extract_answer: turns the stored answer text into the final answer.
        chat_prompt: the problem field holds a list of ``{role, content}`` messages.
        meta_fields: optional fields copied into ``Example.meta`` when present.
    """

    name: str
    problem_fields: tuple[str, ...]
    answer_fields: tuple[str, ...]
    reward: str
    extract_answer: AnswerExtractor = stripped
    chat_prompt: bool = False
    meta_fields: tuple[str, ...] = ()

    def with_fields(self, problem: str | None = None, answer: str | None = None) -> Layout:
        """A copy reading exactly the given field names (``None`` keeps the candidates)."""
        return dataclasses.replace(
            self,
            problem_fields=(problem,) if problem else self.problem_fields,
            answer_fields=(answer,) if answer else self.answer_fields,
        )


_PROBLEM_ALIASES = ("problem", "Problem", "question", "Question")
_ANSWER_ALIASES = ("answer", "Answer")


def _competition(name: str) -> Layout:
    """AIME/AMC releases: one problem and one short answer, names vary by uploader."""
    return Layout(
        name=name,
        problem_fields=_PROBLEM_ALIASES,
        answer_fields=_ANSWER_ALIASES,
        reward="math",
        meta_fields=("id", "ID", "url", "year"),
    )


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            name="gsm8k",
            problem_fields=("question",),
            answer_fields=("answer",),
            reward="gsm8k",
            extract_answer=gsm8k_reference,
        ),
        Layout(
            name="math-500",
            problem_fields=("problem",),
            answer_fields=("answer",),
            reward="math",
            meta_fields=("subject", "level", "unique_id"),
        ),
        _competition("aime-2024"),
        _competition("aime-2025"),
        _competition("amc-2023"),
        Layout(
            name="dapo-math-17k",
            problem_fields=("prompt",),
            answer_fields=("reward_model.ground_truth",),
            reward="math",
            chat_prompt=True,
            meta_fields=("data_source",),
        ),
    )
}


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def get_layout(name: str) -> Layout:
    """Find a layout by name, ignoring case and punctuation (``MATH500`` = ``math-500``)."""
    by_key = {_normalize(canonical): layout for canonical, layout in LAYOUTS.items()}
    try:
        return by_key[_normalize(name)]
    except KeyError:
        choices = ", ".join(LAYOUTS)
        raise UserError(f"unknown dataset {name!r}; known datasets: {choices}") from None
