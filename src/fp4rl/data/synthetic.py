"""A built-in arithmetic task: no download, exact answers, graded difficulty.

It lets the whole training loop run offline and gives a signal small models can
learn from: GRPO needs prompts the policy sometimes, but not always, solves.

Levels (pick one or mix several with ``levels=(1, 2)``), with the greedy accuracy that
SmolLM2-135M-Instruct (Q4_1 weights, ``boxed`` prompt, 160 new tokens) reached on the
test split; the hard levels are headroom for larger models and for training:

=====  =====================================================  ============================  ====
level  questions                                              example                       acc
=====  =====================================================  ============================  ====
1      a + b, a and b in 0..30                                What is 7 + 12?               27 %
2      a × b, a in 2..12 and b in 2..30                       Calculate 7 times 23.         12 %
3      a + b or a - b with two-digit numbers, result >= 0     What is 83 - 27?               9 %
4      two-step word problems (add/subtract/multiply, <= 50)  Mia has 12 apples. ...         1 %
5      three-step word problems ending in an exact division   Leo bakes 4 trays of 6 ...     2 %
6      (a × b) − (c × d), two-digit times one-digit           What is (47 × 3) − (52 × 6)?   0 %
=====  =====================================================  ============================  ====

Levels 1 and 2 are small: 496 and 264 distinct questions, of which 95 and 52 are in
the test split (the accuracies above use all of them, and 100 questions for levels 3-5,
40 for level 6). Level 6 answers may be negative.

Every question has an identity key (level, template, operands; commutative operands
sorted; names, items and phrasing left out). A fixed hash of the key puts it in ``train``
or ``test`` (about 20 %), so the splits never share a question whatever the seed; the seed
only chooses which questions and in what order. Answers are integers and each Example's
reference is ``"#### N"``, graded by the ``gsm8k`` reward; ``meta`` records the level and a
Python expression whose value is the answer.

The word-problem variant (data source ``synthetic-words``) asks the same kind of sums in
GSM8K-style sentences, for a model small enough to learn from them:

=====  ======================================================  =====================================
level  questions                                               example
=====  ======================================================  =====================================
1      one-step stories: add or take away, numbers up to 50    Mia has 12 apples and gives 5 of ...
2      one-step stories: a × b, a in 2..12 and b in 2..30      A hall has 7 rows of chairs with ...
4, 5   the two- and three-step problems of levels 4 and 5
=====  ======================================================  =====================================

Levels 1 and 2 hold 4,815 and 957 distinct questions (three sentence templates each; the
template is part of the key), 977 and 206 of them in the test split, so a test set of a
few hundred prompts stays disjoint from training. Levels 4 and 5 keep their keys, hence
their split.
"""

from __future__ import annotations

import hashlib
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fp4rl.data.example import Example
from fp4rl.errors import UserError

SPLITS = ("train", "test")
_TEST_PERCENT = 20
# Draws allowed before a level counts as exhausted. Drawing every one of K keys takes about
# K·ln K draws (3,100 for level 1), so the floor lets small levels be used up entirely.
_DRAWS_PER_QUESTION = 50
_MIN_DRAWS = 20_000

_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Leo", "Mia", "Noah", "Priya", "Zoe")
_ITEMS = ("apples", "marbles", "stickers", "cookies", "pencils", "shells", "cards", "books")
_OPERATORS: dict[str, tuple[str, str, Callable[[int, int], int]]] = {
    "+": ("+", "plus", operator.add),
    "-": ("-", "minus", operator.sub),
    "*": ("×", "times", operator.mul),
}


@dataclass(frozen=True)
class _Problem:
    """One generated question; ``key`` identifies it regardless of wording."""

    key: tuple[int | str, ...]
    question: str
    expression: str
    answer: int


@dataclass(frozen=True)
class Level:
    """A difficulty level: what it asks (for docs and reports) and its generator."""

    description: str
    generate: Callable[[random.Random], _Problem]


# --------------------------------------------------------------------------- bare arithmetic


def _binary(rng: random.Random, a: int, op: str, b: int) -> _Problem:
    symbol, word, apply = _OPERATORS[op]
    question = rng.choice((f"What is {a} {symbol} {b}?", f"Calculate {a} {word} {b}."))
    key: tuple[int | str, ...] = (op, *sorted((a, b))) if op in "+*" else (op, a, b)
    return _Problem(key, question, f"{a} {op} {b}", apply(a, b))


def _level1(rng: random.Random) -> _Problem:
    return _binary(rng, rng.randint(0, 30), "+", rng.randint(0, 30))


def _level2(rng: random.Random) -> _Problem:
    return _binary(rng, rng.randint(2, 12), "*", rng.randint(2, 30))


def _level3(rng: random.Random) -> _Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return _binary(rng, a, "+", b)
    return _binary(rng, max(a, b), "-", min(a, b))


def _level6(rng: random.Random) -> _Problem:
    a, b, c, d = rng.randint(10, 99), rng.randint(2, 9), rng.randint(10, 99), rng.randint(2, 9)
    question = f"What is ({a} × {b}) − ({c} × {d})?"
    return _Problem(
        ("diff-of-products", a, b, c, d), question, f"{a} * {b} - {c} * {d}", a * b - c * d
    )


# --------------------------------------------------------------------------- word problems


def _cast(rng: random.Random) -> tuple[str, str, str]:
    """Two different names and an item, so templates read naturally."""
    first, second = rng.sample(_NAMES, 2)
    return first, second, rng.choice(_ITEMS)


def _gain_then_give(rng: random.Random) -> _Problem:
    name, friend, item = _cast(rng)
    a, b = rng.randint(5, 50), rng.randint(2, 30)
    c = rng.randint(1, a + b - 1)
    question = (
        f"{name} has {a} {item}. {name} gets {b} more and then gives {c} to {friend}. "
        f"How many {item} does {name} have now?"
    )
    return _Problem(("gain-give", a, b, c), question, f"{a} + {b} - {c}", a + b - c)


def _packs_plus_owned(rng: random.Random) -> _Problem:
    name, _, item = _cast(rng)
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)
    question = (
        f"{name} buys {a} packs of {item} with {b} {item} in each pack. {name} already "
        f"had {c} {item}. How many {item} does {name} have in total?"
    )
    return _Problem(("packs-owned", a, b, c), question, f"{a} * {b} + {c}", a * b + c)


def _daily_minus_lost(rng: random.Random) -> _Problem:
    name, _, item = _cast(rng)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = rng.randint(1, a * b - 1)
    question = (
        f"{name} collects {b} {item} every day for {a} days and then loses {c} of them. "
        f"How many {item} does {name} have left?"
    )
    return _Problem(("daily-lost", a, b, c), question, f"{a} * {b} - {c}", a * b - c)


def _more_than_friend(rng: random.Random) -> _Problem:
    name, friend, item = _cast(rng)
    a, b = rng.randint(2, 50), rng.randint(1, 30)
    question = (
        f"{name} has {a} {item}. {friend} has {b} more {item} than {name}. "
        f"How many {item} do they have together?"
    )
    return _Problem(("more-than", a, b), question, f"{a} + ({a} + {b})", a + a + b)


def _bake_sell_share(rng: random.Random) -> _Problem:
    name, _, item = _cast(rng)
    a, b, d = rng.randint(2, 9), rng.randint(4, 12), rng.randint(2, 6)
    share = rng.randint(1, (a * b - 1) // d)
    c = a * b - share * d
    question = (
        f"{name} bakes {a} trays of {b} {item} each and sells {c} of them. The rest are "
        f"shared equally among {d} friends. How many {item} does each friend get?"
    )
    return _Problem(("bake-share", a, b, c, d), question, f"({a} * {b} - {c}) / {d}", share)


def _restock_sell_half(rng: random.Random) -> _Problem:
    _, _, item = _cast(rng)
    b, c = rng.randint(2, 9), rng.randint(2, 12)
    a = rng.randint(10, 99)
    a += (a + b * c) % 2
    question = (
        f"A shop has {a} {item}. It receives {b} boxes with {c} {item} in each box, "
        f"then sells half of all its {item}. How many {item} does the shop have left?"
    )
    return _Problem(("restock-half", a, b, c), question, f"({a} + {b} * {c}) / 2", (a + b * c) // 2)


def _wage_minus_spent(rng: random.Random) -> _Problem:
    name, _, _ = _cast(rng)
    a, b, c = rng.randint(5, 20), rng.randint(2, 8), rng.randint(2, 6)
    d = rng.randint(1, a * b * c - 1)
    question = (
        f"{name} earns {a} dollars per hour and works {b} hours a day for {c} days, then "
        f"spends {d} dollars. How many dollars does {name} have left?"
    )
    return _Problem(("wage-spent", a, b, c, d), question, f"{a} * {b} * {c} - {d}", a * b * c - d)


def _one_of(*templates: Callable[[random.Random], _Problem]) -> Callable[[random.Random], _Problem]:
    """A generator drawing each question from a randomly chosen template."""
    return lambda rng: rng.choice(templates)(rng)


LEVELS: dict[int, Level] = {
    1: Level("a + b, a and b in 0..30", _level1),
    2: Level("a × b, a in 2..12 and b in 2..30", _level2),
    3: Level("a + b or a - b with two-digit numbers, result >= 0", _level3),
    4: Level(
        "two-step word problems with numbers up to 50",
        _one_of(_gain_then_give, _packs_plus_owned, _daily_minus_lost, _more_than_friend),
    ),
    5: Level(
        "three-step word problems, one with an exact division",
        _one_of(_bake_sell_share, _restock_sell_half, _wage_minus_spent),
    ),
    6: Level("(a × b) − (c × d), two-digit times one-digit, may be negative", _level6),
}


# --------------------------------------------------------------------------- one-step stories


def _story_gain(rng: random.Random) -> _Problem:
    name, friend, item = _cast(rng)
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    question = (f"{name} has {a} {item}. {friend} gives {name} {b} more {item}. "
                f"How many {item} does {name} have now?")
    return _Problem(("story-gain", a, b), question, f"{a} + {b}", a + b)


def _story_give(rng: random.Random) -> _Problem:
    name, friend, item = _cast(rng)
    a = rng.randint(10, 50)
    b = rng.randint(1, a - 1)
    question = (f"{name} has {a} {item} and gives {b} of them to {friend}. "
                f"How many {item} does {name} have left?")
    return _Problem(("story-give", a, b), question, f"{a} - {b}", a - b)


def _story_together(rng: random.Random) -> _Problem:
    name, friend, item = _cast(rng)
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    question = (f"{name} has {a} {item} and {friend} has {b} {item}. "
                f"How many {item} do they have altogether?")
    return _Problem(("story-together", *sorted((a, b))), question, f"{a} + {b}", a + b)


def _story_packs(rng: random.Random) -> _Problem:
    name, _, item = _cast(rng)
    a, b = rng.randint(2, 12), rng.randint(2, 30)
    question = (f"{name} buys {a} packs of {item} with {b} {item} in each pack. "
                f"How many {item} does {name} buy?")
    return _Problem(("story-packs", a, b), question, f"{a} * {b}", a * b)


def _story_rows(rng: random.Random) -> _Problem:
    a, b = rng.randint(2, 12), rng.randint(2, 30)
    question = (f"A hall has {a} rows of chairs with {b} chairs in each row. "
                "How many chairs are in the hall?")
    return _Problem(("story-rows", a, b), question, f"{a} * {b}", a * b)


def _story_weekly(rng: random.Random) -> _Problem:
    name, _, _ = _cast(rng)
    a, b = rng.randint(2, 12), rng.randint(2, 30)
    question = (f"{name} saves {b} dollars every week for {a} weeks. "
                f"How many dollars does {name} save?")
    return _Problem(("story-weekly", a, b), question, f"{a} * {b}", a * b)


WORD_LEVELS: dict[int, Level] = {
    1: Level("one-step stories adding or taking away, numbers up to 50",
             _one_of(_story_gain, _story_give, _story_together)),
    2: Level("one-step stories a × b, a in 2..12 and b in 2..30",
             _one_of(_story_packs, _story_rows, _story_weekly)),
    4: LEVELS[4],
    5: LEVELS[5],
}
#: the synthetic data sources (``data.source``) and their levels
#: the built-in tasks by ``data.source`` name, each a dict of its levels
SYNTHETIC_TASKS: dict[str, dict[int, Level]] = {"synthetic": LEVELS,
                                                "synthetic-words": WORD_LEVELS}
#: the former name of :data:`SYNTHETIC_TASKS`
VARIANTS = SYNTHETIC_TASKS


# --------------------------------------------------------------------------- dataset


def split_of(key: tuple[int | str, ...]) -> str:
    """The split a question key belongs to: a fixed hash, independent of any seed."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return "test" if int.from_bytes(digest[:4], "big") % 100 < _TEST_PERCENT else "train"


def _sample_level(source: str, level: int, split: str, count: int,
                  seed: int) -> list[_Problem]:
    """``count`` distinct questions of one level from one split, reproducible by seed."""
    rng = random.Random(f"{_stream(source)}/{seed}/{split}/{level}")
    found: dict[tuple[int | str, ...], _Problem] = {}
    for _ in range(max(_MIN_DRAWS, _DRAWS_PER_QUESTION * count)):
        if len(found) == count:
            break
        problem = SYNTHETIC_TASKS[source][level].generate(rng)
        key = (level, *problem.key)
        if key not in found and split_of(key) == split:
            found[key] = problem
    if len(found) < count:
        raise UserError(
            f"level {level} has only {len(found)} distinct {split} questions; asked for "
            f"{count}: ask for fewer prompts or add levels"
        )
    return list(found.values())


def _stream(source: str) -> str:
    """The random stream's name: the arithmetic task keeps its original one, so its
    questions do not change with the variants added next to it."""
    return "fp4rl-synthetic" if source == "synthetic" else f"fp4rl-{source}"


def _check(split: str, n: int, levels: Sequence[int], source: str) -> tuple[int, ...]:
    if source not in SYNTHETIC_TASKS:
        raise UserError(f"unknown synthetic source {source!r}; choose one of: "
                         f"{', '.join(SYNTHETIC_TASKS)}")
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if n < 0:
        raise UserError(f"n must be >= 0, got {n}")
    chosen = tuple(sorted(set(levels)))
    known = sorted(SYNTHETIC_TASKS[source])
    unknown = [level for level in chosen if level not in known]
    if not chosen or unknown:
        raise UserError(f"levels must be a non-empty subset of {known} for {source}, got "
                         f"{levels}")
    return chosen


def synthetic_dataset(
    split: str = "train",
    n: int = 1000,
    levels: Sequence[int] = (1, 2),
    seed: int = 0,
    source: str = "synthetic",
) -> list[Example]:
    """``n`` distinct questions from ``levels`` of ``source`` (``synthetic``: arithmetic,
    ``synthetic-words``: word problems), shuffled, as Examples.

    ``n`` is spread evenly over the levels (the lower levels take any remainder) so that
    per-level accuracy can be read off ``Example.meta["level"]``. The same arguments always
    give the same list; a larger ``n`` extends each level's questions rather than redrawing
    them. Raises ``ValueError`` if a level's split cannot supply its share of distinct
    questions (level 1 has 496 in all, level 2 has 264).
    """
    chosen = _check(split, n, levels, source)
    shares = [n // len(chosen) + (i < n % len(chosen)) for i in range(len(chosen))]
    drawn = [
        (level, problem)
        for level, share in zip(chosen, shares, strict=True)
        for problem in _sample_level(source, level, split, share, seed)
    ]
    random.Random(f"{_stream(source)}/{seed}/{split}/order").shuffle(drawn)
    return [
        Example(
            prompt=problem.question,
            answer=f"#### {problem.answer}",
            reward="gsm8k",
            source=source,
            index=index,
            meta={"level": level, "expression": problem.expression},
        )
        for index, (level, problem) in enumerate(drawn)
    ]
