"""Live regrouping building blocks: rank groups for every layout, and moving units between layouts.

Not wired into the strategy yet (docs/repartitioning.md, section 9.7): these functions work on
plain per-unit tensors so that the exchange itself (the part that must be exact) is tested on real
gloo processes before the executor learns heterogeneous programs.

- :func:`create_rank_groups`: every all-reduce rank set the planner may need, created once, up
  front, in one order on every rank (creating a group is a collective).
- :func:`regroup_units`: execute a regroup plan (``planning.regroup.plan_regroup``'s moves, passed
  as plain objects: this layer does not import ``planning``) on this rank: partial gradients of an
  open accumulation window are summed on the source in rank order, then parameters, optimizer state
  and the summed gradient go to each new holder; only the gradient keeper keeps the sum, the other
  holders start from zero, and ranks that no longer hold a unit drop it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class UnitMoveLike(Protocol):
    """What :func:`regroup_units` reads of a move (``planning.regroup.UnitMove``)."""

    unit: int
    source: int
    destinations: tuple[int, ...]
    gradient_sum: tuple[int, ...]
    gradient_keeper: int


@dataclass
class UnitTensors:
    """One unit's tensors on one rank.

    Attributes:
        parameters: by name.
        gradients: by name (the open window's partial sums; absent names count as zero).
        optimizer_state: by parameter name, the optimizer's per-parameter state.
    """

    parameters: dict[str, Tensor]
    gradients: dict[str, Tensor] = field(default_factory=dict)
    optimizer_state: dict[str, dict] = field(default_factory=dict)


def create_rank_groups(
    rank_sets: Iterable[Sequence[int]], timeout: timedelta | None = None
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """Create one process group per rank set, in the given order (a collective: every rank calls it).

    Args:
        rank_sets: e.g. ``planning.regroup.replica_groups(layouts)``; identical on every rank.
        timeout: the strategy's timeout for every operation of these groups.

    Returns:
        Every group by its rank tuple (a rank outside a set gets a non-member handle, as torch does).
    """
    groups = {}
    for ranks in rank_sets:
        key = tuple(int(r) for r in ranks)
        groups[key] = dist.new_group(list(key), timeout=timeout)
    return groups


def _copy(value: object) -> object:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def regroup_units(
    units: dict[int, UnitTensors],
    moves: Sequence[UnitMoveLike],
    new_holders: Mapping[int, Sequence[int]],
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> dict[int, UnitTensors]:
    """Execute ``moves`` on this rank; returns the units this rank holds afterwards.

    Every rank walks the same moves in the same order, and within a move the same message order
    (gradient partials to the source in rank order, then the source to each destination in order),
    so blocking sends and receives pair up without deadlock.

    Args:
        units: the units this rank holds now.
        moves: the plan's moves, identical on every rank.
        new_holders: for every moved unit, the ranks holding it afterwards.
        rank: this rank (global).
        group: the group the messages go through (None: the world).
    """
    result = dict(units)
    for move in moves:
        unit = move.unit
        # 1. partial gradients of the old replicas, summed on the source in rank order
        if rank == move.source:
            total = {name: grad.detach().clone() for name, grad in units[unit].gradients.items()}
            for other in move.gradient_sum:
                if other == rank:
                    continue
                box: list = [None]
                dist.recv_object_list(box, src=other, group=group)
                for name, grad in box[0].items():
                    total[name] = total[name] + grad if name in total else grad.clone()
        elif rank in move.gradient_sum:
            dist.send_object_list([units[unit].gradients], dst=move.source, group=group)
        # 2. parameters, optimizer state and the summed gradient to every new holder
        if rank == move.source:
            payload = {
                "parameters": _copy(units[unit].parameters),
                "optimizer_state": _copy(units[unit].optimizer_state),
                "gradients": total,
            }
            for destination in move.destinations:
                dist.send_object_list([payload], dst=destination, group=group)
        elif rank in move.destinations:
            box = [None]
            dist.recv_object_list(box, src=move.source, group=group)
            payload = box[0]
        # 3. who keeps what
        holders = set(new_holders[unit])
        if rank not in holders:
            result.pop(unit, None)
            continue
        if rank == move.source:
            base = units[unit]
            result[unit] = UnitTensors(base.parameters, total, base.optimizer_state)
        elif rank in move.destinations:
            result[unit] = UnitTensors(payload["parameters"], payload["gradients"], payload["optimizer_state"])
        else:  # an old holder that stays: its partial went into the sum
            result[unit] = UnitTensors(units[unit].parameters, dict(units[unit].gradients), units[unit].optimizer_state)
        if rank != move.gradient_keeper:  # the keeper is the source or a destination: it has the sum
            result[unit].gradients = {name: torch.zeros_like(grad) for name, grad in result[unit].gradients.items()}
    return result
