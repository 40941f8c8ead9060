"""Experiment grids: cells, configs, the resumable runner and the paper-layout tables."""

from __future__ import annotations

import json
import os
import socket

import pytest
from _paths import FIXTURES

import fp4rl.experiments as experiments
from fp4rl.cli import main
from fp4rl.errors import UserError
from fp4rl.experiments import (
    EvalSpec,
    Experiment,
    cell_config,
    get_plan,
    grid_cells,
    load_result,
    run_cells,
    runner,
)
from fp4rl.experiments.report import mismatch_table, precision_table, recovery_table
from fp4rl.recovery.sparsity import Block
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.config import ConfigError
from fp4rl.rl.rundir import METRICS, read_metrics
from fp4rl.rollout.mismatch import nemo_rl_means, nemo_rl_verdict

SMALL = ["run.steps=2", "run.save_steps=1", "grpo.num_generations=4", "grpo.batch_size=2",
         "grpo.max_response_length=4", "data.train_size=8", "data.test_size=3",
         "eval.max_new_tokens=4"]


def _experiment(tmp_path, tiny_llama_dir, kind="recovery", formats=("hif4",)):
    return Experiment(kind, get_plan("tiny"), tmp_path / "out", formats,
                      (f"model={tiny_llama_dir}", *SMALL))


def test_grids_have_the_paper_rows_and_share_cells():
    precision = grid_cells("precision", ("hif4", "mxfp4"))
    recovery = grid_cells("recovery", ("hif4", "mxfp4"))
    # the paper's 8 recovery rows per format, then ResQ-W (beyond the paper)
    # Table 1's 6 rows per format, then the authors' simulated backward (beyond the paper)
    assert len(precision) == 1 + 7 * 2 and len(recovery) == 1 + 9 * 2
    assert [c.name for c in recovery if c.fmt == "hif4"][-2:] == ["hif4+resq-2:4",
                                                                    "hif4+resqw-2:4"]
    assert {c.name for c in precision} & {c.name for c in recovery} == {"bf16", "hif4", "mxfp4"}
    assert [c.name for c in precision if c.fmt == "mxfp4"] == [
        "mxfp4:fp4/bf16", "mxfp4:fp4/w4a16", "mxfp4:fp4/w4a8", "mxfp4:fp4/w16a4", "mxfp4",
        "mxfp4:bf16/fp4", "mxfp4:fp4-reuse/bf16"]
    reuse = precision[-1]
    assert reuse.row == "FP4 (reuse_forward) / BF16" and reuse.slug == "mxfp4_fp4-reuse_bf16"
    assert reuse.recipe().train.backward_operands == "reuse_forward"
    assert {c.recipe().train.backward_operands for c in precision[:-2]} == {"requantize"}
    rec = {c.name: c.recipe() for c in recovery}
    assert rec["hif4+resq-block:32x64:0.5"].rollout.recovery.config.sparsity == Block(32, 64, 0.5)
    assert rec["mxfp4+smoothquant"].rollout.recovery.method == "smoothquant"
    assert len({c.slug for c in recovery}) == len(recovery)
    with pytest.raises(ValueError, match="hif4, mxfp4, nvfp4"):
        grid_cells("recovery", ("fp8",))
    with pytest.raises(ValueError, match="precision, recovery"):
        grid_cells("table9", ("hif4",))


def test_eval_spec_and_preset_errors():
    assert EvalSpec.parse("Math500=math500:/d/m.jsonl") == EvalSpec("Math500",
                                                                    "math500:/d/m.jsonl")
    with pytest.raises(ValueError, match="NAME=LAYOUT:PATH"):
        EvalSpec.parse("math500.jsonl")
    with pytest.raises(ValueError, match="unknown experiment plan 'huge'; choose one of tiny, "
                                         "tiny3, field, paper-3b, paper-7b"):
        get_plan("huge")


def test_cell_config_layers_preset_overrides_and_recipe(tmp_path):
    exp = Experiment("precision", get_plan("tiny"), tmp_path, ("hif4",),
                     ("grpo.learning_rate=3e-5", "train.stochastic_gradients=true"))
    cells = {c.name: c for c in grid_cells("precision", ("hif4",))}
    cfg = cell_config(exp, cells["hif4:bf16/fp4"])
    assert cfg.grpo.learning_rate == 3e-5 and cfg.grpo.num_generations == 8
    assert (str(cfg.train.weights), str(cfg.rollout.activations)) == ("none", "hif4")
    # a training option the cell's name does not fix comes through --set
    assert cfg.train.stochastic_gradients is True
    assert cfg.train.backward_operands == "requantize"
    reuse = cell_config(exp, cells["hif4:fp4-reuse/bf16"])
    assert (str(reuse.train.weights), reuse.train.backward_operands) == ("hif4",
                                                                               "reuse_forward")
    # what every cell sets from its name cannot be --set: it would be silently ignored
    for item in ("train.weights=bf16", "train.backward_operands=reuse_forward",
                 "rollout.recovery.method=resq"):
        bad = Experiment("precision", get_plan("tiny"), tmp_path, ("hif4",), (item,))
        with pytest.raises(UserError, match=f"--set {item.split('=')[0]}: each cell's recipe"):
            cell_config(bad, cells["hif4"])
    paper = Experiment("recovery", get_plan("paper-3b"), tmp_path, ("hif4",))
    cfg = cell_config(paper, grid_cells("recovery", ("hif4",))[1])  # runs as it is: Hub ids
    assert cfg.model == "Qwen/Qwen2.5-3B"
    assert cfg.data.train_path.startswith("hf://datasets/openai/gsm8k/")
    placeholder = Experiment("recovery", get_plan("paper-3b"), tmp_path, ("hif4",),
                             ("model=/path/to/Qwen2.5-3B",))
    with pytest.raises(ConfigError, match="--set model="):
        cell_config(placeholder, grid_cells("recovery", ("hif4",))[1])


def test_grid_runs_resumes_and_never_reruns_a_finished_cell(tmp_path, tiny_llama_dir, monkeypatch):
    exp = _experiment(tmp_path, tiny_llama_dir)
    cells = grid_cells("recovery", ("hif4",))[:3]
    # an interrupted cell: one step done and checkpointed, then killed
    first = cells[1]
    first_run = exp.cell_dir(first) / "run"
    from fp4rl.rl.trainer import Trainer

    Trainer.from_config(cell_config(exp, first), first_run, log=lambda m: None).train(steps=1)
    (exp.cell_dir(first) / runner.INITIAL).write_text(json.dumps(
        {"rollout": {"synthetic": {"mean@1": 0.0, "n": 3}}, "seconds": 0.0}))
    seen = []
    run_cells(exp, cells, on_status=lambda c, s: seen.append((c.name, s)))
    assert all(load_result(exp, c) is not None for c in cells)
    assert [r["step"] for r in read_metrics(first_run / METRICS)] == [1, 2]
    result = load_result(exp, cells[2])
    assert len(result["rewards"]) == 2 and set(result) >= {"initial", "rollout", "bf16"}
    for policy in ("initial", "rollout", "bf16"):  # per-prompt outcomes, for paired gaps
        scores = result[policy]["synthetic"]
        assert len(scores["correct"]) == scores["n"] == 3
    assert result["rollout"]["synthetic"]["prompts"] == result["initial"]["synthetic"]["prompts"]
    text = (exp.cell_dir(cells[2]) / runner.RESULT).read_text()
    assert '"correct": [' in text and '"rewards": [' in text  # number lists on one line
    assert not list((exp.cell_dir(cells[2]) / "run").glob("checkpoints/*/optimizer.pt"))
    assert ckpt.latest_checkpoint(exp.cell_dir(cells[2]) / "run") is not None

    def boom(*args, **kwargs):
        raise AssertionError("a finished cell ran again")

    monkeypatch.setattr(runner, "run_cell", boom)
    seen.clear()
    run_cells(exp, cells, on_status=lambda c, s: seen.append((c.name, s)))
    assert seen == [(c.name, "finished earlier") for c in cells]


def test_cell_lock_skips_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    lock = tmp_path / runner.LOCK
    lock.write_text(f"{socket.gethostname()} {os.getpid()}")
    with runner.cell_lock(tmp_path) as mine:
        assert not mine
    lock.write_text(f"{socket.gethostname()} 999999999")  # no such process
    with runner.cell_lock(tmp_path) as mine:
        assert mine and lock.read_text().endswith(str(os.getpid()))
    assert not lock.exists()


def _fake(acc_rollout, acc_bf16=None):
    def scores(a):
        return {"synthetic": {"mean@1": a, "n": 100}}

    return {"rollout": scores(acc_rollout), "bf16": scores(acc_bf16 or acc_rollout),
            "initial": scores(acc_rollout), "rewards": [0.1, 0.2], "train_seconds": 1.0,
            "eval_seconds": 1.0, "torch_threads": 1, "config": {}}


def test_tables_follow_the_paper_layout_with_gaps_to_bf16():
    """Result files without per-prompt outcomes (written before they were stored) give
    means and plain gaps, as single-seed tables always did."""
    results = {"bf16": {0: _fake(0.80)}, "hif4": {0: _fake(0.75)},
               "hif4:bf16/fp4": {0: _fake(0.70)}, "mxfp4": {0: _fake(0.60)}}
    lines = precision_table(results, ("hif4", "mxfp4"), "synthetic", "rollout")
    assert lines[0] == ("| Train | Rollout | FP4 = HiF4 | HiF4: bootstrap [95%] (secondary) "
                        "| FP4 = MXFP4 | MXFP4: bootstrap [95%] (secondary) |")
    assert lines[2] == "| BF16 | BF16 | 80.0 | -- | 80.0 | -- |"
    assert lines[7] == "| FP4 | FP4 | 75.0 (-5.0) | -- | 60.0 (-20.0) | -- |"
    assert lines[8] == "| BF16 | FP4 | 70.0 (-10.0) | -- | -- | -- |"
    assert lines[9] == "| FP4 (reuse_forward) | BF16 | -- | -- | -- | -- |"
    cut = precision_table(results, ("hif4",), "synthetic", "rollout",
                          cells={"bf16", "hif4", "hif4:fp4-reuse/bf16"})
    assert [line.split(" | ")[:2] for line in cut[2:]] == [
        ["| BF16", "BF16"], ["| FP4", "FP4"], ["| FP4 (reuse_forward)", "BF16"]]
    cells = grid_cells("recovery", ("hif4",))
    rec = recovery_table({"bf16": {0: _fake(0.5)}, "hif4+resq-2:4": {0: _fake(0.45)}}, cells,
                         ["synthetic"], "rollout")
    assert rec[0] == "| Format | Recovery | synthetic | synthetic: bootstrap [95%] (secondary) |"
    assert rec[2] == "| BF16 | -- | 50.0 | -- |"
    assert rec[3] == "| HiF4 | -- | -- | -- |"
    assert rec[-2] == "|  | ResQ (2:4) | 45.0 (-5.0) | -- |"
    assert rec[-1] == "|  | ResQ-W (2:4, weights too) | -- | -- |"  # beyond the paper, not run


def test_cli_experiment_writes_the_report(tmp_path, tiny_llama_dir):
    out = tmp_path / "exp"
    args = ["experiment", "precision", "--output", str(out), "--format", "hif4",
            "--set", f"model={tiny_llama_dir}", *[a for s in SMALL for a in ("--set", s)]]
    assert main(args) == 0
    text = (out / "precision.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| FP4 | W4A8 |"))
    assert row.count("(") == 2  # accuracy (gap to BF16), and the bootstrap's, for one format
    assert (out / "precision_rewards.png").is_file()
    payload = json.loads((out / "precision.json").read_text())
    assert len(payload["cells"]) == 8 and all(set(c["runs"]) == {"0"} and "rollout" in
                                              c["runs"]["0"] for c in payload["cells"])
    assert main([*args, "--report-only"]) == 0


def test_parallel_cells_run_in_worker_processes(tmp_path, tiny_llama_dir):
    exp = _experiment(tmp_path, tiny_llama_dir, kind="precision", formats=("mxfp4",))
    cells = grid_cells("precision", ("mxfp4",))[:2]
    seen = []
    run_cells(exp, cells, jobs=2, on_status=lambda c, s: seen.append((c.name, s)))
    assert {(c.name, "done") for c in cells} <= set(seen)
    assert all(load_result(exp, c)["torch_threads"] >= 1 for c in cells)
    assert all((exp.cell_dir(c) / "log.txt").read_text().strip() for c in cells)


def test_paper_preset_reads_local_weights_data_and_extra_benchmarks(tmp_path, tiny_llama_dir):
    data = FIXTURES / "data"
    out = tmp_path / "paper"
    small = [s for s in SMALL if not s.startswith("data.")] + [
        "grpo.max_prompt_length=512", "data.train_size=4", "data.test_size=2"]
    args = ["experiment", "recovery", "--plan", "paper-3b", "--output", str(out),
            "--format", "hif4", "--set", f"model={tiny_llama_dir}",
            "--set", f"data.train_path={data / 'gsm8k.jsonl'}",
            "--set", f"data.test_path={data / 'gsm8k.jsonl'}",
            "--eval", f"Math500=math500:{data / 'math500.jsonl'}",
            *[a for s in small for a in ("--set", s)]]
    assert main([*args, "--report-only"]) == 0  # nothing run yet: every cell is '--'
    assert "| HiF4 | -- | -- | -- |" in (out / "recovery.md").read_text()
    assert main(args) == 0
    text = (out / "recovery.md").read_text()
    assert ("| Format | Recovery | GSM8K-test | GSM8K-test: bootstrap [95%] (secondary) | "
            "Math500 | Math500: bootstrap [95%] (secondary) |") in text
    assert "| HiF4 | -- | -- |" not in text
    result = json.loads((out / "cells" / "hif4_resq-2_4" / "result.json").read_text())
    assert set(result["rollout"]) == {"GSM8K-test", "Math500"}
    assert result["rollout"]["Math500"]["n"] == 2


def test_a_cell_finished_by_another_runner_is_not_run_again(tmp_path, monkeypatch):
    exp = Experiment("recovery", get_plan("tiny"), tmp_path, ("hif4",))
    cell = grid_cells("recovery", ("hif4",))[0]
    exp.cell_dir(cell).mkdir(parents=True)
    (exp.cell_dir(cell) / runner.RESULT).write_text("{}")

    def boom(*args, **kwargs):
        raise AssertionError("ran a finished cell")

    monkeypatch.setattr(runner, "run_cell", boom)
    assert runner._run_in_worker(exp, cell) == "finished earlier"


def test_select_cells_by_name():
    from fp4rl.experiments import select_cells

    cells = grid_cells("recovery", ("hif4", "mxfp4"))
    chosen = select_cells(cells, ["mxfp4+resq-2:4", "hif4+resq-2:4", "mxfp4+resq-2:4"])
    assert [c.name for c in chosen] == ["mxfp4+resq-2:4", "hif4+resq-2:4"]
    with pytest.raises(ValueError, match="its cells are: bf16, hif4, mxfp4"):
        select_cells(cells, ["hif4+resq-3:4"])


def test_the_mismatch_table_holds_each_cell_to_nemo_rls_limits():
    """Means over the steps (each run's file) and over the seeds, against NeMo-RL's CI
    limits; a cell whose runs logged none is left out."""
    def run(tmpe, gkl):
        return {**_fake(0.5), "mismatch": {"mismatch/token_mult_prob_error": tmpe,
                                           "mismatch/gen_kl_error": gkl}}

    cells = grid_cells("recovery", ("hif4",))
    results = {"bf16": {0: run(1.0, 0.002), 1: run(1.1, 0.004)},
               "hif4+resq-2:4": {0: run(9.0, 0.3)}, "hif4": {0: _fake(0.4)}}
    lines = mismatch_table(results, cells)
    assert lines[4] == "| cell | seeds | token_mult_prob_error (< 1.15) | gen_kl_error (< 0.1) |"
    assert lines[6:8] == ["| bf16 | 2 | 1.05 ok | 0.003 ok |",
                          "| hif4+resq-2:4 | 1 | 9 OVER | 0.3 OVER |"]
    assert mismatch_table({"hif4": {0: _fake(0.4)}}, cells) == []


def test_a_runs_mismatch_means_and_verdict():
    rows = [{"mismatch/token_mult_prob_error": 1.0, "mismatch/gen_kl_error": 0.0},
            {"mismatch/token_mult_prob_error": 1.4}, {"reward_mean": 0.5}]
    means = nemo_rl_means(rows)
    assert means == pytest.approx({"mismatch/token_mult_prob_error": 1.2,
                                   "mismatch/gen_kl_error": 0.0})
    assert nemo_rl_verdict(means) == ("token_mult_prob_error 1.2 (over NeMo-RL's < 1.15); "
                                      "gen_kl_error 0 (within NeMo-RL's < 0.1)")


def test_the_field_grid_puts_the_fields_recipes_beside_the_papers():
    from fp4rl.experiments.claims import grid_claims
    from fp4rl.nn.recipe import field_recipe_names

    cells = get_plan("field").grid("field", ("hif4", "mxfp4"))
    assert [c.name for c in cells] == ["bf16", "hif4+resq-2:4", "mxfp4+resq-2:4",
                                       *field_recipe_names()]
    assert all(c.recipe() for c in cells)  # each a recipe by name
    claims = grid_claims("field", ("hif4", "mxfp4"))
    assert {(c.better, c.worse) for c in claims} >= {
        ("torchao-nvfp4", "bf16"), ("hif4+resq-2:4", "miles-nvfp4"),
        ("mxfp4+resq-2:4", "nemo-rl-nvfp4")}
    names = {c.name for c in cells}
    assert all(c.better in names and c.worse in names for c in claims)


def test_device_is_every_cells_and_a_missing_one_is_refused_before_any_run(tmp_path, capsys,
                                                                          monkeypatch):
    """``--device`` (as the docs' GPU command gives it) sets every cell's device; one that
    does not exist is one line, before the output directory is made."""
    out = tmp_path / "field"
    assert main(["experiment", "field", "--plan", "field", "--output", str(out),
                 "--device", "tpu"]) == 2
    assert "device 'tpu' is not a device" in capsys.readouterr().err
    assert not out.exists()
    configs = []
    monkeypatch.setattr(experiments, "run_cells", lambda exp, runs, **kw: configs.extend(
        cell_config(exp, cell) for cell in runs))
    assert main(["experiment", "field", "--plan", "field", "--output", str(out),
                 "--device", "cpu", "--cells", "nemo-rl-nvfp4", "--seeds", "0"]) == 0
    assert [c.device for c in configs] == ["cpu"]


def test_a_killed_worker_is_one_line_saying_what_to_do():
    """A worker the kernel kills (out of memory) breaks the process pool: the grid stops
    with a UserError (one line at the command line), not the pool's traceback."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from fp4rl.experiments.runner import reporting_killed_workers

    context = multiprocessing.get_context("spawn")
    with pytest.raises(UserError, match=r"worker process was killed .* run the same command "
                                        r"again to resume"), reporting_killed_workers(), \
            ProcessPoolExecutor(1, mp_context=context) as pool:
        pool.submit(os._exit, 1).result()


def test_an_override_is_checked_against_the_cells_that_run(tmp_path, capsys):
    """``nvfp4_scale=static`` fits the field's NVFP4 recipes, not BF16's: refused in one
    line for the whole grid, taken with ``--cells`` naming the NVFP4 cells."""
    args = ["experiment", "field", "--plan", "field", "--output", str(tmp_path / "field"),
            "--set", "nvfp4_scale=static", "--set", "batch_invariant=true"]
    assert main([*args, "--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nvfp4_scale=static" in err[0], err
    assert main([*args, "--cells", "nemo-rl-nvfp4", "torchao-nvfp4", "--report-only"]) == 0
