"""Collectives the strategy needs around a pipeline step: gradients, norms, results, full state.

Each is bounded by its group's timeout (the strategy's ``timeout``); a failure raises
:class:`~lightning_pipe.runtime.failures.CollectiveFailure` naming the operation and the other ranks.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
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
    """Average the gradients of ``parameters`` over the data-parallel replicas of their stage."""
    if group_size > 1:
        reduce_gradients(parameters, group, operation, scale=1.0 / group_size)


def reduce_gradients(parameters: Sequence[Tensor], group: dist.ProcessGroup, operation: str, scale: float = 1.0) -> None:
    """Sum the gradients of ``parameters`` over ``group``, times ``scale``, in place.

    A parameter without a gradient on some ranks takes part with zeros, so the flat buffers line up;
    one that no rank has a gradient for stays without one, as on one device, where the optimizer
    skips it (a zero gradient would let AdamW's weight decay and moments move it).
    """
    if not parameters:
        return
    present = torch.tensor([float(p.grad is not None) for p in parameters], dtype=torch.float64)
    present = present.to(parameters[0].device)
    with naming_failures(operation, group):
        dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
    grads = []
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    _flat_all_reduce(grads, group, dist.ReduceOp.SUM, operation, scale=scale)
    for p, count in zip(parameters, present.tolist(), strict=True):
        if count == 0:
            p.grad = None


def sum_shared_gradients(
    shared: list[tuple[Tensor | None, tuple[int, ...]]],
    pipeline_rank: int,
    pipeline_ranks: list[int],
    group: dist.ProcessGroup,
) -> None:
    """Sum the gradients of tensors held by several pipeline ranks, so every holder has the total.

    Args:
        shared: per shared tensor, in one order on every rank: this rank's real parameter (None
            where it holds none) and the pipeline ranks holding it (sorted).
        pipeline_rank: this rank's position in the pipeline.
        pipeline_ranks: global rank of every pipeline rank.
        group: the pipeline's process group.

    Tensors with the same holders travel in one flat buffer per dtype. The lowest holder receives the
    others' buffers in rank order, adds them, and sends the sum back: every holder walks the holder
    sets in the same order, so the exchanges cannot deadlock, and no rank outside a set takes part
    (a middle stage never allocates the embedding's gradient).
    """
    by_holders: dict[tuple[int, ...], list[Tensor]] = {}
    for param, holders in shared:
        if len(holders) > 1 and pipeline_rank in holders:
            assert param is not None and not param.is_meta, "a holder must hold the tensor for real"
            by_holders.setdefault(tuple(holders), []).append(param)
    for holders in sorted(by_holders):
        params = by_holders[holders]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            if flat.is_cuda and dist.get_backend(group) == "gloo":  # gloo has no point-to-point for CUDA tensors
                flat = flat.cpu()
            lowest = holders[0]
            with naming_failures(f"the sum of shared gradients among pipeline ranks {list(holders)}", group):
                if pipeline_rank == lowest:
                    incoming = torch.empty_like(flat)
                    for other in holders[1:]:
                        dist.recv(incoming, src=pipeline_ranks[other], group=group)
                        flat += incoming
                    for other in holders[1:]:
                        dist.send(flat, dst=pipeline_ranks[other], group=group)
                else:
                    dist.send(flat, dst=pipeline_ranks[lowest], group=group)
                    dist.recv(flat, src=pipeline_ranks[lowest], group=group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()


def global_norm(local_squared_sum: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Square root of the sum over the pipeline of each rank's squared gradient norm."""
    total = local_squared_sum.clone()
    with naming_failures("the global gradient norm over the pipeline", group):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


class _CompactPickler(pickle.Pickler):
    """Pickles plain CPU tensors as their raw bytes.

    torch pickles a tensor by saving its storage in torch.save's zip format, about half a
    millisecond per tensor each way; a step's loss and logged values are a few small tensors, and
    that cost was about 1% of a CPU step. Tensors that need more (autograd, other devices, sparse or
    quantized layouts, subclasses) keep torch's own reduction.
    """

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is Tensor and obj.device.type == "cpu" and obj.layout is torch.strided
            and not obj.requires_grad and not obj.is_quantized and not obj.is_complex()
        ):
            raw = obj.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            return _tensor_from_bytes, (raw, obj.dtype, tuple(obj.shape))
        return NotImplemented


def _tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CompactPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup, operation: str | None = None) -> Any:
    """Broadcast a picklable object from global rank ``src`` to every rank of ``group``.

    ``operation`` names it in errors (default: "a broadcast from rank ``src``").
    """
    box = [_dumps(obj) if dist.get_rank() == src else None]
    with naming_failures(operation or f"a broadcast from rank {src}", group):
        dist.broadcast_object_list(box, src=src, group=group)
    return pickle.loads(box[0])


def gather_objects(obj: Any, dst: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Gather one picklable object per rank of ``group`` on global rank ``dst`` (None elsewhere)."""
    boxes = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    with naming_failures(f"a gather on rank {dst}", group):
        dist.gather_object(_dumps(obj), boxes, dst=dst, group=group)
    return None if boxes is None else [pickle.loads(box) for box in boxes]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """One picklable object per rank of ``group`` (None: every process), on every rank, in rank order."""
    boxes: list[Any] = [None] * dist.get_world_size(group)
    with naming_failures("an all-gather", group):
        dist.all_gather_object(boxes, _dumps(obj), group=group)
    return [pickle.loads(box) for box in boxes]


def is_initialized() -> bool:
    """Whether torch.distributed is built in and its default process group exists (a one-process run
    has none: collectives are then skipped by their callers)."""
    return dist.is_available() and dist.is_initialized()


def barrier(group: dist.ProcessGroup | None = None, operation: str | None = None) -> None:
    """Wait until every rank of ``group`` (None: every process) arrives.

    ``operation`` names the barrier in a :class:`~lightning_pipe.runtime.failures.CollectiveFailure`;
    without it the barrier's own error propagates unchanged.
    """
    if operation is None:
        dist.barrier(group=group)
        return
    with naming_failures(operation, group):
        dist.barrier(group=group)


def all_reduce_tensor(tensor: Tensor, op: str, operation: str, group: dist.ProcessGroup | None = None) -> Tensor:
    """All-reduce ``tensor`` in place over ``group`` (None: every process) and return it.

    Args:
        tensor: a small tensor (a vote, a flag).
        op: ``"sum"`` or ``"max"``.
        operation: what the reduction is, for the error message of a failure.
        group: the process group.
    """
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    with naming_failures(operation, group):
        dist.all_reduce(tensor, op=reduce_op, group=group)
    return tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (None: every process)."""
    return dist.get_world_size(group)
