"""Rollout-side recovery of activation precision: Rollout-ResQ and the paper's baselines.

Every method, built-in or not, is a plug-in registered by name with
:func:`register_recovery`; importing this package registers the built-in ones (``none``,
``smoothquant``, ``rht``, ``occ``, ``resq``, in the order of the paper's tables, then
``resqw``, ResQ on the weight too, a step beyond the paper).
``sparsify`` and ``resq_matmul`` are the functional forms.
"""

# Registers the built-in methods; this order is the row order of the recovery tables.
from fp4rl.recovery import smoothquant, rht, occ, resq, resqw  # noqa: F401, I001
from fp4rl.recovery.base import (
    RecoveryConfig,
    RolloutRecovery,
    get_recovery,
    list_recoveries,
    recovery_variants,
    register_recovery,
    unregister_recovery,
)
from fp4rl.recovery.outliers import clamp_outliers, outlier_block_fraction, outlier_blocks
from fp4rl.recovery.resq import resq_activation, resq_matmul
from fp4rl.recovery.sparsity import keep_mask, parse_pattern, sparsify
from fp4rl.recovery.spec import Recovery, make_recovery

__all__ = ["Recovery", "RecoveryConfig", "RolloutRecovery", "clamp_outliers",
           "get_recovery", "keep_mask", "list_recoveries", "make_recovery",
           "outlier_block_fraction", "outlier_blocks", "parse_pattern", "recovery_variants",
           "register_recovery", "resq_activation", "resq_matmul", "sparsify",
           "unregister_recovery"]
