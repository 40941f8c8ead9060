"""One process of FP4GRPOTrainer with TRL's colocated vLLM engine, as ``accelerate launch``
starts it (``tests/vllm_engine/test_trl_vllm_ranks.py``): two steps on the embedded
model, then a digest of what the rank's engine and model hold, written to
``<output>/rank<N>.json``."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from _trl_checks import IS_METRICS, digit_fraction, logged
from datasets import Dataset
from trl import GRPOConfig

from fp4rl.integrations.trl import FP4GRPOTrainer
from fp4rl.integrations.vllm import engine_model
from fp4rl.models import load_model

PROMPTS = [f"Question: what is {a} + {b}? Answer:" for a, b in
           [(3, 7), (12, 30), (5, 9), (41, 8), (2, 2), (17, 25), (6, 60), (33, 14)]]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(output: Path) -> None:
    model, tok = load_model("smollm2-135m")
    args = GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=2, use_cpu=True, bf16=False, temperature=0.7, report_to="none",
                      save_strategy="no", logging_steps=1, output_dir=str(output / "trl"),
                      use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, seed=0)
    trainer = FP4GRPOTrainer(model=model, reward_funcs=digit_fraction, args=args,
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             processing_class=tok, fp4_recipe="hif4+resq-2:4")
    trainer.train()
    trainer._last_loaded_step = -1
    trainer._refit_engine()  # the engine on the trained weights
    layers = [(n, m) for n, m in sorted(engine_model(trainer.vllm_generation.llm)
                                        .named_modules()) if hasattr(m, "fp4rl")]
    metrics = logged(trainer)
    report = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "methods": sorted({type(m.quant_method).__name__ for _, m in layers}),
        "engine_layers": len(layers),
        "engine_digest": digest([t for _, m in layers for t in m.fp4rl.store.tensors()]),
        "weight_digest": digest(list(trainer.accelerator.unwrap_model(trainer.model)
                                     .state_dict().values())),
        "refits": [{k: e[k] for k in ("time/refit", "sync/bytes")}
                   for e in trainer.state.log_history if "time/refit" in e],
        "is_metrics": {k: metrics[k] for k in IS_METRICS},
    }
    (output / f"rank{report['rank']}.json").write_text(json.dumps(report))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    try:
        run(Path(sys.argv[1]))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
