"""A run directory: what a training run keeps in it, and the rules for each file.

::

    <output>/
      config.yaml          the settings as run (device, precision and strategy resolved):
                           what ``--resume`` continues, and checks a change against
      metrics.jsonl        one JSON line per step, appended and flushed to disk; cut back to
                           the checkpoint a resumed run starts from
      checkpoints/step-N/  model, optimizer and RNG state (one checkpoint's files:
                           :mod:`fp4rl.rl.checkpoint`; written and resumed from by
                           :mod:`fp4rl.rl.resume`)
      .fp4rl.lock          held by the one process writing here (:mod:`fp4rl.rundir_lock`)

The trainer, ``fp4rl train``, the experiment runner and the run report all read and write
a run through :class:`RunDir`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp4rl.errors import CheckpointError, OutputError, ResumeError
from fp4rl.paths import write_text_atomic
from fp4rl.rl import checkpoint as ckpt

if TYPE_CHECKING:
    from fp4rl.rl.config import TrainConfig

#: the settings as run
CONFIG_FILE = "config.yaml"
#: one JSON line per step
METRICS = "metrics.jsonl"
#: one step's metrics line: every value a number (``step`` an int, the rest floats)
Metrics = dict[str, float]


@dataclass(frozen=True)
class RunDir:
    """The run directory at ``path`` (which may not exist yet)."""

    path: Path

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    # ----- whether a run is here ---------------------------------------------------------
    def holds_run(self) -> bool:
        """Whether a step finished here (metrics written, or a checkpoint)."""
        return self.metrics_file.exists() or ckpt.latest_checkpoint(self.path) is not None

    def refuse_a_run(self) -> None:
        """One line if a run is already here (a new run would overwrite it)."""
        if self.holds_run():
            raise OutputError(f"{self.path} already holds a run: pass --resume to continue "
                              "it, or choose another --output")

    def remove_if_unstarted(self) -> None:
        """Remove a directory a failed or interrupted command created, unless a step
        finished in it: an empty run directory only blocks the next attempt's name."""
        if not self.holds_run():
            shutil.rmtree(self.path, ignore_errors=True)

    # ----- the settings ------------------------------------------------------------------
    def write_config(self, cfg: TrainConfig) -> None:
        """The settings as run: the contract of ``--resume``."""
        import yaml

        text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        write_text_atomic(self.config_file, text)

    def resumable_config(self, requested: TrainConfig, say: Callable[[str], None]
                         ) -> TrainConfig:
        """``requested`` (the saved config or ``--config`` again, with overrides) if it
        changes only what :data:`fp4rl.rl.config.RESUMABLE` allows, each ``auto`` read as
        what the run resolved it to; else one line listing the changes. A run whose every
        checkpoint is damaged is refused here, before any model loads."""
        from fp4rl.rl.config import RESUMABLE, changed_settings, describe_changes

        saved = self.saved_config()
        requested = resolved_like(requested, saved)
        changed = changed_settings(saved, requested)
        if changed:
            raise ResumeError(f"--resume continues {self.path} with its saved settings "
                              f"({self.config_file}) and would change "
                              f"{describe_changes(changed)}; only {', '.join(RESUMABLE)} may "
                              "change: start a new run under another --output to try other "
                              "settings")
        self.check_checkpoints(say)
        return requested

    def saved_config(self) -> TrainConfig:
        from fp4rl.rl.config import load_config

        if not self.config_file.is_file():
            raise ResumeError(f"--resume: {self.path} holds no run to resume (no "
                              f"{CONFIG_FILE}); drop --resume to start one there")
        return load_config(self.config_file)

    # ----- checkpoints -------------------------------------------------------------------
    def check_checkpoints(self, say: Callable[[str], None]) -> None:
        """Say when the run has no checkpoint yet (it trains from step 0), and refuse one
        whose every checkpoint is damaged; the trainer reports a damaged latest one as it
        falls back to the previous."""
        found = ckpt.complete_checkpoints(self.path)
        if not found:
            say(f"note: {self.path} has no checkpoint yet: training it from step 0")
        problems = []
        for path in found:
            try:
                ckpt.verify_checkpoint(path)
                return
            except CheckpointError as err:
                problems.append(str(err))
        if problems:
            raise CheckpointError(f"--resume: no checkpoint of {self.path} is intact: "
                                  + "; ".join(problems))

    # ----- metrics -----------------------------------------------------------------------
    def append_metrics(self, metrics: Metrics) -> None:
        """One step's line, on disk before the next step starts."""
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(metrics) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_metrics(self, step: int) -> None:
        """Keep the lines up to ``step`` (a resumed run writes the later ones again)."""
        if not self.metrics_file.exists():
            return
        kept = [line for line in self.metrics_file.read_text().splitlines()
                if (s := _parse_step(line)) is not None and s <= step]
        write_text_atomic(self.metrics_file, "".join(f"{line}\n" for line in kept))

    def clear_metrics(self) -> None:
        """Drop the lines of a run that never reached a checkpoint."""
        self.metrics_file.unlink(missing_ok=True)

    def read_metrics(self) -> list[Metrics]:
        return read_metrics(self.metrics_file)


def check_same_run(path: Path, saved: Mapping[str, object], config: TrainConfig) -> None:
    """Refuse to continue checkpoint ``path`` (whose settings are ``saved``) under
    ``config`` when they differ beyond :data:`~fp4rl.rl.config.RESUMABLE`: continuing it
    would mix two runs. :meth:`RunDir.resumable_config` checks the settings file before
    any model loads; this checks the settings a loaded checkpoint itself carries."""
    from fp4rl.rl.config import changed_settings, describe_changes, validate

    changed = changed_settings(validate(saved), config)
    if changed:
        raise ResumeError(f"{path} was trained with other settings: "
                          f"{describe_changes(changed)}")


def resolved_like(requested: TrainConfig, saved: TrainConfig) -> TrainConfig:
    """``requested`` with each ``auto`` the trainer resolves (device, mixed precision,
    strategy) taken from ``saved``, which holds what it resolved to."""
    update: dict[str, object] = {key: getattr(saved, key) for key in ("device", "mixed_precision")
                                 if getattr(requested, key) == "auto"}
    if requested.distributed.strategy == "auto":
        update["distributed"] = requested.distributed.model_copy(
            update={"strategy": saved.distributed.strategy})
    return requested.model_copy(update=update)


def _parse_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a kill


def read_metrics(path: str | Path) -> list[Metrics]:
    """All complete lines of a metrics.jsonl file."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


__all__ = ["CONFIG_FILE", "METRICS", "RunDir", "check_same_run", "read_metrics",
           "resolved_like"]
