"""The paper's experiment grids as lists of cells, and the plans that size them.

A cell is one GRPO run named by its recipe name (``"hif4:bf16/fp4"``,
``"mxfp4+resq-2:4"``, ``"bf16"``) and, in a multi-seed grid, its seed. Names are
canonical, so the cells two grids have in common (BF16, and plain FP4 = "FP4 train / FP4
rollout" = "recovery: none") are run once when both grids write to the same directory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import JsonValue

from fp4rl.errors import UserError, did_you_mean
from fp4rl.nn.recipe import Recipe, field_recipe_names, get_recipe, quantized_formats
from fp4rl.presets import preset_path
from fp4rl.recovery import recovery_variants

KINDS = ("precision", "recovery", "field")
#: the paper's recipe each format runs in the ``field`` grid beside the field's
FIELD_PAPER_SUFFIX = "resq-2:4"
#: rows of the paper's Table 1: (train, rollout)
PRECISION_ROWS = (("bf16", "bf16"), ("fp4", "bf16"), ("fp4", "w4a16"), ("fp4", "w4a8"),
                  ("fp4", "w16a4"), ("fp4", "fp4"), ("bf16", "fp4"))
#: rows this toolkit adds: FP4 training with the HiFloat4 authors' simulated backward
#: (the forward's Q(W), Q(X) reused in both backward GEMMs) under a BF16 rollout
BEYOND_PRECISION_ROWS = (("fp4-reuse", "bf16"),)
TRAIN_LABELS = {"fp4-reuse": "FP4 (reuse_forward)"}


def precision_rows() -> tuple[tuple[str, str], ...]:
    """Every row of the precision grid: the paper's, then this toolkit's."""
    return PRECISION_ROWS + BEYOND_PRECISION_ROWS


def train_label(train: str) -> str:
    """How a table names a training precision: "FP4", "FP4 (reuse_forward)"."""
    return TRAIN_LABELS.get(train, train.upper())


def precision_label(train: str, rollout: str) -> str:
    """A row's label, "FP4 / BF16"."""
    return f"{train_label(train)} / {rollout.upper()}"


@dataclass(frozen=True)
class Cell:
    """One GRPO run of a grid: its recipe name, where it sits in the table and its seed
    (None: the config's ``run.seed``, as in a single-seed grid)."""

    name: str  # canonical recipe name
    fmt: str | None  # FP4 format of the column/row group; None for the BF16 baseline
    row: str  # row label in the table
    seed: int | None = None

    @property
    def slug(self) -> str:
        """A directory name: the recipe name with ``:``, ``/`` and ``+`` replaced."""
        return re.sub(r"[^A-Za-z0-9.-]+", "_", self.name)

    @property
    def label(self) -> str:
        """The name, and the seed where one was chosen: what progress messages show."""
        return self.name if self.seed is None else f"{self.name} (seed {self.seed})"

    def recipe(self) -> Recipe:
        return get_recipe(self.name)


def check_seeds(seeds: Sequence[int]) -> tuple[int, ...]:
    """The seeds of a multi-seed grid, refusing what would name no run or one run twice."""
    bad = [s for s in seeds if s < 0]
    if bad or not seeds:
        raise UserError(f"--seeds takes one or more non-negative integers, got {list(seeds)}")
    repeated = sorted({s for s in seeds if list(seeds).count(s) > 1})
    if repeated:
        raise UserError(f"--seeds names seed {repeated[0]} twice: each seed is one run per cell")
    return tuple(seeds)


def seeded_cells(cells: list[Cell], seeds: Sequence[int]) -> list[Cell]:
    """Every cell once per seed, seed by seed: a partial run already holds whole grids of
    its first seeds."""
    return [replace(c, seed=s) for s in seeds for c in cells]


def precision_name(fmt: str, train: str, rollout: str) -> str:
    """Canonical recipe name of a Table 1 cell."""
    if (train, rollout) == ("bf16", "bf16"):
        return "bf16"
    return fmt if (train, rollout) == ("fp4", "fp4") else f"{fmt}:{train}/{rollout}"


def grid_cells(kind: str, formats: tuple[str, ...]) -> list[Cell]:
    """The cells of a grid, BF16 first, then row by row (all formats of a row together),
    so that a partial run already fills whole rows of the table."""
    if kind not in KINDS:
        raise UserError(f"unknown experiment {kind!r}; choose one of {', '.join(KINDS)}")
    bad = [f for f in formats if f not in quantized_formats()]
    if bad or not formats:
        raise UserError(f"experiment formats must be among {', '.join(quantized_formats())}"
                        f"{did_you_mean(bad[0], quantized_formats()) if bad else ''}, got "
                         f"{list(formats)}")
    cells = [Cell("bf16", None, "BF16")]
    if kind == "precision":
        for train, rollout in precision_rows()[1:]:
            cells += [Cell(precision_name(f, train, rollout), f, precision_label(train, rollout))
                      for f in formats]
    elif kind == "field":  # the paper's headline recipe per format, then the field's
        cells += [Cell(f"{f}+{FIELD_PAPER_SUFFIX}", f, "ResQ (2:4), the paper's")
                  for f in formats]
        cells += [Cell(name, "nvfp4", name) for name in field_recipe_names()]
    else:
        for suffix, label in recovery_variants():  # the rows of the paper's Tables 2 and 4
            cells += [Cell(f"{f}+{suffix}" if suffix else f, f, label) for f in formats]
    return cells


def select_cells(cells: list[Cell], names: list[str]) -> list[Cell]:
    """The cells named (in the order given); an unknown name raises, listing the grid's."""
    by_name = {c.name: c for c in cells}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        hint = did_you_mean(unknown[0], list(by_name))
        raise UserError(f"no cell {unknown} in this grid{hint}; its cells are: "
                        f"{', '.join(by_name)}")
    return [by_name[n] for n in dict.fromkeys(names)]


@dataclass(frozen=True)
class EvalSpec:
    """One benchmark column: the config's own test split (``data`` None) or LAYOUT:PATH."""

    name: str
    data: str | None = None

    @classmethod
    def parse(cls, text: str) -> EvalSpec:
        name, sep, data = text.partition("=")
        if not sep or not name or ":" not in data:
            raise UserError(f"--eval {text!r}: give NAME=LAYOUT:PATH, e.g. "
                            "Math500=math500:/data/math500.jsonl")
        return cls(name, data)


@dataclass(frozen=True)
class ExperimentPlan:
    """An experiment plan (``fp4rl experiment --plan``): the base config of every cell, the
    benchmarks it is scored on, the FP4 formats, the seeds and its cut of the grid."""

    name: str
    description: str
    config: str | None = None  # a config preset (None: ``changes`` is everything)
    changes: dict[str, JsonValue] = field(default_factory=dict)
    evals: tuple[EvalSpec, ...] = ()
    formats: tuple[str, ...] = ("hif4", "mxfp4")
    seeds: tuple[int, ...] = ()  # default --seeds; () runs the config's run.seed only
    #: per grid kind, the cells run when --cells names none (absent: the whole grid), with
    #: ``{f}`` standing for each format; the report checks the claims these cells settle
    cells: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def grid(self, kind: str, formats: tuple[str, ...]) -> list[Cell]:
        """The cells of this plan's grid: its own cut of the paper's grid, or all of it."""
        cells = grid_cells(kind, formats)
        if kind not in self.cells:
            return cells
        names = {n.format(f=f) for n in self.cells[kind] for f in formats}
        return [c for c in cells if c.name in names]

    def config_path(self) -> Path | None:
        return None if self.config is None else preset_path(self.config)


TINY = ExperimentPlan(
    "tiny",
    "smollm2-135m on the synthetic arithmetic task (levels 1-2), 16 GRPO steps of 4 prompts "
    "x 8 samples, scored greedily on 100 test prompts: 9-23 CPU-minutes per cell",
    changes={
        "model": "smollm2-135m",
        "mixed_precision": "auto",
        "data": {"source": "synthetic", "levels": [1, 2], "train_size": 400, "test_size": 100},
        "grpo": {"num_generations": 8, "batch_size": 4, "micro_batch_size": 16,
                 "learning_rate": 1.0e-5, "temperature": 0.8, "max_prompt_length": 256,
                 "max_response_length": 48},
        "eval": {"mean_at_k": 1, "max_new_tokens": 48},
        "run": {"steps": 16, "seed": 0, "save_steps": 4, "keep_checkpoints": 1},
    },
    evals=(EvalSpec("synthetic"),),
)
TINY3 = ExperimentPlan(
    "tiny3",
    "smollm2-135m on the synthetic word problems (one-step stories, levels 1-2) with the "
    "direct-answer prompt, 32 GRPO steps of 4 prompts x 8 samples, seeds 0 to 4, scored "
    "greedily on the same 300 test prompts for every seed, in fp32: a run (one cell, one "
    "seed) took 5-91 minutes, median 18, on one core, two at a time",
    # the published tables' settings, as their result files record them: fp32 compute
    # (``auto`` would pick bf16 on a CPU with native bf16, and a rerun could not match);
    # ``--set mixed_precision=bf16`` on a GPU
    changes={
        "model": "smollm2-135m",
        "mixed_precision": "no",
        "data": {"source": "synthetic-words", "levels": [1, 2], "train_size": 800,
                 "test_size": 300, "template": "direct"},
        "grpo": {"num_generations": 8, "batch_size": 4, "micro_batch_size": 16,
                 "learning_rate": 2.0e-5, "temperature": 1.0, "max_prompt_length": 256,
                 "max_response_length": 16},
        "eval": {"mean_at_k": 1, "max_new_tokens": 16, "prompt_seed": 0},
        "run": {"steps": 32, "seed": 0, "save_steps": 8, "keep_checkpoints": 1},
    },
    evals=(EvalSpec("synthetic-words"),),
    formats=("hif4", "mxfp4"),
    seeds=(0, 1, 2, 3, 4),
    # Table 1's rollout rows that locate the loss (W4A16 vs W16A4: weights or activations;
    # BF16 / FP4: training or rollout), and Table 2's headline recovery
    cells={"precision": ("bf16", "{f}:fp4/bf16", "{f}:fp4/w4a16", "{f}:fp4/w16a4", "{f}",
                         "{f}:bf16/fp4", "{f}:fp4-reuse/bf16"),
           "recovery": ("bf16", "{f}", "{f}+resq-2:4", "{f}+resqw-2:4")},
)
PAPER_3B = ExperimentPlan(
    "paper-3b",
    "Qwen2.5-3B on GSM8K (config preset qwen2.5-3b-gsm8k); set model and data paths with "
    "--set, add MATH-500 with --eval Math500=math500:PATH",
    config="qwen2.5-3b-gsm8k",
    evals=(EvalSpec("GSM8K-test"),),
)
PAPER_7B = ExperimentPlan(
    "paper-7b",
    "Qwen2.5-Math-7B on DAPO-Math-17K (config preset qwen2.5-math-7b-dapo), HiF4 only, "
    "Mean@32; give the benchmarks with --eval AIME24=aime24:PATH (and AIME25, AMC23, Math500)",
    config="qwen2.5-math-7b-dapo",
    formats=("hif4",),
)
FIELD = ExperimentPlan(
    "field",
    "the field's FP4 RL recipes (nemo-rl-nvfp4, miles-nvfp4, torchao-nvfp4) beside BF16 and "
    "the paper's HiF4 and MXFP4 + ResQ-2:4, on tiny3's task and settings (smollm2-135m, "
    "synthetic word problems, 32 GRPO steps of 4 prompts x 8 samples, seeds 0 to 4, the "
    "same 300 test prompts for every seed); `fp4rl experiment field --plan field --device "
    "cuda` on a GPU",
    changes=TINY3.changes,
    evals=TINY3.evals,
    formats=("hif4", "mxfp4"),
    seeds=(0, 1, 2, 3, 4),
)
PLANS = {p.name: p for p in (TINY, TINY3, FIELD, PAPER_3B, PAPER_7B)}


def get_plan(name: str) -> ExperimentPlan:
    """The experiment plan called ``name``; an unknown one is one line with the choices."""
    if name not in PLANS:
        raise ValueError(f"unknown experiment plan {name!r}; choose one of "
                         f"{', '.join(PLANS)}")
    return PLANS[name]

