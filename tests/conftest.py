"""Test-wide settings.

Tests run tiny tensors and models, where a parallel region costs more than it saves and
oversubscribes a shared 2-core machine; one intra-op thread keeps the suite fast and its
timings steady.
"""

import torch

torch.set_num_threads(1)
