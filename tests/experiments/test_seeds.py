"""Multi-seed grids: seed layout and resumption, per-prompt outcomes, the report's
intervals and verdicts, and the command line's --seeds."""

from __future__ import annotations

import json
import zlib
from dataclasses import replace

import numpy as np
import pytest

from fp4rl.cli import main
from fp4rl.cli.experiment import EXPERIMENT_KINDS, EXPERIMENT_PLANS
from fp4rl.data import Example, synthetic_dataset
from fp4rl.errors import UserError
from fp4rl.experiments import (
    KINDS,
    PLANS,
    Experiment,
    cell_config,
    check_seeds,
    get_plan,
    grid_cells,
    load_result,
    load_results,
    run_cells,
    runner,
    seeded_cells,
    stats,
    write_report,
)
from fp4rl.experiments.claims import (
    BACKWARD_MATCHES,
    BEYOND_MATCHES_BF16,
    BEYOND_PAPER,
    BEYOND_RANKING,
    MATCHES_BF16,
    RESQ_MATCHES_BF16,
    grid_claims,
)
from fp4rl.experiments.report import claim_rows, gap, reward_band
from fp4rl.models import tiny_model
from fp4rl.paths import write_json
from fp4rl.rl.evaluate import evaluate, prompt_digest

N_PROMPTS = 40
#: accuracy of each cell's rollout policy in the fake runs (anything else: 0.5)
ACCURACY = {"bf16": 0.9, "hif4": 0.9, "mxfp4": 0.0, "hif4+occ": 0.5, "mxfp4+occ": 0.5}


def _scores(name: str, seed: int, accuracy: float, bench: str = "synthetic") -> dict:
    """Scores of a fake evaluation on ``bench``: which prompts are right depends on the
    cell and the seed, how many on ``accuracy``; every cell is scored on the same
    prompts."""
    rng = np.random.default_rng(zlib.crc32(f"{name}/{seed}".encode()))
    correct = (rng.permutation(N_PROMPTS) < round(accuracy * N_PROMPTS)).astype(int)
    if name.endswith("+occ"):  # two cells with the very same outcomes
        correct = (np.arange(N_PROMPTS) % 2 == seed % 2).astype(int)
    return {bench: {"mean@1": correct.mean(), "best@1": correct.mean(),
                          "n": N_PROMPTS, "per_level": {}, "mean_length": 5.0,
                          "correct": correct.tolist(), "prompts": "same-prompts"}}


def fake_run_cell(exp, cell, log=print, progress=None):
    """What ``run_cell`` leaves behind, without training: a small result.json."""
    cfg = cell_config(exp, cell)
    accuracy = ACCURACY.get(cell.name, 0.5)
    bench = exp.benchmarks()[0].name
    result = {"cell": cell.name, "format": cell.fmt, "row": cell.row, "seed": cfg.run.seed,
              "recipe": cell.recipe().to_dict(), "config": cfg.model_dump(mode="json"),
              "initial": _scores(cell.name, cfg.run.seed, 0.1, bench),
              "rollout": _scores(cell.name, cfg.run.seed, accuracy, bench),
              "bf16": _scores(cell.name, cfg.run.seed, accuracy, bench),
              "rewards": [0.1 * cfg.run.seed, 0.2, 0.3], "train_seconds": 1.0,
              "eval_seconds": 1.0, "torch_threads": 1}
    path = exp.cell_dir(cell) / runner.RESULT
    path.write_text(json.dumps(result))
    return result


@pytest.fixture
def fake_runs(monkeypatch):
    calls = []

    def record(exp, cell, log=print, progress=None):
        calls.append((cell.name, cell.seed))
        return fake_run_cell(exp, cell, log, progress)

    monkeypatch.setattr(runner, "run_cell", record)
    return calls


def test_seeds_are_checked():
    assert check_seeds([2, 0, 1]) == (2, 0, 1)
    for bad, message in (([0, -1], "non-negative"), ([], "non-negative"),
                         ([0, 1, 0], "seed 0 twice")):
        with pytest.raises(UserError, match=message):
            check_seeds(bad)


def test_seed_layout_keeps_the_single_seed_directory_for_the_config_seed(tmp_path):
    exp = Experiment("recovery", get_plan("tiny"), tmp_path, ("hif4",))
    cell = grid_cells("recovery", ("hif4",))[1]
    assert exp.run_seeds == (0,)
    assert exp.cell_dir(cell) == exp.cell_dir(replace(cell, seed=0)) == tmp_path / "cells/hif4"
    assert exp.cell_dir(replace(cell, seed=2)) == tmp_path / "seed-2/cells/hif4"
    assert cell_config(exp, replace(cell, seed=2)).run.seed == 2
    moved = Experiment("recovery", get_plan("tiny"), tmp_path, ("hif4",), ("run.seed=1",),
                       seeds=(0, 1))
    assert moved.base_seed == 1 and moved.run_seeds == (0, 1)
    assert moved.cell_dir(replace(cell, seed=1)) == tmp_path / "cells/hif4"
    assert moved.cell_dir(replace(cell, seed=0)) == tmp_path / "seed-0/cells/hif4"


def test_seeds_times_cells_run_once_each_and_resume(tmp_path, fake_runs):
    exp = Experiment("recovery", get_plan("tiny"), tmp_path, ("hif4",), seeds=(0, 1, 2))
    cells = grid_cells("recovery", ("hif4",))[:3]
    runs = seeded_cells(cells, exp.run_seeds)
    assert [(c.name, c.seed) for c in runs[:4]] == [
        ("bf16", 0), ("hif4", 0), ("hif4+smoothquant", 0), ("bf16", 1)]
    run_cells(exp, runs)
    assert sorted(fake_runs) == sorted((c.name, s) for c in cells for s in (0, 1, 2))
    assert (tmp_path / "cells/bf16/result.json").is_file()
    assert (tmp_path / "seed-2/cells/hif4_smoothquant/result.json").is_file()
    # one run lost (interrupted before it finished): only it runs again
    (tmp_path / "seed-1/cells/hif4/result.json").unlink()
    fake_runs.clear()
    seen = []
    run_cells(exp, runs, on_status=lambda c, s: seen.append((c.label, s)))
    assert fake_runs == [("hif4", 1)]
    assert ("hif4 (seed 1)", "done") in seen and ("bf16 (seed 2)", "finished earlier") in seen
    results = load_results(exp, cells, exp.run_seeds)
    assert {name: sorted(runs) for name, runs in results.items()} == {
        c.name: [0, 1, 2] for c in cells}


def test_a_single_seed_result_is_that_seed_and_a_foreign_seed_is_refused(tmp_path):
    single = Experiment("recovery", get_plan("tiny"), tmp_path, ("hif4",))
    cell = grid_cells("recovery", ("hif4",))[0]
    exp_dir = single.cell_dir(cell)
    exp_dir.mkdir(parents=True)
    (exp_dir / runner.RESULT).write_text(json.dumps({"config": {"run": {"seed": 0}}}))
    multi = replace(single, seeds=(0, 1))
    assert set(load_results(multi, [cell], multi.run_seeds)["bf16"]) == {0}
    (exp_dir / runner.RESULT).write_text(json.dumps({"config": {"run": {"seed": 1}}}))
    with pytest.raises(UserError, match="seed 1, not 0"):
        load_result(multi, replace(cell, seed=0))


def test_result_files_keep_number_lists_on_one_line(tmp_path):
    payload = {"correct": [0, 1] * 150, "rewards": [0.5, -1e-05], "names": ["a", "b"],
               "nested": {"rows": [[1, 2], [3]]}}
    small = write_json(tmp_path / "small.json", payload, inline_numbers=True)
    plain = write_json(tmp_path / "plain.json", payload)
    assert json.loads(small.read_text()) == json.loads(plain.read_text()) == payload
    assert '"correct": [0, 1, 0, 1' in small.read_text()
    assert len(small.read_text()) < len(plain.read_text()) / 2


def test_evaluation_stores_per_prompt_outcomes():
    model, tok = tiny_model("llama")
    examples = [Example(f"What is {i} + 1?", f"#### {i + 1}", "gsm8k", "t", i, {"level": 1})
                for i in range(3)]
    prompts = [tok(e.prompt)["input_ids"] for e in examples]
    result = evaluate(model, tok, examples, prompts, k=2, max_new_tokens=3, seed=0)
    assert len(result.correct) == 3 and all(0 <= c <= 2 for c in result.correct)
    assert sum(result.correct) / 6 == pytest.approx(result.mean)
    assert result.prompts == prompt_digest(examples) != prompt_digest(examples[::-1])
    assert set(result.as_dict()) >= {"correct", "prompts", "mean@2"}


def test_a_fixed_prompt_seed_scores_every_seed_on_the_same_prompts(tmp_path):
    _, tok = tiny_model("llama")
    cell = grid_cells("precision", ("hif4",))[0]

    def digest(overrides: tuple[str, ...], seed: int) -> str:
        exp = Experiment("precision", get_plan("tiny"), tmp_path, ("hif4",),
                         ("data.test_size=20", *overrides))
        cfg = cell_config(exp, replace(cell, seed=seed))
        return prompt_digest(runner._eval_sets(exp, cfg, tok)[0][1])

    assert digest(("eval.prompt_seed=0",), 1) == digest(("eval.prompt_seed=0",), 2)
    assert digest((), 1) != digest((), 2)  # the tiny preset: the seed draws the prompts


def _write_fake_grid(tmp_path, kind, seeds, formats=("hif4", "mxfp4")):
    exp = Experiment(kind, get_plan("tiny"), tmp_path, formats, seeds=seeds)
    for cell in seeded_cells(grid_cells(kind, formats), seeds):
        exp.cell_dir(cell).mkdir(parents=True, exist_ok=True)
        fake_run_cell(exp, cell)
    return exp


def test_report_gives_intervals_and_verdicts_for_every_claim(tmp_path):
    exp = _write_fake_grid(tmp_path, "precision", (0, 1, 2))
    cells = grid_cells("precision", exp.formats)
    results = load_results(exp, cells, exp.run_seeds)
    rows = claim_rows(results, grid_claims("precision", exp.formats), ["synthetic"])
    assert len(rows) == len(grid_claims("precision", exp.formats))
    by = {(r["better"], r["worse"]): r for r in rows}
    assert by["hif4", "mxfp4"]["verdict"] == "holds"  # 90% against 0%
    assert by["hif4", "mxfp4"]["lo"] > 0 and by["hif4", "mxfp4"]["seeds"] == 3
    assert by["mxfp4", "mxfp4:bf16/fp4"]["verdict"] == "reversed"  # 0% against 50%
    assert by["hif4:fp4/bf16", "hif4"]["verdict"] == "reversed"
    assert all(r["verdict"] in ("holds", "reversed", "within noise") for r in rows)
    assert by["hif4:fp4/w4a16", "hif4:fp4/w16a4"]["paper_gap"] == pytest.approx(0.92)
    # the verdict's interval is the seed-t one; the bootstrap's is kept beside it
    fp4 = by["hif4", "mxfp4"]
    seed_t = gap(results["hif4"], results["mxfp4"], "rollout", "synthetic")
    boot = gap(results["hif4"], results["mxfp4"], "rollout", "synthetic", stats.bootstrap)
    assert (fp4["lo"], fp4["hi"]) == (seed_t.lo, seed_t.hi)
    assert (fp4["bootstrap_lo"], fp4["bootstrap_hi"]) == (boot.lo, boot.hi)
    assert fp4["paper"] == (82.03, 73.31)
    text = write_report(exp, cells, results, command=["fp4rl"]).read_text()
    assert "## Method" in text and "paired" in text and "seed-t" in text
    assert "4000 resamples" in text and "bootstrap [95%] (secondary)" in text
    assert "| HiF4 beats MXFP4 | FP4 / BF16 | synthetic | 86.88 vs 86.20 (+0.68) | +0.0 [" in text
    assert "|  | FP4 / FP4 | synthetic | 82.03 vs 73.31 (+8.72) | +90.0 [" in text
    assert "'within noise' agrees with it" in text
    assert (f"| 3 x 40 | **holds** | [{boot.lo:+.1f}, {boot.hi:+.1f}] |" in text
            and "**reversed**" in text)
    row = next(line for line in text.splitlines() if line.startswith("| FP4 | FP4 | "))
    assert row.startswith("| FP4 | FP4 | 90.0 [") and "| 0.0 [0.0, 0.0] (-90.0 [" in row
    assert row.count("|") == 7  # train, rollout, and per format its value and bootstrap
    payload = json.loads((tmp_path / "precision.json").read_text())
    assert payload["seeds"] == [0, 1, 2] and len(payload["claims"]) == len(rows)
    assert "correct" not in json.dumps(payload["cells"])


def test_identical_cells_are_within_noise_in_the_recovery_report(tmp_path):
    exp = _write_fake_grid(tmp_path, "recovery", (0, 1))
    cells = grid_cells("recovery", exp.formats)
    rows = claim_rows(load_results(exp, cells, (0, 1)), grid_claims("recovery", exp.formats),
                      ["synthetic"])
    same = next(r for r in rows if (r["better"], r["worse"]) == ("hif4+occ", "mxfp4+occ"))
    assert (same["gap"], same["lo"], same["hi"], same["verdict"]) == (
        0.0, 0.0, 0.0, "within noise")


def test_old_result_files_show_means_without_intervals(tmp_path):
    exp = _write_fake_grid(tmp_path, "precision", (0,))
    for path in tmp_path.glob("cells/*/result.json"):
        result = json.loads(path.read_text())
        for policy in ("initial", "rollout", "bf16"):
            for scores in result[policy].values():
                del scores["correct"], scores["prompts"]
        path.write_text(json.dumps(result))
    cells = grid_cells("precision", exp.formats)
    results = load_results(exp, cells, (0,))
    text = write_report(exp, cells, results, command=["fp4rl"]).read_text()
    assert "| FP4 | FP4 | 90.0 (+0.0) | -- | 0.0 (-90.0) | -- |" in text
    assert "no interval (no per-prompt outcomes)" in text


def test_cli_seeds_cells_and_report_only_rebuild_the_same_tables(tmp_path, fake_runs):
    out = tmp_path / "grid"
    args = ["experiment", "recovery", "--output", str(out), "--format", "hif4",
            "--format", "mxfp4", "--seeds", "0", "1", "--cells", "bf16", "hif4", "mxfp4"]
    assert main(args) == 0
    assert sorted(fake_runs) == [(n, s) for n in ("bf16", "hif4", "mxfp4") for s in (0, 1)]
    text = (out / "recovery.md").read_text()
    assert "Runs finished: 6 of 38 (19 cells x 2 seeds)" in text
    assert ("| HiF4 beats MXFP4 | no recovery | synthetic | 82.03 vs 73.31 (+8.72) | +90.0 ["
            in text)
    assert "not run" in text  # the cells left out
    fake_runs.clear()
    assert main([*args, "--report-only"]) == 0
    assert fake_runs == []

    def body(report: str) -> list[str]:
        return [line for line in report.splitlines() if not line.startswith("Command:")]

    assert body((out / "recovery.md").read_text()) == body(text)
    # the result files alone, as they are kept in the repository, give the same tables
    stored = tmp_path / "stored"
    for path in out.rglob("result.json"):
        copy = stored / path.relative_to(out)
        copy.parent.mkdir(parents=True)
        copy.write_bytes(path.read_bytes())
    assert sorted(p.name for p in stored.rglob("*") if p.is_file()) == ["result.json"] * 6
    stored_args = [a if a != str(out) else str(stored) for a in args]
    assert main([*stored_args, "--report-only"]) == 0
    assert body((stored / "recovery.md").read_text()) == body(text)


def test_cli_lists_seeds_and_refuses_bad_ones_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["experiment", "precision", "--help"])
    assert done.value.code == 0 and "--seeds" in capsys.readouterr().out
    for seeds in (["0", "-1"], ["1", "1"]):
        code = main(["experiment", "precision", "--output", str(tmp_path), "--seeds", *seeds])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--seeds" in err


def test_tiny3_is_a_multi_seed_word_problem_preset(tmp_path):
    assert set(EXPERIMENT_PLANS) == set(PLANS)
    assert EXPERIMENT_KINDS == KINDS
    preset = get_plan("tiny3")
    assert preset.seeds == (0, 1, 2, 3, 4) and preset.formats == ("hif4", "mxfp4")
    exp = Experiment("precision", preset, tmp_path, preset.formats, seeds=preset.seeds)
    cfg = cell_config(exp, grid_cells("precision", preset.formats)[0])
    assert cfg.data.source == "synthetic-words" and cfg.data.test_size >= 300
    assert cfg.run.steps > 16 and cfg.eval.prompt_seed is not None
    test = {e.prompt for e in synthetic_dataset("test", cfg.data.test_size, cfg.data.levels,
                                                cfg.eval.prompt_seed, cfg.data.source)}
    for seed in preset.seeds:
        train = synthetic_dataset("train", cfg.data.train_size, cfg.data.levels, seed,
                                  cfg.data.source)
        assert not test & {e.prompt for e in train}


def test_reward_band_spans_the_seeds_over_their_common_steps():
    runs = {0: {"rewards": [0.0, 0.0, 0.0, 0.0, 0.0, 9.0]}, 1: {"rewards": [1.0] * 5},
            2: {"rewards": [0.5] * 5}}
    middle, low, high = reward_band(runs)
    assert len(middle) == 5  # seed 0's sixth step has no counterpart
    assert list(low) == [0.0] * 5 and list(high) == [1.0] * 5 and middle[0] == 0.5
    assert reward_band({}) is None and reward_band({0: {"rewards": []}}) is None


def test_real_cells_with_two_seeds_pair_on_shared_prompts(tmp_path, tiny_llama_dir):
    """Two seeds of two cells trained for real (a tiny model, two steps): each seed trains
    with its own seed in its own directory, and all four runs are scored on the same
    prompts, so the report pairs them."""
    small = ("run.steps=2", "run.save_steps=1", "grpo.num_generations=4",
             "grpo.batch_size=2", "grpo.max_response_length=4", "data.train_size=8",
             "data.test_size=5", "eval.max_new_tokens=4", "eval.prompt_seed=0")
    exp = Experiment("recovery", get_plan("tiny"), tmp_path, ("hif4",),
                     (f"model={tiny_llama_dir}", *small), seeds=(0, 1))
    cells = grid_cells("recovery", ("hif4",))[:2]
    run_cells(exp, seeded_cells(cells, exp.run_seeds))
    results = load_results(exp, cells, exp.run_seeds)
    assert {(r["seed"], r["config"]["run"]["seed"]) for runs in results.values()
            for r in runs.values()} == {(0, 0), (1, 1)}
    assert (tmp_path / "seed-1/cells/hif4/run/metrics.jsonl").is_file()
    digests = {r[p]["synthetic"]["prompts"] for runs in results.values()
               for r in runs.values() for p in ("initial", "rollout", "bf16")}
    assert len(digests) == 1
    diff = gap(results["hif4"], results["bf16"], "rollout", "synthetic")
    assert (diff.seeds, diff.prompts, diff.crossed) == (2, 5, True)
    # greedy on fixed prompts: seed 1 reuses seed 0's score of the untrained model
    for cell in ("bf16", "hif4"):
        first = json.loads((tmp_path / f"cells/{cell}/initial.json").read_text())
        second = json.loads((tmp_path / f"seed-1/cells/{cell}/initial.json").read_text())
        assert second["shared"] and "shared" not in first
        assert second["rollout"] == first["rollout"]


def test_every_claim_points_the_paper_s_way():
    """Each comparison names cells of the paper's tables, and the paper's own gap has the
    claimed sign: positive, a tie where the paper ties, small for 'matches BF16'."""
    both = ("hif4", "mxfp4")
    everything = grid_claims("precision", both) + grid_claims("recovery", both)
    claims = [c for c in everything if not c.claim.startswith("beyond the paper")]
    assert len(claims) == 14 + 28 + 6 and all(c.paper_gap is not None for c in claims)
    beyond = [(c.better, c.worse, c.paper_gap) for c in everything if c.claim == BEYOND_PAPER]
    assert beyond == [(f"{f}+resqw-2:4", f"{f}+resq-2:4", None) for f in both]
    ranking = [(c.better, c.worse, c.paper_gap) for c in everything
               if c.claim == BEYOND_RANKING]
    assert ranking == [("hif4:fp4-reuse/bf16", "mxfp4:fp4-reuse/bf16", None),
                       ("hif4+resqw-2:4", "mxfp4+resqw-2:4", None)]
    matches = [(c.better, c.worse) for c in everything if c.claim == BEYOND_MATCHES_BF16]
    assert matches == [(f"{f}+resqw-2:4", "bf16") for f in both]
    for c in claims:
        if c.claim == MATCHES_BF16:
            assert -1 < c.paper_gap < 0
        elif c.claim == RESQ_MATCHES_BF16:  # the paper's headline: close, not above
            assert -6 < c.paper_gap < 0
        else:
            assert c.paper_gap >= 0 and (c.paper_gap > 0 or c.label == (
                "MXFP4: ResQ (2:4) vs ResQ (dense)")), c
    assert all(c.paper_gap is None for c in grid_claims("recovery", ("nvfp4",)))


def test_a_preset_cuts_the_grid_per_format_and_its_report_keeps_its_own_claims(tmp_path):
    tiny3 = get_plan("tiny3")
    assert [c.name for c in tiny3.grid("recovery", ("mxfp4",))] == [
        "bf16", "mxfp4", "mxfp4+resq-2:4", "mxfp4+resqw-2:4"]
    assert [c.name for c in tiny3.grid("precision", ("hif4",))] == [
        "bf16", "hif4:fp4/bf16", "hif4:fp4/w4a16", "hif4:fp4/w16a4", "hif4", "hif4:bf16/fp4",
        "hif4:fp4-reuse/bf16"]
    precision = tiny3.grid("precision", ("hif4",))
    backward = [c for c in grid_claims("precision", ("hif4",)) if c.claim == BACKWARD_MATCHES]
    assert [(c.better, c.worse) for c in backward] == [("hif4:fp4-reuse/bf16",
                                                         "hif4:fp4/bf16")]
    assert {backward[0].better, backward[0].worse} <= {c.name for c in precision}
    assert get_plan("tiny").grid("recovery", ("hif4",)) == grid_cells("recovery", ("hif4",))
    exp = Experiment("recovery", tiny3, tmp_path, ("hif4",), seeds=(0,))
    cells = tiny3.grid("recovery", ("hif4",))
    report = write_report(exp, cells, {}, command=["fp4rl"]).read_text()
    claims = [line for line in report.splitlines() if "not run |" in line]
    assert len(claims) == 5 and "occ" not in report.lower()


def test_tiny3_report_shows_each_cell_with_its_seeds_and_pairs_only_common_ones(tmp_path):
    """The grid as it fills: HiF4 cells with 5 seeds, MXFP4 cells with 3, MXFP4's W4A16 and
    W16A4 not run. Nothing fails; each cell says how many seeds it has; a comparison pairs
    the seeds both cells have; a claim with a cell not run says so."""
    tiny3 = get_plan("tiny3")
    exp = Experiment("precision", tiny3, tmp_path, tiny3.formats, seeds=tiny3.seeds)
    cells = tiny3.grid("precision", tiny3.formats)
    skipped = {"mxfp4:fp4/w4a16", "mxfp4:fp4/w16a4"}
    for cell in seeded_cells(cells, exp.run_seeds):
        if cell.name in skipped or (cell.fmt == "mxfp4" and cell.seed > 2):
            continue
        exp.cell_dir(cell).mkdir(parents=True, exist_ok=True)
        fake_run_cell(exp, cell)
    results = load_results(exp, cells, exp.run_seeds)
    assert {n: len(r) for n, r in results.items() if n.startswith("mxfp4")} == {
        "mxfp4:fp4/bf16": 3, "mxfp4:fp4/w4a16": 0, "mxfp4:fp4/w16a4": 0, "mxfp4": 3,
        "mxfp4:bf16/fp4": 3, "mxfp4:fp4-reuse/bf16": 3}
    names = {c.name for c in cells}
    claims = [c for c in grid_claims("precision", tiny3.formats)
              if c.better in names and c.worse in names]
    rows = claim_rows(results, claims, ["synthetic-words"])
    by = {(r["better"], r["worse"]): r for r in rows}
    assert by["hif4", "hif4:bf16/fp4"]["seeds"] == 5
    assert by["hif4", "mxfp4"]["seeds"] == 3 and by["mxfp4:fp4/bf16", "bf16"]["seeds"] == 3

    def correct(cell: str, seed: int) -> np.ndarray:
        return np.array(results[cell][seed]["rollout"]["synthetic-words"]["correct"])

    expected = stats.seed_t([correct("hif4", s) - correct("mxfp4", s)
                             for s in (0, 1, 2)]).scaled(100)
    assert (by["hif4", "mxfp4"]["lo"], by["hif4", "mxfp4"]["hi"]) == pytest.approx(
        (expected.lo, expected.hi))
    for pair in (("mxfp4:fp4/w4a16", "mxfp4:fp4/w16a4"),
                 ("hif4:fp4/w4a16", "mxfp4:fp4/w4a16")):
        assert by[pair]["verdict"] == "not run"
    assert by["hif4:fp4/w4a16", "hif4:fp4/w16a4"]["verdict"] == "within noise"  # 50% vs 50%
    text = write_report(exp, cells, results, command=["fp4rl"]).read_text()
    assert "Runs finished: 47 of 65 (13 cells x 5 seeds)" in text
    row = next(line for line in text.splitlines() if line.startswith("| FP4 | FP4 | "))
    assert row.count("(3 of 5 seeds)") == 1 and row.split(" | ")[2].startswith("90.0 [")
    w4a16 = next(line for line in text.splitlines() if line.startswith("| FP4 | W4A16 | "))
    assert w4a16.endswith("| -- | -- |")
    assert "| 3 x 40 |" in text and "| 5 x 40 |" in text


def test_the_field_report_compares_the_recipes_with_verdicts(tmp_path):
    exp = _write_fake_grid(tmp_path, "field", (0, 1))
    cells = grid_cells("field", exp.formats)
    results = load_results(exp, cells, (0, 1))
    rows = claim_rows(results, grid_claims("field", exp.formats), ["synthetic"])
    assert len(rows) == len(grid_claims("field", exp.formats)) == 9
    assert all(r["verdict"] in ("holds", "reversed", "within noise") for r in rows)
    text = write_report(exp, cells, results, command=["fp4rl"]).read_text()
    assert text.startswith("# The field's FP4 RL recipes beside the paper's")
    assert "| Format | Recipe |" in text and "| miles-nvfp4 |" in text
    assert "the paper's HiF4 + ResQ-2:4 beats the field's recipe" in text
