"""What one linear layer keeps for backward, per token: FP4Linear against nn.Linear.

Counts the bytes of every tensor autograd saves during one forward (parameters excluded:
every layer keeps a reference to the same FP32 master weight), under bf16 autocast and in
fp32. Run: ``python benchmarks/linear_memory.py [--in 2048 --out 2048 --tokens 512]``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from fp4rl.nn import FP4Linear, Recipe, TrainPrecision


def saved_bytes(layer: nn.Module, x: torch.Tensor, precision: str) -> tuple[int, int]:
    """Bytes saved that grow with the tokens, and bytes that do not (weight copies)."""
    params = {p.data_ptr() for p in layer.parameters()}
    per_token = fixed = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal per_token, fixed
        if t.data_ptr() not in params:
            size = t.numel() * t.element_size()
            if t.shape[0] == x.shape[0]:
                per_token += size
            else:
                fixed += size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        layer(x)
    return per_token, fixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--in", dest="d", type=int, default=2048)
    parser.add_argument("--out", dest="n", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    x = torch.randn(args.tokens, args.d, requires_grad=True)
    print(f"saved for backward by one {args.d} -> {args.n} linear, {args.tokens} tokens "
          "(the FP32 master weight, referenced by all, excluded)")
    for precision in ("bf16", "no"):
        layers = {"nn.Linear": nn.Linear(args.d, args.n, bias=False)}
        for scheme in ("requantize", "reuse_forward"):
            train = TrainPrecision(weights="hif4", activations="hif4", gradients="hif4",
                                   backward_operands=scheme)
            layers[f"HiF4 FP4Linear ({scheme})"] = FP4Linear.from_linear(
                nn.Linear(args.d, args.n, bias=False), Recipe(train=train))
        for name, layer in layers.items():
            tokens, fixed = saved_bytes(layer, x, precision)
            print(f"mixed_precision={precision}: {name}: {tokens / args.tokens:.0f} B per "
                  f"token + {fixed / 2**20:.1f} MiB weight copy")


if __name__ == "__main__":
    main()
