"""Turn an Example into the exact text the policy model is given.

The instruction tells the model how to mark its final answer, and the marker must be
one the example's reward reads: ``\\boxed{}`` for ``math`` (``gsm8k`` reads it too) and
``####`` for ``gsm8k``. Instruct models are prompted through their own chat template so
that training and evaluation see the format the model was tuned on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp4rl.data.example import Example, Message
from fp4rl.errors import UserError, did_you_mean

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PLACEHOLDER = "{problem}"


@dataclass(frozen=True)
class PromptTemplate:
    """A user instruction around the problem (at ``{problem}``), with an optional system turn.

    The placeholder is substituted literally rather than with ``str.format`` because
    problems and instructions contain LaTeX braces.
    """

    user: str
    system: str | None = None

    def __post_init__(self) -> None:
        if _PLACEHOLDER not in self.user:
            raise ValueError(f"a prompt template needs a {_PLACEHOLDER} placeholder")

    def messages(self, problem: str) -> list[Message]:
        """The chat turns for one problem."""
        turns: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        return [*turns, {"role": "user", "content": self.user.replace(_PLACEHOLDER, problem)}]


PROMPT_TEMPLATES: Mapping[str, PromptTemplate] = {
    "boxed": PromptTemplate(
        "{problem}\n\nSolve the problem step by step, then put your final answer within \\boxed{}."
    ),
    "gsm8k": PromptTemplate(
        "{problem}\n\nSolve the problem step by step, then write the final answer "
        "as a number after '####', for example: #### 42"
    ),
    # A short answer: a small model earns reward (hence a GRPO signal) in a few tokens.
    "direct": PromptTemplate("{problem}\n\nGive only the final answer as a number."),
}

_TEMPLATE_FOR_REWARD = {"gsm8k": "gsm8k"}
_DEFAULT_TEMPLATE = "boxed"


def _pick_template(example: Example, template: PromptTemplate | str | None) -> PromptTemplate:
    if isinstance(template, PromptTemplate):
        return template
    name = template or _TEMPLATE_FOR_REWARD.get(example.reward, _DEFAULT_TEMPLATE)
    try:
        return PROMPT_TEMPLATES[name]
    except KeyError:
        choices = ", ".join(PROMPT_TEMPLATES)
        raise UserError(f"unknown prompt template {name!r}"
                        f"{did_you_mean(name, list(PROMPT_TEMPLATES))}; choose one of: "
                        f"{choices}") from None


def prompt_messages(
    example: Example, template: PromptTemplate | str | None = None
) -> list[Message]:
    """Chat turns for an example; datasets that ship messages are used verbatim.

    ``template`` is a :class:`PromptTemplate`, a name in ``PROMPT_TEMPLATES``, or ``None``
    for the template that matches the example's reward.
    """
    if isinstance(example.prompt, str):
        return _pick_template(example, template).messages(example.prompt)
    return [dict(turn) for turn in example.prompt]


def has_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    """Whether ``tokenizer`` carries a chat template (instruct models do, base models not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(
    example: Example,
    tokenizer: PreTrainedTokenizerBase | None = None,
    template: PromptTemplate | str | None = None,
) -> str:
    """The model input text for an example.

    With a chat-template tokenizer this is ``apply_chat_template`` with the generation
    prompt appended; otherwise (base models, or no tokenizer) the turns' contents joined by
    blank lines, ending in a newline so generation starts on a fresh line.
    """
    messages = prompt_messages(example, template)
    if tokenizer is not None and has_chat_template(tokenizer):
        # with tokenize=False the template returns the text
        return str(tokenizer.apply_chat_template([dict(m) for m in messages],
                                                 add_generation_prompt=True, tokenize=False))
    return "\n\n".join(turn["content"] for turn in messages) + "\n"
