"""A recovery method's rollout activation as a PyTorch custom operator, so that a
compiled forward (``torch.compile``, and the CUDA graphs a serving engine captures from it)
traces through it.

A method's :meth:`~fp4rl.recovery.base.RolloutRecovery.activation` picks a path per call in
Python and runs fp4rl's fused C kernel through ctypes (or a Triton launch): opaque to a
tracer, which would break the graph there. ``fp4rl::rollout_activation`` runs it as one
operator: the tracer records one call from the fake implementation, which knows the
output's shape from :meth:`~fp4rl.recovery.base.RolloutRecovery.activation_scales`, and at
run time the same kernels run as in eager mode, so a compiled forward gives the same bits.

The operator names a method by a handle (:class:`TracedActivation`), as an operator takes
tensors, numbers and strings only. The handle is the method's settings written out
(method, parameters, formats, width, seed), not a counter: a compiled artifact that vLLM
saves and loads in another process bakes the handles in, and there they must name the same
computation whatever order that process built its layers in. The settings name the
computation only for methods with no state between calls, the ones that serve in engines
(``serves_in_engines``); others are refused. A string also stays a constant of the graph
where a tracer would make an integer symbolic.
"""

from __future__ import annotations

import json

import torch

from fp4rl.gemm import UNQUANTIZED, NMOperand, Operand, stack_rows
from fp4rl.recovery.base import RolloutRecovery
from fp4rl.recovery.spec import Recovery

#: the compute dtypes a rollout runs in
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: one traced activation per handle (methods with the same settings compute the same)
_traced: dict[str, TracedActivation] = {}


def handle_of(method: RolloutRecovery) -> str:
    """The settings that fix what ``method``'s activation computes, as one string."""
    return json.dumps({"recovery": Recovery(method.name, method.config).to_dict(),
                       "activations": str(method.act_format),
                       "weights": str(method.weight_format),
                       "in_features": method.in_features, "seed": method.seed},
                      sort_keys=True)


def _entry(handle: str) -> TracedActivation:
    try:
        return _traced[handle]
    except KeyError:
        raise RuntimeError(f"fp4rl::rollout_activation: no layer of this process has the "
                           f"recovery settings {handle}") from None


@torch.library.custom_op("fp4rl::rollout_activation", mutates_args=())
def _rollout_activation(x: torch.Tensor, handle: str, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation operands of ``x`` (tokens, in) in ``dtype`` (exact: every operand
    value is a format value), stacked along the rows, and each operand's scale per token,
    ``(terms, tokens)`` (a per-tensor scale repeated; 1 where an operand has none): the
    same factor on each row of the product, so the same bits."""
    terms = _entry(handle).method.activation(x, dtype)
    values = stack_rows([t.values.to(dtype) for t in terms])
    if values.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        values = values.clone()  # an operator's output may not alias its input
    rows = x.shape[0]
    one = torch.ones((1,), dtype=torch.float32, device=x.device)
    scales = torch.stack([(one if t.scale is None else t.scale.float().reshape(-1))
                          .expand(rows) for t in terms])
    return values, scales


@_rollout_activation.register_fake
def _(x: torch.Tensor, handle: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    terms = len(_entry(handle).scales[dtype])
    return (x.new_empty((terms * x.shape[0], x.shape[1]), dtype=dtype),
            x.new_empty((terms, x.shape[0]), dtype=torch.float32))


@torch.library.custom_op("fp4rl::rollout_activation_nm", mutates_args=())
def _rollout_activation_nm(x: torch.Tensor, handle: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bf16 activation operands of ``x`` for the packed GEMM where the method keeps its
    second term n:m sparse (:meth:`~fp4rl.recovery.base.RolloutRecovery.packed_activation`):
    the first term's values, the second's kept values and bits (no scales)."""
    terms = _entry(handle).method.packed_activation(x, torch.bfloat16)
    first, second = terms
    if not isinstance(second, NMOperand) or first.scale is not None:
        raise RuntimeError("fp4rl::rollout_activation_nm: the method gave no n:m term")
    return first.values, second.values, second.bits


@_rollout_activation_nm.register_fake
def _(x: torch.Tensor, handle: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nm = _entry(handle).method.packed_nm(x.device)
    assert nm is not None  # the caller asked the method
    keep, group = nm
    groups = -(-x.shape[1] // group)
    return (x.new_empty(x.shape, dtype=torch.bfloat16),
            x.new_empty((x.shape[0], groups * keep), dtype=torch.bfloat16),
            x.new_empty((x.shape[0], groups), dtype=torch.uint8))


class TracedActivation:
    """``method.activation`` through the operator: the same operands, values in the
    compute dtype. What a call reads in Python is fixed by the method, so a trace holds
    constants only."""

    def __init__(self, method: RolloutRecovery) -> None:
        if not method.serves_in_engines:
            raise ValueError(f"recovery method {method.name!r} keeps state between calls: "
                             "its settings do not fix its activation, so it cannot trace")
        self.method = method
        #: per compute dtype, whether each operand carries a per-tensor scale
        self.scales = {dtype: method.activation_scales(dtype) for dtype in _DTYPES}
        self.handle = handle_of(method)
        _traced.setdefault(self.handle, self)

    def __call__(self, x: torch.Tensor, dtype: torch.dtype, packed: bool = False
                 ) -> list[Operand | NMOperand]:
        """The operands of ``x`` in ``dtype``; ``packed``: for a store whose GEMM takes an
        n:m term as it is (:meth:`~fp4rl.rollout.vllm.stores.WeightStore.takes_nm`), the
        method's packed operands (ResQ's residual kept n:m sparse, in fewer bytes)."""
        if self.method.act_format is UNQUANTIZED:  # plain tensor code: traces as it is
            return list(self.method.activation(x, dtype))
        nm = self.method.packed_nm(x.device) if packed and dtype == torch.bfloat16 else None
        if nm is not None:
            first, kept, bits = torch.ops.fp4rl.rollout_activation_nm(x, self.handle)
            return [Operand(first), NMOperand(kept, bits, nm[0], nm[1], x.shape[1])]
        values, scales = torch.ops.fp4rl.rollout_activation(x, self.handle, dtype)
        rows = x.shape[0]
        return [Operand(values[i * rows:(i + 1) * rows], scales[i, :, None] if scaled else None)
                for i, scaled in enumerate(self.scales[dtype])]


__all__ = ["TracedActivation", "handle_of"]
