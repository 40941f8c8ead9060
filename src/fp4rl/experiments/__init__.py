"""The paper's experiments: grids of GRPO runs, run cell by cell, reported as its tables."""

from fp4rl.experiments.grid import (
    KINDS,
    PLANS,
    Cell,
    EvalSpec,
    ExperimentPlan,
    check_seeds,
    get_plan,
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

__all__ = ["KINDS", "PLANS", "Cell", "EvalSpec", "Experiment", "ExperimentPlan",
           "cell_config", "check_seeds", "get_plan", "grid_cells", "load_result",
           "load_results", "run_cell", "run_cells", "seeded_cells", "select_cells",
           "write_report"]
