"""``key=value`` overrides of a training config: ``grpo.learning_rate=1e-5`` sets one
setting of the nested mapping, its value read as YAML 1.2 (:mod:`.yaml12`)."""

from __future__ import annotations

from fp4rl.errors import ConfigError
from fp4rl.rl.config.yaml12 import parse_value


def apply_override(data: dict[str, object], item: str) -> None:
    """Set ``a.b.c=value`` (value parsed as YAML) in a nested dict, in place."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value (e.g. grpo.learning_rate=1e-5)")
    try:
        value = parse_value(raw) if raw else None
    except ConfigError as err:
        raise ConfigError(f"override {key}: {err}") from None
    set_path(data, key, value)


def set_path(data: dict[str, object], key: str, value: object) -> None:
    """``data["a"]["b"]["c"] = value`` for ``key = "a.b.c"``, creating sections."""
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


__all__ = ["apply_override", "set_path"]
