"""Tensor parallelism for the ``fp4rl`` method: each rank's share of ``Q(W)``.

With ``tensor_parallel_size`` > 1 vLLM splits a column-parallel linear (q/k/v, gate/up)
along its rows and a row-parallel one (o, down) along its inputs, and each rank's layer
holds its part. A refit and an export send whole weights; this rank's part is cut out of
them by the layer's own vLLM weight loader (the function that cuts a checkpoint's weights,
which knows q/k/v offsets and replicated KV heads), applied to ``Q(W)``'s values or to each
packed field laid out per row (:meth:`fp4rl.gemm.PackedOperand.row_fields`): block fields
run along the row in block order, so a rank's inputs are a byte range of each field,
provided no block straddles two ranks (checked when the engine is built). NVFP4's
per-tensor scale stays the whole weight's: a refit sends it, and a checkpoint load takes
the maximum over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.model_executor.utils import set_weight_attrs

from fp4rl.formats import NumberFormat, get_format
from fp4rl.gemm import Operand, PackedOperand, has_tensor_scale
from fp4rl.nn.recipe import Recipe
from fp4rl.rollout.vllm.compat import WeightLoader
from fp4rl.rollout.vllm.errors import VLLMError

Part = Operand | PackedOperand


@dataclass(frozen=True)
class Partition:
    """How vLLM split one linear over the tensor-parallel ranks: its whole and per-rank
    inputs and rows, and the layer's own weight loader (held weakly)."""

    in_features: int
    in_per_rank: int
    rows: int
    rows_per_rank: tuple[int, ...]
    loader: Callable[[], WeightLoader]
    #: vLLM's ``QKVParallelLinear``, whose loader names its parts "q", "k", "v"; every
    #: other merged linear numbers them
    qkv: bool = False

    @property
    def row_parallel(self) -> bool:
        return self.in_per_rank != self.in_features

    @property
    def split(self) -> bool:
        return self.row_parallel or sum(self.rows_per_rank) != self.rows


def check_partition(partition: Partition, recipe: Recipe) -> None:
    """Refuse, in one line, a split across which this rank's rollout would not equal its
    share of the whole layer's: a block of the weight or activation format straddling two
    ranks' inputs, NVFP4 activations (their per-tensor scale is the whole input's amax,
    which no rank sees), a ResQ sparsity pattern that is not local to a block."""
    if not partition.row_parallel:
        return
    r = recipe.rollout
    where = f"a layer ({partition.in_features} inputs, {partition.in_per_rank} a rank)"
    for fmt in dict.fromkeys((r.weights, r.activations)):
        if not isinstance(fmt, NumberFormat):
            continue
        block = fmt.block_size
        if partition.in_per_rank % block:
            ranks = partition.in_features // partition.in_per_rank
            raise VLLMError(f"tensor_parallel_size={ranks} splits {where} across {fmt}'s "
                            f"blocks of {block}: use a tensor_parallel_size dividing "
                            f"{partition.in_features // block}")
    if has_tensor_scale(r.activations):
        raise VLLMError(f"{r.activations} activations scale by the whole input's amax, which "
                        f"no rank of the row-parallel {where} sees: use "
                        "tensor_parallel_size=1, or block-scaled activations (hif4, mxfp4)")
    for pattern in r.recovery.config.patterns:
        if not pattern.local:
            raise VLLMError(f"{r.recovery.method}'s {pattern} sparsity ranks values across "
                            f"the whole input, which no rank of the row-parallel {where} "
                            "sees: use dense or n:m sparsity with tensor parallelism")


#: the shard ids of ``QKVParallelLinear``'s parts, in row order
QKV_SHARDS = ("q", "k", "v")


def shard_id(parts: int, index: int, qkv: bool = False) -> str | int | None:
    """The shard id vLLM's loader takes for part ``index`` of a layer of ``parts``: the
    part's letter for a q/k/v layer, its index for any other merged one."""
    if parts == 1:
        return None
    return QKV_SHARDS[index] if qkv else index


def rank_slice(partition: Partition, index: int, whole: torch.Tensor, width: int
               ) -> torch.Tensor:
    """This rank's share of part ``index`` of the layer, from ``whole`` (the part's rows,
    laid out per row), ``width`` columns a rank, cut by the layer's vLLM loader."""
    rows = partition.rows_per_rank
    staging = torch.nn.Parameter(whole.new_empty(sum(rows), width), requires_grad=False)
    set_weight_attrs(staging, {"output_dim": 0,
                               **({"input_dim": 1} if partition.row_parallel else {})})
    sid = shard_id(len(rows), index, partition.qkv)
    loader = partition.loader()
    if sid is None:
        loader(staging, whole)
    else:
        loader(staging, whole, sid)
    start = sum(rows[:index])
    return staging.data[start:start + rows[index]]


def rank_part(partition: Partition, index: int, part: Part) -> Part:
    """This rank's share of a whole ``Q(W)`` part (a refit's), in the same form; NVFP4's
    per-tensor scale stays the whole part's."""
    if isinstance(part, Operand):
        return Operand(rank_slice(partition, index, part.values, partition.in_per_rank),
                       part.scale)
    fields = {name: rank_slice(partition, index, value, _width(partition, value))
              for name, value in part.row_fields().items()}
    shape = (partition.rows_per_rank[index], partition.in_per_rank)
    return PackedOperand.from_row_fields(get_format(part.packed.format), shape, fields,
                                         part.scale)


def rank_field(partition: Partition, index: int, field: torch.Tensor) -> torch.Tensor:
    """This rank's share of one packed field of part ``index`` (an export's, per row)."""
    return rank_slice(partition, index, field, _width(partition, field))


def _width(partition: Partition, field: torch.Tensor) -> int:
    return field.shape[1] * partition.in_per_rank // partition.in_features


def whole_amax(amax: torch.Tensor) -> torch.Tensor:
    """The maximum of ``amax`` over the tensor-parallel ranks (a weight's per-tensor
    scale is the whole weight's, not a rank's part's)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=get_tp_group().device_group)
    return amax


__all__ = ["Partition", "check_partition", "rank_field", "rank_part", "rank_slice",
           "shard_id", "whole_amax"]
