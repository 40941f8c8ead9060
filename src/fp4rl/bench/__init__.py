"""Benchmarks behind ``fp4rl bench``: ratios measured side by side in one run."""
