"""Running a grid cell by cell: every cell is a GRPO run plus its evaluation.

``<output>/cells/<cell>/`` holds the cell's training run (checkpoints, metrics.jsonl),
``initial.json`` (the starting model scored as that cell's rollout policy) and, once the
cell is finished, ``result.json``. A finished cell is never run again; an interrupted one
resumes from its last checkpoint. A lock file with the owner's pid lets two runners
(e.g. the precision and the recovery grid) share one output directory: each skips the
cells the other is running and waits for them before it writes its report.

A multi-seed grid runs every cell once per seed. The config's own ``run.seed`` keeps the
single-seed layout above, so a grid run before seeds existed is that seed's; any other
seed S lives in ``<output>/seed-S/cells/<cell>/``, laid out the same way (a directory run
on its own with ``--set run.seed=S`` can be moved there as it is).
"""

from __future__ import annotations

import contextlib
import copy
import json
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

import torch
import yaml
from pydantic import JsonValue

from fp4rl.errors import UserError
from fp4rl.experiments.grid import Cell, EvalSpec, ExperimentPlan
from fp4rl.paths import write_json
from fp4rl.rollout.mismatch import nemo_rl_means

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fp4rl.data import Example
    from fp4rl.nn.recipe import RecipeDict
    from fp4rl.rl.config import TrainConfig
    from fp4rl.rl.rundir import Metrics

    #: a benchmark's name, its test examples and their encoded prompts
    EvalSet = tuple[str, list[Example], list[list[int]]]

RESULT = "result.json"
INITIAL = "initial.json"
LOCK = ".lock"
Log = Callable[[str], None]
#: one benchmark's scores, :meth:`fp4rl.rl.evaluate.EvalResult.as_dict`: ``mean@k`` and
#: ``best@k`` (named by their k), ``n``, ``per_level``, ``mean_length``, ``correct`` and
#: ``prompts`` (these two absent from files written before they were stored). ``Any`` as
#: ``as_dict`` gives it: a TypedDict cannot name keys that carry k
Scores = dict[str, Any]


class InitialScores(TypedDict):
    """``initial.json``: the starting model scored as the cell's rollout policy."""

    rollout: dict[str, Scores]  # benchmark -> scores
    seconds: float
    shared: NotRequired[bool]  # taken from another seed's file (the scores cannot differ)


class CellResult(TypedDict):
    """A finished cell's ``result.json`` (:func:`run_cell`)."""

    cell: str
    format: str | None
    row: str
    seed: NotRequired[int]  # absent from files written before seeds existed
    recipe: RecipeDict
    #: the TrainConfig as run, its JSON dump; ``Any`` as pydantic's ``model_dump`` gives it:
    #: the report reads nested settings of it by key
    config: dict[str, Any]
    initial: dict[str, Scores]  # benchmark -> scores, for each policy
    rollout: dict[str, Scores]
    bf16: dict[str, Scores]
    rewards: list[float]  # the training reward, step by step
    #: NeMo-RL's mismatch metrics, means over the steps (absent from files written before)
    mismatch: NotRequired[dict[str, float]]
    train_seconds: float
    eval_seconds: float
    torch_threads: int


@dataclass(frozen=True)
class Experiment:
    """What ``fp4rl experiment`` was asked to run (picklable, for worker processes)."""

    kind: str
    plan: ExperimentPlan
    output: Path
    formats: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    evals: tuple[EvalSpec, ...] = ()
    seeds: tuple[int, ...] = ()  # () runs the config's run.seed only

    @cached_property
    def base_seed(self) -> int:
        """The config's ``run.seed`` (plan < ``--set``): the seed of the single-seed
        layout. Only the ``run`` section is read: the rest is checked per cell, with the
        cell's recipe (an override that only some recipes take is no error here)."""
        from fp4rl.rl.config import validate

        return validate({"run": _base_data(self).get("run") or {}}).run.seed

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """The seeds every cell runs with."""
        return self.seeds or (self.base_seed,)

    def cell_dir(self, cell: Cell) -> Path:
        if cell.seed is None or cell.seed == self.base_seed:
            return self.output / "cells" / cell.slug
        return self.output / f"seed-{cell.seed}" / "cells" / cell.slug

    def benchmarks(self) -> tuple[EvalSpec, ...]:
        """The plan's benchmarks followed by those added with ``--eval``."""
        return self.plan.evals + self.evals


def _merge(base: dict[str, object], changes: Mapping[str, object]) -> dict[str, object]:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(current := out.get(key), dict):
            out[key] = _merge(current, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _base_data(exp: Experiment) -> dict[str, object]:
    """The config every cell starts from: the plan's config < its changes < ``--set``
    (unchecked data, until ``validate`` reads it)."""
    from fp4rl.rl.config import apply_override

    path = exp.plan.config_path()
    data: dict[str, object] = yaml.safe_load(path.read_text()) if path else {}
    data = _merge(data, exp.plan.changes)
    for item in exp.overrides:
        apply_override(data, item)
    return data


#: the training-precision fields a cell's recipe name sets (all of ``rollout`` too)
CELL_TRAIN_KEYS = ("weights", "activations", "gradients", "backward_operands")


def _check_overrides(exp: Experiment) -> None:
    """Refuse ``--set`` of what every cell sets from its own name: it would be ignored."""
    fixed = {f"train.{k}" for k in CELL_TRAIN_KEYS}
    for item in exp.overrides:
        key = item.partition("=")[0].strip()
        if key in fixed or key == "rollout" or key.startswith("rollout."):
            raise UserError(f"--set {key}: each cell's recipe name sets the train formats, "
                            "the backward scheme and the whole rollout; choose other cells "
                            "with --cells (e.g. hif4:fp4-reuse/bf16, mxfp4+resq-2:4)")


def cell_config(exp: Experiment, cell: Cell) -> TrainConfig:
    """The cell's TrainConfig: the plan's config < ``--set`` overrides < the cell's recipe and
    seed."""
    from fp4rl.rl.config import ConfigError, validate

    _check_overrides(exp)
    # unchecked until ``validate``: its sections are spread as mappings below (one that is
    # not a mapping fails there), which ``object`` would refuse
    data: dict[str, Any] = _base_data(exp)
    recipe = cell.recipe().to_dict()
    # the recipe name fixes the formats and the backward scheme; other training options
    # (stochastic_gradients) come from the config and --set
    data["train"] = {**(data.get("train") or {}),
                     **{k: recipe["train"][k] for k in CELL_TRAIN_KEYS}}
    data["rollout"] = recipe["rollout"]
    if cell.seed is not None:
        data["run"] = {**data.get("run", {}), "seed": cell.seed}
    cfg = validate(data)
    paths = {"model": cfg.model, "data.train_path": cfg.data.train_path,
             "data.test_path": cfg.data.test_path}
    for where, value in paths.items():
        if isinstance(value, str) and value.startswith("/path/to/"):
            raise ConfigError(f"{where} is still the placeholder {value!r}: pass "
                              f"--set {where}=<local path>")
    return cfg


@contextlib.contextmanager
def cell_lock(directory: Path) -> Iterator[bool]:
    """Hold ``directory/.lock`` while running a cell; yields False if a live process
    (on this host) holds it. A lock left by a dead process is taken over."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK
    owner = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _holder_alive(lock):
                yield False
                return
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(owner)
        try:
            yield True
        finally:
            lock.unlink(missing_ok=True)
        return
    yield False


def _holder_alive(lock: Path) -> bool:
    try:
        host, pid = lock.read_text().split()
    except (OSError, ValueError):
        return False
    if host != socket.gethostname():
        return True  # cannot tell; assume another machine is working on it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _eval_sets(exp: Experiment, cfg: TrainConfig, tok: PreTrainedTokenizerBase
               ) -> list[EvalSet]:
    from fp4rl.rl.datasets import encode_examples, load_split
    from fp4rl.rl.sources import eval_examples

    evals = exp.benchmarks()
    if not evals:
        raise ValueError(f"plan {exp.plan.name!r} names no benchmark: add "
                         "--eval NAME=LAYOUT:PATH (repeatable)")
    n = cfg.eval.size or cfg.data.test_size
    seed = cfg.run.seed if cfg.eval.prompt_seed is None else cfg.eval.prompt_seed
    sets: list[EvalSet] = []
    for spec in evals:
        if spec.data is None:
            examples, prompts = encode_examples(load_split(cfg.data, "test", seed, n),
                                                tok, cfg.grpo.max_prompt_length,
                                                cfg.data.template, log=lambda m: None)
        else:
            examples, prompts = eval_examples(spec.data, tok, n, cfg.data.levels, seed,
                                              max_prompt_length=cfg.grpo.max_prompt_length,
                                              template=cfg.data.template)
        sets.append((spec.name, examples, prompts))
    return sets


def _score(model: torch.nn.Module, tok: PreTrainedTokenizerBase, cfg: TrainConfig,
           sets: list[EvalSet]) -> dict[str, Scores]:
    """Benchmark name -> its scores."""
    from fp4rl.rl.evaluate import evaluate

    e = cfg.eval
    out: dict[str, Scores] = {}
    for name, examples, prompts in sets:
        result = evaluate(model, tok, examples, prompts, k=e.mean_at_k,
                          temperature=e.temperature, seed=cfg.run.seed,
                          mixed_precision=cfg.mixed_precision,
                          max_new_tokens=e.max_new_tokens or cfg.grpo.max_response_length)
        out[name] = result.as_dict()
    return out


def _initial_of_another_seed(exp: Experiment, cell: Cell, cfg: TrainConfig
                             ) -> dict[str, Scores] | None:
    """The starting model's scores as this cell's rollout policy, from a seed that has them,
    where they cannot depend on the seed: greedy decoding of the same test prompts
    (``eval.prompt_seed`` fixed) by the same untrained weights."""
    if cfg.eval.mean_at_k != 1 or cfg.eval.prompt_seed is None:
        return None
    for seed in exp.run_seeds:
        path = exp.cell_dir(replace(cell, seed=seed)) / INITIAL
        if seed != cell.seed and path.is_file():
            return _read_initial(path)["rollout"]
    return None


def run_cell(exp: Experiment, cell: Cell, log: Log = print,
             progress: Callable[[int, int, Metrics], None] | None = None) -> CellResult:
    """Train and score one cell (resuming it if it was interrupted); returns its result."""
    from fp4rl.nn import quantize_model
    from fp4rl.rl import checkpoint as ckpt
    from fp4rl.rl.rundir import RunDir
    from fp4rl.rl.trainer import Trainer

    directory = exp.cell_dir(cell)
    cfg = cell_config(exp, cell)
    run_dir = directory / "run"
    trainer = Trainer.from_config(cfg, run_dir, log=log)
    cfg = trainer.cfg  # device and mixed_precision resolved
    sets = _eval_sets(exp, cfg, trainer.tok)
    if not (directory / INITIAL).is_file() and ckpt.latest_checkpoint(run_dir) is None:
        start = time.perf_counter()
        shared = _initial_of_another_seed(exp, cell, cfg)
        scores = shared or _score(trainer.model, trainer.tok, cfg, sets)
        record: InitialScores = {"rollout": scores, "seconds": time.perf_counter() - start}
        if shared:
            record["shared"] = True
        write_json(directory / INITIAL, record)

    def step(s: int, total: int, m: Metrics) -> None:
        log(f"step {s}/{total}: reward {m['reward_mean']:.3f}, "
            f"{m['time/rollout'] + m['time/update']:.0f} s")
        if progress is not None:
            progress(s, total, m)

    trainer.train(resume=True, progress=step)
    start = time.perf_counter()
    final = _score(trainer.model, trainer.tok, cfg, sets)  # as the cell's rollout policy
    quantize_model(trainer.model, "bf16")
    unquantized = _score(trainer.model, trainer.tok, cfg, sets)
    eval_seconds = time.perf_counter() - start
    history = RunDir(run_dir).read_metrics()
    initial: InitialScores = (_read_initial(directory / INITIAL)
                              if (directory / INITIAL).is_file()
                              else {"rollout": {}, "seconds": 0.0})  # its file was removed by hand
    result: CellResult = {
        "cell": cell.name, "format": cell.fmt, "row": cell.row, "seed": cfg.run.seed,
        "recipe": cell.recipe().to_dict(), "config": cfg.model_dump(mode="json"),
        "initial": initial["rollout"], "rollout": final, "bf16": unquantized,
        "rewards": [r["reward_mean"] for r in history],
        "mismatch": nemo_rl_means(history),
        "train_seconds": sum(r["time/rollout"] + r["time/reward"] + r["time/update"]
                             + r.get("time/old_logprob", 0.0) for r in history),
        "eval_seconds": eval_seconds + initial["seconds"],
        "torch_threads": torch.get_num_threads(),
    }
    write_json(directory / RESULT, result, inline_numbers=True)
    for state in (run_dir / ckpt.CHECKPOINTS).glob("step-*/optimizer.pt"):
        state.unlink()  # a finished cell keeps its trained weights, not AdamW's moments
    log(f"{cell.label}: done")
    return result


def _read_json(path: Path) -> JsonValue:
    return json.loads(path.read_text())


def _read_initial(path: Path) -> InitialScores:
    """``initial.json`` as :func:`run_cell` wrote it (read nowhere else)."""
    return cast(InitialScores, _read_json(path))  # the JSON narrowed to its record, unchecked


def load_result(exp: Experiment, cell: Cell) -> CellResult | None:
    """The cell's result, None while it is unfinished; refuses a result of another seed
    (a single-seed directory run with another ``--set run.seed``)."""
    path = exp.cell_dir(cell) / RESULT
    if not path.is_file():
        return None
    # result.json is read here only: the JSON narrowed to run_cell's record, unchecked
    result = cast(CellResult, _read_json(path))
    found = result.get("config", {}).get("run", {}).get("seed")
    expected = exp.base_seed if cell.seed is None else cell.seed
    if found is not None and found != expected:
        raise UserError(f"{path} holds a run with seed {found}, not {expected}: pass "
                        f"--set run.seed={found} as when it ran, or move its grid's cells "
                        f"directory to {exp.output / f'seed-{found}'}")
    return result


def load_results(exp: Experiment, cells: list[Cell],
                 seeds: Sequence[int]) -> dict[str, dict[int, CellResult]]:
    """The finished runs of every cell: cell name -> seed -> result."""
    return {c.name: {s: r for s in seeds
                     if (r := load_result(exp, replace(c, seed=s))) is not None}
            for c in cells}


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


def _run_in_worker(exp: Experiment, cell: Cell,
                   progress: Callable[[int, int, Metrics], None] | None = None) -> str:
    directory = exp.cell_dir(cell)
    with cell_lock(directory) as mine:
        if not mine:
            return "busy"
        if load_result(exp, cell) is not None:  # another runner finished it meanwhile
            return "finished earlier"
        with open(directory / "log.txt", "a") as f:
            def log(message: str) -> None:
                f.write(message + "\n")
                f.flush()

            log(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {cell.label}: start (pid {os.getpid()})")
            run_cell(exp, cell, log=log, progress=progress)
    return "done"


def run_cells(exp: Experiment, cells: list[Cell], jobs: int = 1,
              on_status: Callable[[Cell, str], None] = lambda c, s: None,
              progress: Callable[[int, int, Metrics], None] | None = None,
              poll_seconds: float = 30.0) -> None:
    """Run every unfinished cell (``jobs`` at a time), then wait for any cell another
    runner holds, so that on return every cell has a result."""
    pending = [c for c in cells if load_result(exp, c) is None]
    for c in cells:
        if c not in pending:
            on_status(c, "finished earlier")
    busy = _run_batch(exp, pending, jobs, on_status, progress)
    while busy:
        time.sleep(poll_seconds)
        busy = [c for c in busy if load_result(exp, c) is None]
        # a runner that died leaves its lock stale: take the cell over
        busy = _run_batch(exp, busy, jobs, on_status, progress)


@contextlib.contextmanager
def reporting_killed_workers() -> Iterator[None]:
    """A worker process that ends abruptly (the kernel's out-of-memory killer, say) breaks
    the whole pool: say so in one line, with what to do, instead of the pool's traceback.
    Nothing is lost: finished runs keep their results, and a run in progress resumes from
    its last checkpoint when the same command runs again."""
    try:
        yield
    except BrokenProcessPool:
        raise UserError("a run's worker process was killed (out of memory is the usual cause: "
                        "`dmesg` says); finished runs and checkpoints are kept: run the same "
                        "command again to resume, with fewer --jobs if memory is short") from None


def _run_batch(exp: Experiment, cells: list[Cell], jobs: int,
               on_status: Callable[[Cell, str], None],
               progress: Callable[[int, int, Metrics], None] | None) -> list[Cell]:
    busy: list[Cell] = []
    if jobs <= 1:
        for cell in cells:
            on_status(cell, "running")
            status = _run_in_worker(exp, cell, progress)
            on_status(cell, status)
            if status == "busy":
                busy.append(cell)
        return busy
    threads = max(1, (os.cpu_count() or 1) // jobs)
    context = multiprocessing.get_context("spawn")
    with reporting_killed_workers(), \
            ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init,
                                initargs=(threads,)) as pool:
        futures = {cell: pool.submit(_run_in_worker, exp, cell) for cell in cells}
        for cell in cells:
            on_status(cell, "queued")
        for cell, future in futures.items():
            status = future.result()
            on_status(cell, status)
            if status == "busy":
                busy.append(cell)
    return busy
