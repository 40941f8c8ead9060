"""Test-wide settings.

Tests run tiny tensors and models, where a parallel region costs more than it saves and
oversubscribes a shared 2-core machine; one intra-op thread keeps the suite fast and its
timings steady. Without a GPU the Triton kernels run in Triton's interpreter, which must
be chosen before any kernel is defined.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
