"""A refit's payload, built without vLLM: its pieces, their bound, and its size.

The engine side (every piece installed as it arrives equals a one-piece refit, in-process
and with the engine core in its own process) is tests/vllm_engine/test_refit.py.
"""

from __future__ import annotations

import pytest
import torch

import fp4rl
from fp4rl.gemm import PackedOperand
from fp4rl.models import tiny_model
from fp4rl.rollout.vllm.refit import RefitPayload, refit_payload, refit_pieces


def _model(recipe: str = "hif4+resq-2:4") -> torch.nn.Module:
    model, _ = tiny_model("llama", num_hidden_layers=3)
    fp4rl.quantize_model(model, recipe)
    return model


def _same(a: RefitPayload, b: RefitPayload) -> None:
    assert list(a.grids) == list(b.grids)
    for name, g in a.grids.items():
        h = b.grids[name]
        if isinstance(g, PackedOperand):
            assert all(torch.equal(g.packed.fields[k], h.packed.fields[k])
                       for k in g.packed.fields)
        else:
            assert torch.equal(g.values, h.values)
    assert [n for n, _ in a.tensors] == [n for n, _ in b.tensors]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.tensors, b.tensors, strict=True))


@pytest.mark.parametrize("packed", [False, True])
def test_pieces_keep_their_bound_and_join_into_the_whole(packed):
    model = _model()
    whole = refit_payload(model, torch.bfloat16, packed)
    bound = 4096
    pieces = list(refit_pieces(model, torch.bfloat16, packed, max_bytes=bound))
    assert len(pieces) > 8
    joined = RefitPayload({k: v for p in pieces for k, v in p.grids.items()},
                          [t for p in pieces for t in p.tensors])
    _same(whole, joined)
    assert sum(p.nbytes for p in pieces) == whole.nbytes
    for p in pieces:
        # over the bound only where one unit is: one tensor, or one module's linears
        parents = {n.rpartition(".")[0] for n in p.grids}
        assert p.nbytes <= bound or len(p.tensors) + len(parents) == 1


def test_a_modules_linears_travel_together():
    """vLLM merges q/k/v and gate/up into one layer, which installs only with all parts."""
    for piece in refit_pieces(_model(), torch.bfloat16, True, max_bytes=1):
        parents = {n.rpartition(".")[0] for n in piece.grids}
        assert len(parents) <= 1
        for parent in parents:
            leaves = {n.rpartition(".")[2] for n in piece.grids}
            assert leaves in ({"q_proj", "k_proj", "v_proj", "o_proj"},
                              {"gate_proj", "up_proj", "down_proj"}), (parent, leaves)


def test_the_rest_travels_in_the_engines_dtype():
    payload = refit_payload(_model(), torch.bfloat16, packed=True)
    assert payload.tensors
    assert all(t.dtype == torch.bfloat16 for _, t in payload.tensors)


@pytest.mark.slow
def test_a_packed_refit_of_smollm2_moves_under_half_the_bf16_model():
    from fp4rl.models import load_model

    model, _ = load_model("smollm2-135m")
    fp4rl.quantize_model(model, "hif4+resq-2:4")
    bf16 = sum(p.numel() * 2 for p in model.parameters())
    ratio = refit_payload(model, torch.bfloat16, packed=True).nbytes / bf16
    assert ratio <= 0.5, ratio


class _Engine:
    """The parts of a ``vllm.LLM`` a refit reads to choose its wire."""

    def __init__(self, client: str, world_size: int, backend: str | None) -> None:
        from types import SimpleNamespace

        core = type(client, (), {})()
        parallel = SimpleNamespace(world_size=world_size, distributed_executor_backend=backend)
        self.llm_engine = SimpleNamespace(engine_core=core, vllm_config=SimpleNamespace(
            parallel_config=parallel))


@pytest.mark.parametrize(("client", "world", "backend", "tensors"), [
    ("InprocClient", 1, None, True),
    ("InprocClient", 2, "mp", False),  # workers in processes of their own, one queue
    ("InprocClient", 2, "external_launcher", True),  # one engine a rank, in the rank
    ("SyncMPClient", 1, None, False),
])
def test_tensors_travel_as_they_are_only_to_workers_in_this_process(client, world, backend,
                                                                   tensors):
    from fp4rl.rollout.vllm.refit import workers_in_this_process

    assert workers_in_this_process(_Engine(client, world, backend)) is tensors
