"""Live migration: move units between pipeline ranks between optimizer steps, without loss.

A unit that changes owner travels from one of its old owners to each new owner: its parameters,
their gradients (inside a gradient-accumulation window), and the optimizer's per-parameter state
(for any ``torch.optim`` optimizer: AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's momentum).
The receiving rank materializes real parameters and puts them in place of its meta ones, in the
module and in the optimizer (same position in ``param_groups``, so the optimizer is not re-created
and its indices stay those of the single-process optimizer); the sending rank, if it no longer owns
the unit, puts meta parameters back and drops their state.

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


@dataclass(frozen=True)
class Transfer:
    """Unit ``unit`` moves from pipeline rank ``source`` to pipeline rank ``destination``."""

    unit: int
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


def plan_transfers(old_owners: list[set[int]], new_owners: list[set[int]]) -> list[Transfer]:
    """The transfers that give every unit its new owners, in one global order.

    Args:
        old_owners: per unit, the pipeline ranks holding it now.
        new_owners: per unit, the pipeline ranks that must hold it after.
    """
    transfers = []
    for unit, (old, new) in enumerate(zip(old_owners, new_owners, strict=True)):
        for destination in sorted(new - old):
            transfers.append(Transfer(unit, min(old), destination))
    return transfers


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

    def replace(self, old: nn.Parameter, new: nn.Parameter, state: dict | None) -> None:
        """Put ``new`` wherever ``old`` is referenced; move or drop its optimizer state."""
        for module in self.root.modules():
            for key, value in module._parameters.items():
                if value is old:
                    module._parameters[key] = new
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
    layout: UnitLayout,
    transfers: list[Transfer],
    keep_units: set[int],
    pipeline_rank: int,
    pipeline_ranks: list[int],
    group: dist.ProcessGroup | None,
    optimizers: list[Optimizer],
    device: torch.device,
) -> MigrationReport:
    """Execute ``transfers`` (from :func:`plan_transfers`) on this rank.

    Args:
        root: the user's module, sharded.
        layout: its units.
        transfers: the pipeline's transfers, identical on every rank.
        keep_units: units this rank owns after the migration; others it holds become meta.
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
        names = layout.unit_names[transfer.unit]
        if transfer.source == pipeline_rank:
            payload = {}
            for name in names:
                param = index.by_name[name]
                payload[name] = {
                    "data": param.detach().cpu(),
                    "grad": None if param.grad is None else param.grad.detach().cpu(),
                    "state": {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in index.state_of(param).items()},
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
                new = nn.Parameter(entry["data"].to(device), requires_grad=old.requires_grad)
                if entry["grad"] is not None:
                    new.grad = entry["grad"].to(device)
                state = {k: v.to(device) if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in entry["state"].items()}
                index.replace(old, new, state)
    _drop_released_units(layout, keep_units, index)
    return MigrationReport(tuple(transfers), sent, received, time.perf_counter() - start)


def _drop_released_units(layout: UnitLayout, keep_units: set[int], index: _ParameterIndex) -> None:
    keep = {name for unit in keep_units for name in layout.unit_names[unit]}
    for group in layout.tied:
        if keep.intersection(group):
            keep.update(group)
    for unit, names in enumerate(layout.unit_names):
        for name in names:
            param = index.by_name[name]
            if name not in keep and not param.is_meta:
                meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                index.replace(param, meta, None)
