"""Rollout-side recovery of activation precision: Rollout-ResQ and the paper's baselines.

``sparsify`` and ``resq_matmul`` are the functional forms; the classes behind recipes
(``resq``, ``smoothquant``, ``rht``, ``occ``) are plug-ins built by ``make_recovery``.
"""

from fp4rl.recovery.base import RolloutRecovery, make_recovery, register
from fp4rl.recovery.outliers import clamp_outliers, outlier_block_fraction, outlier_blocks
from fp4rl.recovery.resq import resq_activation, resq_matmul
from fp4rl.recovery.sparsity import density, keep_mask, parse_pattern, sparsify

__all__ = ["RolloutRecovery", "clamp_outliers", "density", "keep_mask", "make_recovery",
           "outlier_block_fraction", "outlier_blocks", "parse_pattern", "register",
           "resq_activation", "resq_matmul", "sparsify"]
