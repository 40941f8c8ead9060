"""Every mistake a user can make on the command line: one line on stderr, exit status 2
(130 for Ctrl-C), no traceback, and an existing run directory left as it was."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fp4rl.cli import main, parse
from fp4rl.rl import checkpoint as ckpt
from fp4rl.rl.rundir import METRICS, read_metrics

#: a tiny HiF4 run on the smoke preset: fast, and every checkpoint kept
RUN_OVERRIDES = ["train.weights=hif4", "train.activations=hif4", "train.gradients=hif4",
                 "grpo.max_response_length=6", "grpo.learning_rate=1e-5",
                 "run.save_steps=1", "run.keep_checkpoints=3"]
#: a place no one (not even root) can write
READ_ONLY = Path("/sys/fp4rl-test")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """A two-step run with a checkpoint per step, made once; tests only read it."""
    run = tmp_path_factory.mktemp("errors") / "run"
    assert main(["train", "--output", str(run), f"model={tiny_llama_dir}", *RUN_OVERRIDES,
                 "--steps", "2"]) == 0
    return run


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def damaged_copy(run_dir: Path, where: Path, steps: tuple[int, ...]) -> Path:
    """A copy of the run whose checkpoints ``steps`` have a truncated model file."""
    copy = where / "copy"
    shutil.copytree(run_dir, copy)
    for step in steps:
        with open(ckpt.step_dir(copy, step) / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    return copy


def one_error_line(capsys, argv: list[str], code: int = 2) -> str:
    """Run ``argv`` and return its one stderr line, asserting the exit status."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def files(tmp_path: Path) -> dict[str, Path]:
    """Input files a user might get wrong."""
    empty, missing_fields = tmp_path / "empty.jsonl", tmp_path / "fields.jsonl"
    empty.write_text("")
    missing_fields.write_text('{"prompt": "2 + 2?"}\n{"prompt": "3 + 3?"}\n')
    (tmp_path / "a-file").write_text("")
    return {"empty": empty, "fields": missing_fields, "file": tmp_path / "a-file"}


# (name, argv with {run}, {tmp}, {tiny}, {empty}, {fields}, {file}, {ro}, {damaged}, {all_damaged};
#  a piece of the expected message)
CASES = [
    ("missing data file", ["train", "--output", "{tmp}/new", "data.source=gsm8k",
                           "data.train_path=/nonexistent.jsonl"], "dataset file not found"),
    ("empty jsonl", ["train", "--output", "{tmp}/new", "data.source=gsm8k",
                     "data.train_path={empty}"], "no usable gsm8k examples (no records)"),
    ("rows missing fields", ["train", "--output", "{tmp}/new", "data.source=gsm8k",
                             "data.train_path={fields}"], "missing field 'question'"),
    ("output is a file", ["train", "--output", "{file}"], "is a file"),
    ("output read-only", ["train", "--output", "{ro}/run"], "cannot write"),
    ("malformed override", ["train", "--output", "{tmp}/new", "data.levels=[1,"],
     "not valid YAML"),
    ("unknown level", ["train", "--output", "{tmp}/new", "data.levels=[99]"],
     "choose among [1, 2, 3, 4, 5, 6]"),
    ("path for a generated source", ["train", "--output", "{tmp}/new",
                                     "data.train_path=/data/train.jsonl"],
     "reads no file: drop data.train_path"),
    ("steps 0", ["train", "--output", "{tmp}/new", "--steps", "0"], "must be at least 1"),
    ("demo steps 0", ["demo", "--steps", "0"], "must be at least 1"),
    ("unknown option", ["train", "--output", "{tmp}/new", "--stpes", "2"],
     "unrecognized arguments: --stpes"),
    ("a second run into a run", ["train", "--output", "{run}", "model={tiny}"],
     "already holds a run: pass --resume"),
    ("resume an empty directory", ["train", "--output", "{tmp}", "--resume"],
     "holds no run to resume"),
    ("resume a missing directory", ["train", "--output", "{tmp}/none", "--resume"],
     "holds no run to resume"),
    ("resume with another learning rate", ["train", "--output", "{run}", "--resume",
                                           "grpo.learning_rate=1e-3"],
     "grpo.learning_rate 1e-05 -> 0.001"),
    ("resume with another config", ["train", "--config", "demo", "--output", "{run}",
                                    "--resume"], "would change"),
    ("resume, every checkpoint damaged", ["train", "--output", "{all_damaged}", "--resume"],
     "no checkpoint of"),
    ("eval a damaged checkpoint", ["eval", "--checkpoint", "{damaged}", "--n", "8"],
     "model.safetensors holds 1000 bytes"),
    ("export a damaged checkpoint", ["export", "--checkpoint", "{damaged}", "--format", "bf16",
                                     "--output", "{tmp}/export"],
     "model.safetensors holds 1000 bytes"),
    ("eval unknown data", ["eval", "--data", "bogus"], "--data 'bogus'"),
    ("eval missing data file", ["eval", "--data", "gsm8k:/nonexistent.jsonl"],
     "dataset file not found"),
    ("eval n 0", ["eval", "--n", "0"], "argument --n: must be at least 1"),
    ("eval mean-at 0", ["eval", "--mean-at", "0"], "argument --mean-at: must be at least 1"),
    ("eval malformed field", ["eval", "--field", "bogus"], "--field 'bogus': give ROLE=NAME"),
    ("eval unknown level", ["eval", "--levels", "99"], "choose among"),
    ("eval json read-only", ["eval", "--json", "{ro}/x.json"], "--json"),
    ("cost m -1", ["cost", "--m", "-1"], "argument --m: must be at least 1, got -1"),
    ("cost m 0", ["cost", "--m", "0"], "argument --m: must be at least 1, got 0"),
    ("cost bad sparsity", ["cost", "--sparsity", "bogus"], "invalid sparsity pattern 'bogus'"),
    ("fidelity bad pattern", ["fidelity", "--methods", "hif4+resq-9:4"],
     "invalid sparsity pattern '9:4'"),
    ("diagnose missing prompts", ["diagnose", "--prompts", "/missing.txt", "--output",
                                  "{tmp}/diag"], "prompt file /missing.txt does not exist"),
    ("diagnose read-only output", ["diagnose", "--output", "{ro}/diag"], "cannot write"),
    ("diagnose recipe without sensitivity", ["diagnose", "--recipe", "hif4"],
     "only with --sensitivity: --recipe, --nudge"),
    ("diagnose unknown scale rule", ["diagnose", "--sensitivity", "--recipe", "nvfp4@fixed"],
     "nvfp4_scale must be one of dynamic, pow2, static"),
    ("diagnose two diagnoses", ["diagnose", "--sensitivity", "--gradients"],
     "two diagnoses: choose one"),
    ("bench invariant unknown recipe", ["bench", "invariant", "--recipe", "bogus"],
     "unknown recipe 'bogus'"),
]


@pytest.mark.parametrize(("argv", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_and_exit_2(run_dir, tiny_llama_dir, tmp_path, capsys, argv,
                                          expected):
    names = {"run": run_dir, "tmp": tmp_path, "tiny": tiny_llama_dir, "ro": READ_ONLY,
             **files(tmp_path)}
    if any("damaged}" in a for a in argv):
        names["damaged"] = damaged_copy(run_dir, tmp_path / "one", (2,))
        names["all_damaged"] = damaged_copy(run_dir, tmp_path / "all", (1, 2))
    before = snapshot(run_dir)
    line = one_error_line(capsys, [a.format(**names) for a in argv])
    assert line.startswith(f"fp4rl {argv[0]}: error: ") and expected in line
    assert snapshot(run_dir) == before
    assert not (tmp_path / "new").exists()  # a failed run leaves no directory behind


def test_debug_raises_instead_of_the_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        main(["train", "--output", str(tmp_path / "r"), "data.source=gsm8k",
              "data.train_path=/nonexistent.jsonl", "--debug"])


def test_resume_keeps_the_saved_config_and_allows_more_steps(run_dir, tmp_path, capsys):
    """The refused resume leaves config.yaml as it was; run.steps may change, and the
    run's own settings (lr 1e-5) continue without --config or overrides."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    saved = (run / "config.yaml").read_text()
    assert main(["train", "--output", str(run), "--resume", "grpo.learning_rate=1e-3"]) == 2
    assert (run / "config.yaml").read_text() == saved
    assert main(["train", "--output", str(run), "--resume", "--steps", "3"]) == 0
    assert [r["step"] for r in read_metrics(run / METRICS)] == [1, 2, 3]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["run"]["steps"] == 3 and config["grpo"]["learning_rate"] == 1e-5


def test_a_truncated_latest_checkpoint_resumes_from_the_previous(run_dir, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapped by rich
    run = damaged_copy(run_dir, tmp_path, (2,))
    assert main(["train", "--output", str(run), "--resume", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "skipping a damaged checkpoint" in out and "step-000002" in out
    assert "resumed from" in out and "step 1)" in out
    assert [r["step"] for r in read_metrics(run / METRICS)] == [1, 2, 3]


def test_a_run_without_checkpoint_resumes_from_step_0(tmp_path, tiny_llama_dir, capsys,
                                                      monkeypatch):
    """A run killed before its first checkpoint keeps its config; --resume says so and
    trains it from the start."""
    from fp4rl.rl.config import load_config

    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapped by rich
    run = tmp_path / "run"
    run.mkdir()
    overrides = [f"model={tiny_llama_dir}", *RUN_OVERRIDES]
    cfg = load_config("smoke", overrides, {"run.steps": 1})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["train", "--output", str(run), "--resume"]) == 0
    assert "has no checkpoint yet" in capsys.readouterr().out
    assert ckpt.latest_checkpoint(run).name == "step-000001"


def test_overrides_stand_anywhere_among_the_options():
    args = parse(["train", "--config", "smoke", "--steps", "1", "grpo.batch_size=2",
                  "--output", "X", "data.levels=[1]"])
    assert args.overrides == ["grpo.batch_size=2", "data.levels=[1]"]
    assert args.steps == 1 and args.output == "X"
    assert parse(["diagnose", "--out", "old"]).out == "old"  # the former name still works
    assert parse(["diagnose", "--output", "new"]).out == "new"


def test_version(capsys):
    from fp4rl import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"fp4rl {__version__}"


def test_train_without_config_uses_a_preset_that_runs():
    """The default preset's data exist (the library defaults ask level 1 for more
    questions than it has)."""
    from fp4rl.cli import DEFAULT_TRAIN_PRESET
    from fp4rl.rl.config import load_config
    from fp4rl.rl.datasets import load_split

    cfg = load_config(DEFAULT_TRAIN_PRESET)
    assert load_split(cfg.data, "train") and load_split(cfg.data, "test")


def test_ctrl_c_is_one_line_saying_where_to_resume(tmp_path, tiny_llama_dir):
    """SIGINT during training: exit 130 and one line naming the latest checkpoint (the
    model's loading bar, a progress display, is turned off)."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    # Ctrl-C's own disposition, as in a terminal: a shell that started this suite in the
    # background would hand its children SIGINT ignored, and Python then never raises
    # KeyboardInterrupt
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp4rl", "train", "--output", str(run),
         f"model={tiny_llama_dir}", *RUN_OVERRIDES, "--steps", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while ckpt.latest_checkpoint(run) is None and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    (line,) = lines
    assert line.startswith("fp4rl train: interrupted;") and "--resume" in line
    assert str(ckpt.latest_checkpoint(run)) in line
