"""Collectives the strategy needs around a pipeline step: gradients, norms, results, full state.

Each is bounded by its group's timeout (the strategy's ``timeout``); a failure raises
:class:`~lightning_pipe.runtime.failures.CollectiveFailure` naming the operation and the other ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.runtime.failures import naming_failures


def _flat_all_reduce(
    tensors: list[Tensor], group: dist.ProcessGroup, op: dist.ReduceOp, operation: str, scale: float = 1.0
) -> None:
    """All-reduce tensors in place through one flat buffer per dtype (one message, not one per tensor)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        with naming_failures(operation, group):
            dist.all_reduce(flat, op=op, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def average_gradients(
    parameters: list[Tensor], group: dist.ProcessGroup, group_size: int,
    operation: str = "the gradient average over data-parallel replicas",
) -> None:
    """Average the gradients of ``parameters`` over the data-parallel replicas of their stage.

    Parameters without a gradient (unused in this step) get a zero gradient first, on every
    replica alike, so the flat buffers line up.
    """
    if group_size == 1:
        return
    grads = []
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if grads:
        _flat_all_reduce(grads, group, dist.ReduceOp.SUM, operation, scale=1.0 / group_size)


def sum_tied_gradients(parameters: list[Tensor], group: dist.ProcessGroup) -> None:
    """Sum the gradients of tied parameters held by both ends of the pipeline."""
    grads = []
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if grads:
        _flat_all_reduce(grads, group, dist.ReduceOp.SUM, "the sum of tied gradients between the pipeline's ends")


def global_norm(local_squared_sum: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Square root of the sum over the pipeline of each rank's squared gradient norm."""
    total = local_squared_sum.clone()
    with naming_failures("the global gradient norm over the pipeline", group):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup, operation: str | None = None) -> Any:
    """Broadcast a picklable object from global rank ``src`` to every rank of ``group``.

    ``operation`` names it in errors (default: "a broadcast from rank ``src``").
    """
    box = [obj]
    with naming_failures(operation or f"a broadcast from rank {src}", group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj: Any, dst: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Gather one picklable object per rank of ``group`` on global rank ``dst`` (None elsewhere)."""
    boxes = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    with naming_failures(f"a gather on rank {dst}", group):
        dist.gather_object(obj, boxes, dst=dst, group=group)
    return boxes


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """One picklable object per rank of ``group`` (None: every process), on every rank, in rank order."""
    boxes: list[Any] = [None] * dist.get_world_size(group)
    with naming_failures("an all-gather", group):
        dist.all_gather_object(boxes, obj, group=group)
    return boxes
