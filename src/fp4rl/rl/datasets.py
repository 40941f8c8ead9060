"""Turning a data config into token-id prompts for training and evaluation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fp4rl.data import Example, build_prompt, load_examples, synthetic_dataset
from fp4rl.data.loaders import DataError
from fp4rl.data.synthetic import SYNTHETIC_TASKS
from fp4rl.errors import ConfigError
from fp4rl.rl.config import DataConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_split(cfg: DataConfig, split: str, seed: int = 0,
               size: int | None = None) -> list[Example]:
    """The ``train`` or ``test`` examples a data config names.

    ``synthetic`` draws from the built-in arithmetic task and ``synthetic-words`` from its
    word-problem variant (disjoint splits); any other source is a dataset layout read
    from ``train_path`` / ``test_path``.
    """
    n = size or (cfg.train_size if split == "train" else cfg.test_size)
    if cfg.source in SYNTHETIC_TASKS:
        return synthetic_dataset(split, n=n, levels=cfg.levels, seed=seed, source=cfg.source)
    path = cfg.train_path if split == "train" else cfg.test_path
    if path is None:
        raise ConfigError(f"data.source={cfg.source!r} needs data.{split}_path (a .jsonl or "
                          ".parquet file, local or hf://datasets/ORG/NAME/PATH-IN-REPO)")
    return load_examples(cfg.source, path, fields=cfg.fields, strict=cfg.strict, limit=n)


def encode_examples(examples: list[Example], tokenizer: PreTrainedTokenizerBase,
                    max_prompt_length: int,
                    template: str | None = None, strict: bool = False,
                    log: Callable[[str], None] = print
                    ) -> tuple[list[Example], list[list[int]]]:
    """The examples whose prompt fits ``max_prompt_length``, and their token ids.

    Prompts are never truncated (a cut prompt asks a different question): an over-long
    one is skipped with a message, or refused when ``strict``.
    """
    kept, encoded = [], []
    for e in examples:
        ids = tokenizer(build_prompt(e, tokenizer, template), add_special_tokens=False)[
            "input_ids"]
        if len(ids) <= max_prompt_length:
            kept.append(e)
            encoded.append(ids)
        elif strict:
            raise DataError(f"{e.source} example {e.index}: prompt of {len(ids)} tokens "
                             f"exceeds grpo.max_prompt_length={max_prompt_length}")
    if len(kept) < len(examples):
        log(f"skipped {len(examples) - len(kept)} of {len(examples)} prompts longer than "
            f"grpo.max_prompt_length={max_prompt_length}")
    if not kept:
        raise DataError(f"no usable prompts: all {len(examples)} are longer than "
                        f"grpo.max_prompt_length={max_prompt_length}")
    return kept, encoded


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS plus the chat end-of-turn tokens a chat model may emit instead."""
    ids = {tokenizer.eos_token_id}
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if token in vocab:
            ids.add(vocab[token])
    return sorted(i for i in ids if i is not None)
