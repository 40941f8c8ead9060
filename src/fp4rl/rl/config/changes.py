"""What a resumed run may change of the config it was started with, and how a refused
change is described."""

from __future__ import annotations

from collections.abc import Mapping

from fp4rl.rl.config.schema import TrainConfig

#: settings a resumed run may change: how long it runs, how often and how many checkpoints
#: it keeps, its evaluation (which the trainer never runs) and how long a collective
#: waits. Any other change would continue the run on a different trajectory.
RESUMABLE = ("run.steps", "run.save_steps", "run.keep_checkpoints", "eval",
             "distributed.timeout_s")


def flatten(data: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``: a config's settings by dotted key."""
    flat: dict[str, object] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def changed_settings(saved: TrainConfig, requested: TrainConfig
                     ) -> dict[str, tuple[object, object]]:
    """The settings ``requested`` changes from ``saved``, by dotted key, as (saved,
    requested), leaving out the :data:`RESUMABLE` ones."""
    old = flatten(saved.model_dump(mode="json"))
    new = flatten(requested.model_dump(mode="json"))
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)
            and not any(key == r or key.startswith(f"{r}.") for r in RESUMABLE)}


def describe_changes(changed: dict[str, tuple[object, object]]) -> str:
    """``grpo.learning_rate 1e-05 -> 0.001, ...``: what a refused resume would change."""
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())


__all__ = ["RESUMABLE", "changed_settings", "describe_changes", "flatten"]
