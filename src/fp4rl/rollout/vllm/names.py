"""Which Hugging Face layers a vLLM linear stands for. vLLM merges some of a model's
linears into one layer (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) and its
model class says which, as ``packed_modules_mapping``; vLLM hands that mapping to the
quantization config before it builds a layer, and fp4rl's config reads it from there, so
that every model vLLM supports is named as vLLM names it. Nothing here imports vLLM."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def hf_layer_names(prefix: str, packed_modules_mapping: Mapping[str, Sequence[str]]
                   ) -> tuple[str, ...]:
    """The Hugging Face module names the vLLM linear ``prefix`` stands for, in its row
    order (``...qkv_proj`` -> ``...q_proj``, ``...k_proj``, ``...v_proj`` where the
    mapping merges them; a linear it does not name stands for itself)."""
    parent, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf) or (leaf,)
    return tuple(f"{parent}.{p}" if parent else p for p in parts)


__all__ = ["hf_layer_names"]
