"""The plans whose results docs/results.md publishes run the settings those results were
computed with: every committed ``result.json`` records its cell's whole config as run,
and the plan, asked for the same cell and seed, must give that config again. Otherwise
``fp4rl experiment ... --plan tiny3`` would rerun something else than the tables
(fp32 compute, say, where the plan picked bf16) and could not match them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _paths import ROOT

from fp4rl.experiments.grid import Cell, get_plan
from fp4rl.experiments.runner import Experiment, cell_config
from fp4rl.rl.config import validate

RESULTS = ROOT / "docs" / "figures" / "results"
#: committed result directories run with their plan as it is, no ``--set``: directory -> plan
PLAIN_RUNS = {"tiny3": "tiny3", "field": "field"}
#: settings recorded as resolved at run time, where the plan leaves the choice to the machine:
#: key -> (the plan's value, the value recorded)
RESOLVED = {"device": ("auto", "cpu"), "distributed.strategy": ("auto", "none")}


def recorded(directory: str) -> list[Path]:
    files = sorted((RESULTS / directory).glob("**/result.json"))
    assert files, f"no committed result files under {RESULTS / directory}"
    return files


def differences(recorded: object, planned: object, where: str = "") -> list[str]:
    """Where ``planned`` differs from ``recorded``, key by key."""
    if isinstance(recorded, dict) and isinstance(planned, dict):
        return [d for key in recorded.keys() | planned.keys()
                for d in differences(recorded.get(key, "<absent>"),
                                     planned.get(key, "<absent>"), f"{where}.{key}")]
    return [] if recorded == planned else [f"{where.lstrip('.')}: run {recorded!r}, "
                                           f"plan {planned!r}"]


def pop(data: dict[str, Any], dotted: str) -> object:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    return data.pop(last)


@pytest.mark.parametrize(("directory", "plan_name"), PLAIN_RUNS.items())
def test_a_plan_gives_the_config_its_committed_runs_recorded(directory, plan_name, tmp_path):
    plan = get_plan(plan_name)
    checked = 0
    for path in recorded(directory):
        result = json.loads(path.read_text())
        # read by today's config model, as a resume would: a value spelled otherwise since
        # (an unquantized operand's "bf16", now "none") compares as it is meant, and a
        # setting added after the run was made takes its default, which it ran with
        run = validate(result["config"]).model_dump(mode="json")
        # a cell's config is the plan's, its recipe's and its seed's, whatever its grid
        exp = Experiment("precision", plan, tmp_path, plan.formats, seeds=plan.seeds)
        planned = cell_config(exp, Cell(result["cell"], None, "", result["seed"]))
        planned_data = planned.model_dump(mode="json")
        for key, (plan_value, run_value) in RESOLVED.items():
            assert (pop(planned_data, key), pop(run, key)) == (plan_value, run_value), key
        assert not differences(run, planned_data), (path.relative_to(ROOT),
                                                    differences(run, planned_data))
        checked += 1
    assert checked >= 10


def test_the_published_precision_tables_were_computed_in_fp32():
    """What the docs tell a reader who reruns Table 1: fp32, the direct-answer prompt."""
    configs = [json.loads(p.read_text())["config"] for p in recorded("tiny3")]
    assert {c["mixed_precision"] for c in configs} == {"no"}
    assert {c["data"]["template"] for c in configs} == {"direct"}
    assert get_plan("tiny3").changes["mixed_precision"] == "no"
