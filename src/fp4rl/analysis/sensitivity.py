"""How far float noise upstream moves a recipe's log-probs: ``fp4rl diagnose --sensitivity``.

The same prompt scored twice by the rollout policy, the second time with every input
embedding nudged by ``nudge`` of its own magnitude (``1e-7``: about one float32 ulp, the
size of a GEMM's row-count-dependent rounding). A policy whose values are unquantized moves
by about as much; 4-bit rounding turns a nudge near a rounding boundary into a flipped
value that the next layers and later positions carry on; NVFP4's dynamic FP32 scale
carries it into every output of the GEMM, where a power-of-two one stops it. The number
says how much of a recipe's rollout/trainer mismatch float noise alone can make, and so
how much batch invariance buys it.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from fp4rl.nn import get_recipe, quantize_model, rollout_mode
from fp4rl.nn.recipe import Recipe, scale_rule

#: the recipes diagnosed by default: one per activation-scaling kind, and pow2 beside the
#: dynamic NVFP4 scales
DEFAULT_RECIPES = ("bf16", "hif4", "mxfp4", "nvfp4", "nvfp4@pow2", "nvfp4_per_token",
                   "nvfp4_per_token@pow2", "miles-nvfp4", "nemo-rl-nvfp4", "torchao-nvfp4")


@dataclass(frozen=True)
class Sensitivity:
    """One recipe's log-prob change under the nudge, over the prompts' tokens."""

    recipe: str
    mean_nat: float
    max_nat: float
    changed_fraction: float  # tokens whose log-prob moved at all
    tokens: int


def parse_recipe(spec: str) -> Recipe:
    """A recipe name, optionally ``@<scale rule>`` for its NVFP4 activations
    (``nvfp4@pow2``)."""
    name, _, rule = spec.partition("@")
    recipe = get_recipe(name)
    return recipe.with_nvfp4_scale(scale_rule(rule)) if rule else recipe


@torch.no_grad()
def sensitivity(model: torch.nn.Module, prompts: list[torch.Tensor], spec: str,
                nudge: float = 1e-7, dtype: torch.dtype = torch.float32) -> Sensitivity:
    """``spec``'s rollout policy (a copy of ``model``), each prompt alone (no padding),
    the next-token log-prob of every prompt token with and without the nudge."""
    policy = quantize_model(copy.deepcopy(model).eval(), parse_recipe(spec))
    embed = getattr(policy, "get_input_embeddings", None)
    if embed is None:
        raise TypeError("the sensitivity diagnosis takes a Hugging Face causal LM")
    embed = embed()
    diffs = []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with rollout_mode(policy), autocast:
        for ids in prompts:
            ids = ids.reshape(1, -1)
            x = embed(ids)
            scores = [torch.log_softmax(policy(inputs_embeds=e).logits[0, :-1].float(), -1)
                      .gather(-1, ids[0, 1:, None]).squeeze(-1)
                      for e in (x, x + x.abs() * nudge)]
            diffs.append((scores[0] - scores[1]).abs())
    d = torch.cat(diffs)
    return Sensitivity(spec, d.mean().item(), d.max().item(), (d > 0).float().mean().item(),
                       d.numel())


def report(model: str, nudge: float, rows: list[Sensitivity]) -> dict[str, object]:
    return {"model": model, "nudge": nudge, "recipes": [asdict(r) for r in rows]}
