"""Collectives the strategy needs around a pipeline step: gradients, norms, results, full state."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _flat_all_reduce(tensors: list[Tensor], group: dist.ProcessGroup, op: dist.ReduceOp, scale: float = 1.0) -> None:
    """All-reduce tensors in place through one flat buffer per dtype (one message, not one per tensor)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=op, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def average_gradients(parameters: list[Tensor], group: dist.ProcessGroup, group_size: int) -> None:
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
        _flat_all_reduce(grads, group, dist.ReduceOp.SUM, scale=1.0 / group_size)


def sum_tied_gradients(parameters: list[Tensor], group: dist.ProcessGroup) -> None:
    """Sum the gradients of tied parameters held by both ends of the pipeline."""
    grads = []
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if grads:
        _flat_all_reduce(grads, group, dist.ReduceOp.SUM)


def global_norm(local_squared_sum: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Square root of the sum over the pipeline of each rank's squared gradient norm."""
    total = local_squared_sum.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup) -> Any:
    """Broadcast a picklable object from global rank ``src`` to every rank of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj: Any, dst: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Gather one picklable object per rank of ``group`` on global rank ``dst`` (None elsewhere)."""
    boxes = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, boxes, dst=dst, group=group)
    return boxes


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """One picklable object per rank of ``group`` (None: every process), on every rank, in rank order."""
    boxes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(boxes, obj, group=group)
    return boxes
