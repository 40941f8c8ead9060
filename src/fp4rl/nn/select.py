"""Which linears a recipe leaves unquantized: ``ignore`` entries.

An entry is a regex on the whole module name (a compressed-tensors style ``re:`` prefix is
accepted), or a selector of transformer blocks or of a kind of linear, as the field's FP4
recipes choose their BF16 layers:

- ``first:N``: every linear of the first ``N`` blocks;
- ``last:N`` or ``last:<fraction>``: the last ``N`` blocks, or the last ``ceil(fraction *
  blocks)`` of them (Miles keeps the last 15% in BF16: ``last:0.15``);
- ``kind:attention`` or ``kind:mlp``: the attention projections (q/k/v/o) or the MLP's
  linears of every block; ``kind:lm_head`` and ``kind:embeddings`` name what fp4rl never
  quantizes (only linears inside transformer blocks are), accepted so that a recipe can
  say it.

A position needs the model's block count, which the caller gives (the patched model's,
vLLM's model config): :meth:`Selector.matches` refuses ``last:`` without it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from fp4rl.errors import RecipeError

#: a transformer block in a module name, its index captured: ``...layers.<i>.`` (Llama, Qwen2,
#: Mistral, ...), ``...h.<i>.`` (GPT-style) or ``...blocks.<i>.``; what patching targets too
BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
#: the module names of each kind of block linear, as the common architectures name them
KINDS = {"attention": re.compile(r"\.(?:self_attn|attn|attention)\."),
         "mlp": re.compile(r"\.(?:mlp|feed_forward|ffn)\."),
         "lm_head": None, "embeddings": None}


@dataclass(frozen=True)
class Selector:
    """One ``ignore`` entry: a regex, or a position or kind of block linears."""

    text: str
    regex: re.Pattern[str] | None = None
    first: int | None = None
    last: float | None = None
    kind: str | None = None

    @classmethod
    def parse(cls, entry: str) -> Selector:
        """The entry's meaning; a malformed selector or regex is one line."""
        head, sep, arg = entry.partition(":")
        if sep and head in ("first", "last"):
            if head == "last":
                return cls(entry, last=_count(entry, arg, fraction=True))
            return cls(entry, first=int(_count(entry, arg, fraction=False)))
        if sep and head == "kind":
            if arg not in KINDS:
                raise RecipeError(f"ignore: {entry!r}: choose kind:{', kind:'.join(KINDS)}")
            return cls(entry, kind=arg)
        pattern = entry.removeprefix("re:")
        try:
            return cls(pattern, regex=re.compile(pattern))
        except re.error as err:
            raise RecipeError(f"ignore: {pattern!r} is not a regex ({err})") from None

    def matches(self, name: str, blocks: int | None = None) -> bool:
        """Whether this entry leaves the linear ``name`` unquantized, in a model of
        ``blocks`` transformer blocks."""
        if self.regex is not None:
            return self.regex.fullmatch(name) is not None
        if self.kind is not None:
            kind = KINDS[self.kind]
            return kind is not None and kind.search(name) is not None
        found = BLOCK_INDEX.search(name)
        if found is None:
            return False
        index = int(found.group(1))
        if self.first is not None:
            return index < self.first
        if blocks is None:
            raise RecipeError(f"ignore: {self.text!r} counts blocks from the end, and the "
                              "model's block count is not known here")
        assert self.last is not None
        count = int(self.last) if self.last >= 1 else math.ceil(self.last * blocks)
        return index >= blocks - count


def _count(entry: str, arg: str, fraction: bool) -> float:
    """``N`` (a positive integer) or, for ``last:``, a fraction in (0, 1)."""
    try:
        value = float(arg) if fraction and "." in arg else int(arg)
    except ValueError:
        value = 0
    if value <= 0 or (isinstance(value, float) and value >= 1):
        allowed = "a positive integer or a fraction in (0, 1)" if fraction else \
            "a positive integer"
        raise RecipeError(f"ignore: {entry!r}: the count must be {allowed}")
    return value


def block_count(names: list[str]) -> int | None:
    """The number of transformer blocks among module ``names`` (one more than the largest
    block index), or None where there is none."""
    indices = [int(m.group(1)) for n in names if (m := BLOCK_INDEX.search(n))]
    return max(indices) + 1 if indices else None


__all__ = ["BLOCK_INDEX", "KINDS", "Selector", "block_count"]
