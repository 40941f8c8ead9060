"""Training config presets: YAML files shipped inside the package, so that
``--config smoke`` works from any directory and from an installed wheel.

Each preset is ``<name>.yaml`` in this folder, its first line a ``# `` comment that
describes it. Not to be confused with :func:`fp4rl.nn.recipe.preset` (recipe names).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fp4rl.errors import ConfigError, did_you_mean

_SUFFIX = ".yaml"


def _folder() -> Path:
    """The presets' directory on disk (setuptools installs fp4rl unzipped)."""
    return Path(str(resources.files(__name__)))


def list_presets() -> dict[str, str]:
    """Preset name -> its one-line description, by name."""
    presets = {}
    for path in sorted(_folder().glob(f"*{_SUFFIX}")):
        first = path.read_text().partition("\n")[0]
        presets[path.name.removesuffix(_SUFFIX)] = first.removeprefix("#").strip()
    return presets


def preset_path(name_or_path: str | Path) -> Path:
    """The YAML file a ``--config`` value means: an existing file, else the preset of that
    name (``smoke`` or ``smoke.yaml``). Raises :class:`ConfigError` naming the presets."""
    given = Path(name_or_path)
    if given.is_file():
        return given
    name = given.name.removesuffix(_SUFFIX)
    names = list(list_presets())
    if str(name_or_path).removesuffix(_SUFFIX) == name and name in names:
        return _folder() / f"{name}{_SUFFIX}"
    raise ConfigError(f"config {str(name_or_path)!r} does not exist: neither a file nor a "
                      f"preset{did_you_mean(name, names)}; presets: {', '.join(names)}")


__all__ = ["list_presets", "preset_path"]
