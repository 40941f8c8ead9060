"""Capturing linear-layer inputs and measuring what FP4 does to them.

The paper's diagnosis (its Figures 2, 3 and 5) is about the *inputs* of the linear
layers inside the transformer blocks, quantized along the reduction axis
(in_features) exactly as the rollout GEMM sees them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from fp4rl.formats import quantize

#: linear layers of a transformer block (Llama / Qwen2 naming)
BLOCK_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.\w+$")


def block_linears(model: nn.Module, pattern: str | None = None) -> dict[str, nn.Linear]:
    """Linear layers inside the transformer blocks, optionally filtered by a regex."""
    chosen = {}
    for name, module in model.named_modules():
        wanted = pattern is None or re.search(pattern, name)
        if isinstance(module, nn.Linear) and BLOCK_LINEAR.search(name) and wanted:
            chosen[name] = module
    return chosen


@torch.no_grad()
def capture_linear_inputs(model: nn.Module, inputs: Iterable[torch.Tensor],
                          pattern: str | None = None) -> dict[str, torch.Tensor]:
    """Run ``inputs`` (token-id tensors of shape (1, T)) and collect each block linear's input.

    Prompts run one at a time so no padding token ever enters the statistics; the
    result maps layer names to ``(tokens, in_features)`` float32 matrices on the CPU,
    whatever device the model runs on.
    """
    device = next(model.parameters()).device
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in block_linears(model, pattern).items():
        def hook(_mod, args, name=name):
            captured.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))
        hooks.append(module.register_forward_pre_hook(hook))
    try:
        for ids in inputs:
            model(input_ids=ids.to(device))
    finally:
        for h in hooks:
            h.remove()
    return {name: torch.cat(parts).float().cpu() for name, parts in captured.items()}


def zero_fraction(x: torch.Tensor, fmt: str = "bf16") -> float:
    """Fraction of values that are exactly zero after quantizing along the last axis."""
    return (quantize(x, fmt) == 0).float().mean().item()


def zero_fractions(acts: dict[str, torch.Tensor],
                   formats: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{layer: {fmt: zero fraction}}`` for every captured layer ("bf16" = unquantized)."""
    return {name: {fmt: zero_fraction(x, fmt) for fmt in formats} for name, x in acts.items()}
