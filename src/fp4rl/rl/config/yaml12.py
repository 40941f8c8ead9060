"""YAML as a config's author means it: the core rules of YAML 1.2 on PyYAML's safe loader,
for config files and ``key=value`` overrides alike."""

from __future__ import annotations

import re

import yaml

from fp4rl.errors import ConfigError


class Loader(yaml.SafeLoader):
    """YAML as a user means it (YAML 1.2's core rules): ``1e-1`` is a float (YAML 1.1
    wants ``1.0e-1``); only true/false are booleans, so ``mixed_precision=no`` is "no";
    and ``2:4`` stays the string the paper writes (YAML 1.1 reads base-60 integers,
    ``2:4`` = 124), as do ``010`` and other numbers YAML 1.1 reads in odd bases."""


_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                              list("-+0123456789"))
Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?[0-9]+[eE][-+]?[0-9]+"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def parse_value(raw: str) -> object:
    """An override's value, read as YAML with :class:`Loader`; malformed YAML is a
    one-line :class:`ConfigError`."""
    try:
        return yaml.load(raw, Loader=Loader)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{raw!r} is not valid YAML ({problem})") from None


__all__ = ["Loader", "parse_value"]
