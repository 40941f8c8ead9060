"""fp4rl: end-to-end 4-bit reinforcement-learning post-training of LLMs."""

from fp4rl import formats
from fp4rl.formats import get_format, quantize
from fp4rl.nn import (
    Recipe,
    batch_invariant,
    quantize_model,
    rollout_mode,
    set_batch_invariant,
    train_mode,
)
from fp4rl.version import __version__

__all__ = ["Recipe", "__version__", "batch_invariant", "formats", "get_format", "quantize",
           "quantize_model", "rollout_mode", "set_batch_invariant", "train_mode"]
