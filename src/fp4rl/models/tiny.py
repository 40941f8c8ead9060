"""Tiny random causal LMs and a character tokenizer that need no download.

They exist so that tests of quantized layers and of the RL trainer run in well under a
second. Every linear dimension (hidden 64, intermediate 128, q 4x32=128, kv 2x32=64) is a
multiple of 64, so weight matrices split evenly into 64-element quantization blocks along
either axis. The tokenizer maps one printable ASCII character to one token and speaks the
same ChatML turn format as SmolLM2/Qwen2, so prompt formatting code exercises the same
special tokens as with the real models.
"""

import string

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

UNK, BOS, EOS, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n\t"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}

_TINY_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "unk_token_id": SPECIAL_TOKENS.index(UNK),
    "bos_token_id": SPECIAL_TOKENS.index(BOS),
    "eos_token_id": SPECIAL_TOKENS.index(EOS),
    "pad_token_id": SPECIAL_TOKENS.index(PAD),
}


def tiny_tokenizer(vocab_size: int = 128) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with ChatML special tokens and a chat template.

    The vocabulary is padded with ``<|reserved_i|>`` tokens up to ``vocab_size`` so that
    every id a random model can sample decodes to something. Characters outside printable
    ASCII map to ``<|endoftext|>`` (the unknown token). No BOS is prepended, as with SmolLM2.
    Padding is not forced to either side; callers set ``padding_side`` as they need.
    """
    base = [*SPECIAL_TOKENS, *CHARACTERS]
    if vocab_size < len(base):
        raise ValueError(f"vocab_size must be at least {len(base)}, got {vocab_size}")
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - len(base))]
    vocab = {token: index for index, token in enumerate(base + reserved)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    specials = [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(
    arch: str = "llama", seed: int = 0, **overrides: object
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A small random-initialized causal LM of ``arch`` ("llama" or "qwen2") and its tokenizer.

    ``overrides`` replace entries of the config (e.g. ``num_hidden_layers=4``,
    ``tie_word_embeddings=False``). The weights depend only on ``seed``: the global RNG is
    forked, so building a model does not disturb the caller's random stream. The model is
    float32, on CPU, in eval mode, like the models returned by ``load_model``.
    """
    if arch not in _ARCHITECTURES:
        choices = ", ".join(sorted(_ARCHITECTURES))
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {choices}")
    config_class, model_class = _ARCHITECTURES[arch]
    config = config_class(**{**_TINY_CONFIG, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.eval(), tiny_tokenizer(config.vocab_size)
