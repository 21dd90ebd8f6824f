"""Live migration: move units between pipeline ranks between optimizer steps, without loss.

A unit that changes owner travels from one of its old owners to each new owner: its parameters and
buffers, their gradients (inside a gradient-accumulation window), and the optimizer's per-parameter state
(for any ``torch.optim`` optimizer: AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's momentum).
The receiving rank materializes real parameters and puts them in place of its meta ones, in the
module and in the optimizer (same position in ``param_groups``, so the optimizer is not re-created
and its indices stay those of the single-process optimizer); the sending rank, if it no longer owns
the unit, puts meta parameters back and drops their state. Shared tensors (used by several units)
move as pieces of their own (``UnitLayout.pieces``): each rank that newly needs one gets a copy, and
a rank that still holds one is never overwritten. The same mechanism moves tensors when the layout
itself changes (units by use, after the first step was observed).

Every rank derives the same list of transfers from the old and new ownership and walks it in the
same order, each transfer a blocking send/receive pair, so the exchange cannot deadlock.
Data-parallel replicas migrate in their own pipelines with identical data and stay identical.
Payloads are pickled per (unit, destination) with ``send_object_list``: simple and general
(optimizer state of any shape); a raw-tensor path is left for when migration cost matters on GPUs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.model.units import UnitLayout
from lightning_pipe.runtime._torch_compat import tensor_registries


@dataclass(frozen=True)
class Transfer:
    """Tensors ``names`` move from pipeline rank ``source`` to pipeline rank ``destination``."""

    names: tuple[str, ...]
    source: int
    destination: int


@dataclass(frozen=True)
class MigrationReport:
    """What one migration moved on this rank.

    Attributes:
        transfers: all transfers of the pipeline (identical on every rank).
        bytes_sent: bytes of tensors this rank sent.
        bytes_received: bytes of tensors this rank received.
        seconds: wall time this rank spent in the migration.
    """

    transfers: tuple[Transfer, ...]
    bytes_sent: int
    bytes_received: int
    seconds: float


def holders_of(layout: UnitLayout, unit_owners: list[set[int]]) -> dict[str, frozenset[int]]:
    """Per tensor name of ``layout``'s pieces, the pipeline ranks that hold it.

    Args:
        layout: which units need which tensors.
        unit_owners: per unit, the pipeline ranks running it.
    """
    holders = {}
    for names, units in layout.pieces():
        ranks = frozenset().union(*(unit_owners[u] for u in units))
        for name in names:
            holders[name] = ranks
    return holders


def plan_transfers(old_holders: dict[str, frozenset[int]], new_holders: dict[str, frozenset[int]]) -> list[Transfer]:
    """The transfers that give every tensor its new holders, in one global order.

    A tensor goes to each new holder that does not hold it yet, from its lowest old holder (copies
    are equal); holders that keep it are never overwritten. Tensors with the same source and
    destination travel together.
    """
    grouped: dict[tuple[int, int], list[str]] = {}
    for name, new in new_holders.items():
        old = old_holders.get(name) or new
        for destination in sorted(new - old):
            grouped.setdefault((min(old), destination), []).append(name)
    return [Transfer(tuple(names), source, destination) for (source, destination), names in sorted(grouped.items())]


def _tensor_bytes(value: object) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


class _ParameterIndex:
    """Where each parameter object is referenced: module registries and optimizer groups."""

    def __init__(self, root: nn.Module, optimizers: list[Optimizer]) -> None:
        self.root = root
        self.optimizers = optimizers
        self.by_name = dict(root.named_parameters(remove_duplicate=False))
        self.by_name.update(root.named_buffers(remove_duplicate=False))

    def replace(self, old: Tensor, new: Tensor, state: dict | None) -> None:
        """Put ``new`` wherever ``old`` is referenced; move or drop its optimizer state."""
        for module in self.root.modules():
            for registry in tensor_registries(module):
                for key, value in registry.items():
                    if value is old:
                        registry[key] = new
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [new if p is old else p for p in group["params"]]
            optimizer.state.pop(old, None)
            if state:
                optimizer.state[new] = state
        for name, value in self.by_name.items():
            if value is old:
                self.by_name[name] = new

    def state_of(self, param: nn.Parameter) -> dict:
        for optimizer in self.optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        return {}


def migrate(
    root: nn.Module,
    transfers: list[Transfer],
    keep_names: set[str],
    pipeline_rank: int,
    pipeline_ranks: list[int],
    group: dist.ProcessGroup | None,
    optimizers: list[Optimizer],
    device: torch.device,
) -> MigrationReport:
    """Execute ``transfers`` (from :func:`plan_transfers`) on this rank.

    Args:
        root: the user's module, sharded.
        transfers: the pipeline's transfers, identical on every rank.
        keep_names: tensor names this rank holds after the migration (aliases included); the
            others it holds become meta.
        pipeline_rank: this rank's position in the pipeline.
        pipeline_ranks: global rank of every pipeline rank.
        group: the pipeline's process group.
        optimizers: the optimizers holding the module's parameters.
        device: where received tensors go.
    """
    start = time.perf_counter()
    index = _ParameterIndex(root, optimizers)
    sent = received = 0
    for transfer in transfers:
        if transfer.source == pipeline_rank:
            payload = {}
            for name in transfer.names:
                tensor = index.by_name[name]
                payload[name] = {
                    "data": tensor.detach().cpu(),
                    "grad": None if tensor.grad is None else tensor.grad.detach().cpu(),
                    "state": {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in index.state_of(tensor).items()},
                }
            sent += _tensor_bytes(payload)
            dist.send_object_list([payload], dst=pipeline_ranks[transfer.destination], group=group)
        elif transfer.destination == pipeline_rank:
            box = [None]
            dist.recv_object_list(box, src=pipeline_ranks[transfer.source], group=group)
            payload = box[0]
            received += _tensor_bytes(payload)
            for name, entry in payload.items():
                old = index.by_name[name]
                new = entry["data"].to(device)
                if isinstance(old, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=old.requires_grad)
                    if entry["grad"] is not None:
                        new.grad = entry["grad"].to(device)
                state = {k: v.to(device) if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in entry["state"].items()}
                index.replace(old, new, state)
    _drop_released(keep_names, index)
    return MigrationReport(tuple(transfers), sent, received, time.perf_counter() - start)


def _drop_released(keep: set[str], index: _ParameterIndex) -> None:
    for name, tensor in list(index.by_name.items()):
        if name not in keep and not tensor.is_meta:
            meta = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
            index.replace(tensor, meta, None)
