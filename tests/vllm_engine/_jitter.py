"""The noise floor of an engine comparison: a perturbation of the size by which two correct
attention kernels differ, applied to fp4rl's own forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def attention_jitter(model, perturb: float, seed: int = 0) -> Iterator[None]:
    """Within it, every attention output (o_proj's input) of ``model`` is multiplied by
    ``1 + perturb * (+-1)``, signs drawn from ``seed``; nothing where ``perturb`` is 0."""
    g = torch.Generator().manual_seed(seed)

    def jitter(module, args):
        sign = torch.randint(0, 2, args[0].shape, generator=g).float() * 2 - 1
        return ((args[0].float() * (1 + perturb * sign)).to(args[0].dtype),)

    hooks = [m.register_forward_pre_hook(jitter) for n, m in model.named_modules()
             if perturb and n.endswith("o_proj")]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
