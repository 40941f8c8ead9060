"""The FP4 actor computes in bf16 on FP32 masters inside verl's own ``forward_step``.

verl autocasts ``forward_step`` to its FSDP ``param_dtype`` and skips autocast where that
is fp32, which FP4 training sets for its masters; the hook sets verl's autocast dtype to
bf16 for the actor (``fp4rl.integrations.verl.wrap_fsdp_build``). Run in a process of its
own (one gloo rank, verl's engine built as in ``test_verl_actor.py``) through verl's
``infer_batch`` (what ``compute_log_prob`` calls) and ``train_batch`` (what
``update_actor`` calls), on a batch converted by verl's own ``left_right_2_no_padding``.

Stand-ins: verl's platform (``_cpu_platform``), and the attention implementation: flash-
attention cannot run on a CPU, so the model's attention is registered under a key of its
own that records the autocast state it runs under (what transformers' flash-attention
integration casts fp32 queries to) and calls SDPA."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.trainer", reason="verl is not installed; `make test-verl` runs "
                    "these tests in an environment of its own")

from _one_rank import run_one_rank

SCRIPT = r"""
from fp4rl.integrations.vllm import model_dir
from fp4rl.nn import fp4_layers
from tensordict import TensorDict
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from verl.trainer.config.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.engine import EngineRegistry
from verl.workers.utils.padding import left_right_2_no_padding

seen = {"attention": set(), "fp4_out": set()}

def attention(module, query, key, value, *args, **kwargs):
    on = torch.is_autocast_enabled(query.device.type)
    seen["attention"].add(str(torch.get_autocast_dtype(query.device.type)) if on else "fp32")
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

AttentionInterface.register("cpu_stand_in", attention)
model = HFModelConfig(path=model_dir("smollm2-135m"),
                      override_config={"attn_implementation": "cpu_stand_in"})
config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False,
                          mixed_precision={"param_dtype": "fp32"})
actor = EngineRegistry.new(model_type="language_model", backend="fsdp2", model_config=model,
                           engine_config=config,
                           optimizer_config=FSDPOptimizerConfig(lr=1e-4, total_training_steps=2),
                           checkpoint_config=CheckpointConfig())
actor.initialize()
layers = fp4_layers(actor.module)
for layer in layers.values():
    layer.register_forward_hook(lambda m, i, o: seen["fp4_out"].add(str(o.dtype)) and None)

def batch(**meta):
    bs, length, response = 2, 12, 4
    data = TensorDict({"input_ids": torch.randint(0, 1000, (bs, length)),
                       "attention_mask": torch.ones(bs, length, dtype=torch.long),
                       "response_mask": torch.ones(bs, response, dtype=torch.long),
                       "position_ids": torch.arange(length).expand(bs, length).clone(),
                       "temperature": torch.ones(bs)}, batch_size=bs)
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, use_remove_padding=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2, max_token_len_per_gpu=1024,
                         use_fused_kernels=False, **meta)
    return data

out = {}
with actor.eval_mode():
    actor.infer_batch(batch(calculate_entropy=True, compute_loss=False))
out["log_prob"] = {k: sorted(v) for k, v in seen.items()}
for v in seen.values():
    v.clear()

def loss_function(model_output, data, dp_group=None):
    logp = model_output["log_probs"]
    return -(logp.values() if logp.is_nested else logp).float().mean(), {}

weight = next(iter(layers.values())).weight
before = weight.full_tensor().clone()
with actor.train_mode():
    actor.train_batch(batch(calculate_entropy=False), loss_function=loss_function)
out["update"] = {k: sorted(v) for k, v in seen.items()}
out["moved"] = not torch.equal(before, weight.full_tensor())
out["param_dtypes"] = sorted({str(p.dtype) for p in actor.module.parameters()})
out["optimizer_dtypes"] = sorted({str(s.dtype) for st in actor.optimizer.state.values()
                                  for s in st.values() if torch.is_tensor(s) and s.dim()})
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def test_verls_forward_step_runs_the_fp4_actor_in_bf16_on_fp32_masters(tmp_path):
    out = run_one_rank(SCRIPT, 29519, tmp_path)
    for phase in ("log_prob", "update"):  # compute_log_prob's and update_actor's engine calls
        assert out[phase]["attention"] == ["torch.bfloat16"], (phase, out)
        assert out[phase]["fp4_out"] == ["torch.bfloat16"], (phase, out)
    assert out["moved"]
    assert out["param_dtypes"] == ["torch.float32"]
    assert out["optimizer_dtypes"] == ["torch.float32"]
