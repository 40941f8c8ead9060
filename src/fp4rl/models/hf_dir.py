"""Loading Hugging Face checkpoint directories, from the cache or from anywhere on disk."""

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from fp4rl.models.cache import Fingerprint, discard, ensure_entry
from fp4rl.models.packed import is_packed, load_packed_model

ModelAndTokenizer = tuple[PreTrainedModel, PreTrainedTokenizerBase]

_UNREADABLE = (OSError, json.JSONDecodeError, SafetensorError)
"""What a damaged file raises while loading; anything else is not the cache's fault."""

_GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}

log = logging.getLogger(__name__)


def load_model_dir(
    directory: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> ModelAndTokenizer:
    """Load the causal LM and tokenizer saved in ``directory`` without touching the network.

    The model comes back in eval mode. A tokenizer without a pad token gets its eos token as
    pad token, since batched generation needs one; the padding side is left as saved. A
    packed directory (``fp4rl export --format hif4``) has its packed weights decoded.
    """
    if is_packed(directory):
        model = load_packed_model(directory, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                     local_files_only=True)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stub of .to loses self
    check_tied_embeddings(model)
    tokenizer = load_tokenizer(directory)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in ``directory``, honouring a generic saved class.

    For some model types (qwen2 among them) ``AutoTokenizer`` substitutes its own class even
    when tokenizer_config.json names the generic one, and that class rebuilds the pipeline
    from the vocabulary: a custom tokenizer.json (such as ``tiny_tokenizer``'s) then
    tokenizes differently than when it was saved. The saved tokenizer.json is the ground
    truth, so a checkpoint that declares the generic class is loaded as exactly that.
    """
    if _declared_tokenizer_class(directory) in _GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _declared_tokenizer_class(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def check_tied_embeddings(model: PreTrainedModel) -> None:
    """Fail if the config declares tied embeddings but lm_head has its own weight.

    A silently untied head would double the embedding memory and, worse, let training
    update the two copies apart, so this is checked after every load.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head = model.get_output_embeddings()
    if head is None or head.weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"{type(model).__name__}: lm_head is not tied to the input embeddings")


def load_cached(
    entry: str,
    fingerprint: Fingerprint,
    build: Callable[[Path], None],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> ModelAndTokenizer:
    """Load the cache entry ``entry``, building it first if needed and rebuilding it once if
    its files turn out to be unreadable despite a valid manifest."""
    directory = ensure_entry(entry, fingerprint, build)
    try:
        return load_model_dir(directory, dtype, device)
    except _UNREADABLE as error:
        log.warning("cache entry %s is unreadable (%s); rebuilding it", directory, error)
        discard(directory)
        return load_model_dir(ensure_entry(entry, fingerprint, build), dtype, device)
