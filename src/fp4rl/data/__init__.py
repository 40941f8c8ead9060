"""Math problems as Examples: local dataset files, a synthetic task, and prompt building."""

from fp4rl.data.example import Example, Message
from fp4rl.data.layouts import LAYOUTS, Layout, get_layout
from fp4rl.data.loaders import DataError, DataWarning, load_examples, record_to_example
from fp4rl.data.prompts import (
    PROMPT_TEMPLATES,
    PromptTemplate,
    build_prompt,
    has_chat_template,
    prompt_messages,
)
from fp4rl.data.synthetic import LEVELS, SYNTHETIC_TASKS, VARIANTS, synthetic_dataset

__all__ = [
    "LAYOUTS",
    "LEVELS",
    "PROMPT_TEMPLATES",
    "SYNTHETIC_TASKS",
    "VARIANTS",
    "DataError",
    "DataWarning",
    "Example",
    "Layout",
    "Message",
    "PromptTemplate",
    "build_prompt",
    "get_layout",
    "has_chat_template",
    "load_examples",
    "prompt_messages",
    "record_to_example",
    "synthetic_dataset",
]
