"""The one record type every dataset loader and generator produces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Message = Mapping[str, str]
"""A chat turn, ``{"role": ..., "content": ...}``, as ``apply_chat_template`` expects."""


@dataclass(frozen=True)
class Example:
    """A problem with its verifiable answer, independent of where it came from.

    ``prompt`` is the bare problem text, or, for datasets that ship their own chat
    prompt (DAPO-Math-17K), the messages to send verbatim. ``answer`` is the ground
    truth in the form that ``reward`` (a name for ``fp4rl.rl.rewards.get_reward``)
    takes as its reference: ``"#### 72"`` for ``gsm8k``, bare LaTeX such as
    ``"\\frac{1}{2}"`` for ``math``. ``source`` and ``index`` (0-based position in the
    source file or generated list) trace the example back to its origin; ``meta`` keeps
    extra fields such as a difficulty level for per-group evaluation.
    """

    prompt: str | tuple[Message, ...]
    answer: str
    reward: str
    source: str
    index: int
    meta: Mapping[str, object] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        """True when ``prompt`` already holds chat messages."""
        return not isinstance(self.prompt, str)
