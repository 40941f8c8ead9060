"""What the vLLM and verl tests ask of an engine running the fp4rl method: its FP4 layers,
layer-by-layer equality with a reference engine, greedy completions with log-probs, and a
trainer's step of change to the weights between syncs."""

from __future__ import annotations

import torch

from fp4rl.integrations.vllm import engine_model

PROMPTS = ["Question: what is 3 + 7? Answer:", "Tom has 4 apples and buys 9 more. How many?"]


def fp4_layers(llm) -> dict[str, torch.nn.Module]:
    """The engine's linears that run the fp4rl method, by module name."""
    return {n: m for n, m in engine_model(llm).named_modules() if hasattr(m, "fp4rl")}


def assert_layers_equal(layers: dict[str, torch.nn.Module],
                        reference: dict[str, torch.nn.Module], tag: object = None) -> None:
    """Each of ``layers`` gives, bit for bit, what the same-named layer of ``reference``
    gives on random bf16 inputs."""
    with torch.inference_mode():
        for name, layer in layers.items():
            x = torch.randn(3, layer.fp4rl.in_features).bfloat16()
            assert torch.equal(layer.quant_method.apply(layer, x),
                               reference[name].quant_method.apply(reference[name], x)), \
                (tag, name)


def greedy(llm) -> list[tuple[list[int], list[float]]]:
    """Six greedy tokens and their log-probs for each of :data:`PROMPTS`."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def nudge(model: torch.nn.Module) -> None:
    """An optimizer step's worth of change to every weight."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
