"""verl's trained actor scored as the FP4 rollout policy: ``fp4rl eval --model`` on the
checkpoint directories verl 0.9.1 writes (:mod:`fp4rl.models.verl_dir`).

The layout is built here as verl's ``FSDPCheckpointManager.save_checkpoint`` and its
trainer's ``_save_checkpoint`` write it (verl needs GPUs): per-rank shard files and
``fsdp_config.json`` in ``global_step_N/actor``, the config and tokenizer in its
``huggingface/`` always, and, with ``save_contents`` holding "hf_model", the full state
dict of the FP4 actor saved through a model verl builds in bf16 (``save_pretrained``
with ``state_dict=``, verl's call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fp4rl.cli import main
from fp4rl.integrations.verl import fp4_actor
from fp4rl.models import load_model, tiny_model
from fp4rl.models.verl_dir import resolve_verl_dir
from fp4rl.nn import quantize_model
from fp4rl.nn.recipe import get_recipe
from fp4rl.rl.sources import load_policy

RECIPE = "hif4+resq-2:4"


def trained_actor() -> torch.nn.Module:
    """A tiny actor as verl's engine builds it under the hook (FP4 layers on FP32
    masters), its weights moved off their initial values as training would."""
    model, _ = tiny_model("llama")
    actor = fp4_actor(model.float(), RECIPE)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # FP32 values a bf16 copy cannot hold
    return actor


def save_like_verl(actor: torch.nn.Module, step_dir: Path, hf_model: bool) -> Path:
    """``step_dir/actor`` as verl writes it with world size 1; the full model only with
    ``hf_model`` (verl's "hf_model" in ``actor.checkpoint.save_contents``)."""
    _, tok = tiny_model("llama")
    actor_dir = step_dir / "actor"
    hf = actor_dir / "huggingface"
    hf.mkdir(parents=True)
    state = {k: v.detach().clone() for k, v in actor.state_dict().items()}
    torch.save(state, actor_dir / "model_world_size_1_rank_0.pt")
    torch.save({}, actor_dir / "optim_world_size_1_rank_0.pt")
    torch.save({"lr_scheduler": None, "rng": {}},
               actor_dir / "extra_state_world_size_1_rank_0.pt")
    (actor_dir / "fsdp_config.json").write_text(
        json.dumps({"FSDP_version": 2, "world_size": 1}, indent=4))
    actor.config.save_pretrained(hf)
    tok.save_pretrained(hf)
    torch.save({}, step_dir / "data.pt")
    if hf_model:
        save_model = AutoModelForCausalLM.from_config(actor.config, dtype=torch.bfloat16)
        if actor.config.tie_word_embeddings:  # verl's drop_tied_target_keys
            state.pop("lm_head.weight", None)
        save_model.save_pretrained(hf, state_dict=state)
    return actor_dir


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A verl checkpoint root: step 1 saved without "hf_model" (shards only), step 2
    (the latest) with it."""
    root = tmp_path_factory.mktemp("verl") / "checkpoints" / "fp4rl" / "gsm8k"
    actor = trained_actor()
    save_like_verl(actor, root / "global_step_1", hf_model=False)
    save_like_verl(actor, root / "global_step_2", hf_model=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    return root, actor


def one_error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_every_path_of_the_checkpoint_loads_the_fp32_masters(verl_run):
    root, actor = verl_run
    hf = root / "global_step_2" / "actor" / "huggingface"
    masters = actor.state_dict()
    for path in (root, root / "global_step_2", hf.parent, hf):
        assert resolve_verl_dir(path) == hf
        model, tok = load_model(str(path))
        loaded = model.state_dict()
        assert loaded.keys() == masters.keys()
        for name, weight in loaded.items():  # bit for bit, though verl's model was bf16
            assert weight.dtype == torch.float32
            assert torch.equal(weight, masters[name]), name
        assert tok.pad_token is not None


def test_the_recipe_scores_the_actors_rollout_policy(verl_run):
    root, actor = verl_run
    net, _, label = load_policy(str(root), None, RECIPE)
    plain, _ = tiny_model("llama")
    plain.load_state_dict(actor.state_dict())
    reference = quantize_model(plain, get_recipe(RECIPE))  # Q(W) of the FP32 masters
    ids = torch.randint(0, actor.config.vocab_size, (2, 10),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = net(ids).logits, reference(ids).logits
        unquantized = load_model(str(root))[0](ids).logits
    assert torch.equal(got, want)
    assert not torch.allclose(got, unquantized)  # the recipe is applied
    assert label == f"{root} ({RECIPE})"


def test_fp4rl_eval_on_the_checkpoint_root(verl_run, tmp_path, capsys):
    root, _ = verl_run
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(root), "--recipe", RECIPE, "--n", "4",
                 "--max-new-tokens", "4", "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["policy"] == f"{root} ({RECIPE})"
    assert result["n"] == 4 and len(result["correct"]) == 4


def test_shards_only_are_refused_naming_the_merge(verl_run, capsys):
    root, _ = verl_run
    actor_dir = root / "global_step_1" / "actor"
    merge = (f"python -m verl.model_merger merge --backend fsdp --local_dir {actor_dir} "
             f"--target_dir {actor_dir / 'merged'}")
    for path in (root / "global_step_1", actor_dir, actor_dir / "huggingface"):
        line = one_error_line(capsys, ["eval", "--model", str(path), "--n", "2"])
        assert merge in line
        assert "save_contents=[model,optimizer,extra,hf_model]" in line


def test_after_the_merge_the_same_path_loads(verl_run, tmp_path):
    """verl's merger writes bf16 weights into the target the refusal names; the same
    path then loads them (rounded to bf16: the FP32 save is the exact policy)."""
    _, actor = verl_run
    copy = tmp_path / "global_step_1"
    actor_dir = save_like_verl(actor, copy, hf_model=False)
    with pytest.raises(FileNotFoundError, match=r"verl\.model_merger merge"):
        load_model(str(copy))
    merged = AutoModelForCausalLM.from_config(actor.config, dtype=torch.bfloat16)
    state = {k: v.detach().bfloat16() for k, v in actor.state_dict().items()
             if k != "lm_head.weight" or not actor.config.tie_word_embeddings}
    merged.save_pretrained(actor_dir / "merged", state_dict=state)
    tiny_model("llama")[1].save_pretrained(actor_dir / "merged")
    model, _ = load_model(str(copy))
    weight = model.model.layers[0].mlp.up_proj.weight
    want = actor.model.layers[0].mlp.up_proj.weight.detach()
    assert torch.equal(weight, want.bfloat16().float()) and not torch.equal(weight, want)


def test_a_verl_checkpoint_as_checkpoint_names_model(verl_run, capsys):
    root, _ = verl_run
    line = one_error_line(capsys, ["eval", "--checkpoint", str(root), "--n", "2"])
    assert f"is a verl checkpoint, not an fp4rl run: pass it as --model {root}" in line


def test_a_latest_step_that_is_gone_is_one_line(tmp_path, capsys):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("40\n")
    line = one_error_line(capsys, ["eval", "--model", str(root), "--n", "2"])
    assert "names step 40" in line and "global_step_40" in line


def test_other_directories_are_not_verl_checkpoints(tiny_llama_dir, tmp_path):
    assert resolve_verl_dir(tiny_llama_dir) is None
    assert resolve_verl_dir(tmp_path) is None
    (tmp_path / "huggingface").mkdir()  # a folder of that name alone is not verl's
    assert resolve_verl_dir(tmp_path / "huggingface") is None
