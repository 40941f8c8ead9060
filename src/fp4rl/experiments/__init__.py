"""The paper's experiments: grids of GRPO runs, run cell by cell, reported as its tables."""

from fp4rl.experiments.grid import (
    KINDS,
    PLANS,
    PRESETS,
    Cell,
    EvalSpec,
    ExperimentPlan,
    ExperimentPreset,
    check_seeds,
    get_plan,
    get_preset,
    grid_cells,
    seeded_cells,
    select_cells,
)
from fp4rl.experiments.report import write_report
from fp4rl.experiments.runner import (
    Experiment,
    cell_config,
    load_result,
    load_results,
    run_cell,
    run_cells,
)

__all__ = ["KINDS", "PLANS", "PRESETS", "Cell", "EvalSpec", "Experiment", "ExperimentPlan",
           "ExperimentPreset", "cell_config", "check_seeds", "get_plan", "get_preset",
           "grid_cells", "load_result",
           "load_results", "run_cell", "run_cells", "seeded_cells", "select_cells",
           "write_report"]
