"""fp4rl: end-to-end 4-bit reinforcement-learning post-training of LLMs."""

from fp4rl import formats
from fp4rl.formats import get_format, quantize

__version__ = "0.1.0"

__all__ = ["__version__", "formats", "get_format", "quantize"]
