"""What live regrouping between two layouts must do, as plain data (no processes, no tensors).

The runtime side of elastic depth (docs/repartitioning.md, section 8) needs, on every rank, the same
answers to four questions; they are computed here so that they are tested without processes:

1. **Which microbatches each replica runs** (:func:`replica_microbatches`): every rank reads the
   whole batch and splits it once; replica ``r`` of a width-``w`` stage runs microbatches
   ``m % w == r``. Every microbatch passes every stage exactly once, whatever the layout, so no
   sample is repeated or skipped.
2. **Where activations go** (:func:`activation_route`): microbatch ``m`` leaves stage ``s`` from
   replica ``m % w_s`` and enters stage ``s + 1`` on replica ``m % w_{s+1}``.
3. **Which groups exist** (:func:`replica_groups`): the rank sets that all-reduce a stage's
   gradients, for every layout the planner may choose, so they can be created once, up front, in
   one order on every rank.
4. **What moves when the layout changes** (:func:`plan_regroup`): for every unit, the ranks that
   newly hold it receive its parameters and optimizer state from an old holder (replicas hold equal
   copies after a step); inside an accumulation window, the old replicas' partial gradients are
   first summed on one old holder and only one new holder keeps that total (the others start from
   zero), so the sum over the stage's replicas (what the step all-reduces) is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.planning.layout import Layout, check_layouts, unit_holders


def replica_microbatches(layout: Layout, stage: int, replica: int, num_microbatches: int) -> tuple[int, ...]:
    """Microbatches replica ``replica`` of ``stage`` runs (round robin).

    Raises:
        ValueError: if the stage or replica does not exist.
    """
    if not 0 <= stage < layout.num_stages or not 0 <= replica < layout.widths[stage]:
        raise ValueError(f"no replica {replica} of stage {stage} in {layout.describe()}.")
    return tuple(range(replica, num_microbatches, layout.widths[stage]))


def activation_route(layout: Layout, stage: int, microbatch: int) -> tuple[int, int]:
    """``(sending rank, receiving rank)`` of microbatch ``microbatch``'s activation after ``stage``.

    The gradient travels back between the same two ranks.

    Raises:
        ValueError: if ``stage`` is the last stage (nothing is sent after it).
    """
    if not 0 <= stage < layout.num_stages - 1:
        raise ValueError(f"stage {stage} of {layout.describe()} sends no activation.")
    sender = layout.devices_of_stage(stage)[layout.replica_of(stage, microbatch)]
    receiver = layout.devices_of_stage(stage + 1)[layout.replica_of(stage + 1, microbatch)]
    return sender, receiver


def replica_groups(layouts: Sequence[Layout]) -> tuple[tuple[int, ...], ...]:
    """Every rank set of two or more ranks that all-reduces a stage in one of ``layouts``.

    Sorted, without repeats: the order in which every rank creates them (group creation is a
    collective that every rank must enter in the same order).
    """
    groups = {layout.devices_of_stage(s) for layout in layouts for s in range(layout.num_stages)}
    return tuple(sorted((g for g in groups if len(g) > 1), key=lambda g: (len(g), g)))


@dataclass(frozen=True)
class UnitMove:
    """What happens to one unit when the layout changes.

    Attributes:
        unit: unit index (``pre`` is 0).
        source: the old holder that sums the partial gradients and sends (replicas hold equal
            parameters and state): the lowest one that stays a holder, else the lowest.
        destinations: new holders that did not hold the unit.
        gradient_sum: old holders whose partial gradients are summed on ``source`` first (all old
            holders; a one-element tuple means nothing to sum).
        gradient_keeper: the new holder that keeps the summed gradient; every other new holder
            starts the rest of the window from zero.
    """

    unit: int
    source: int
    destinations: tuple[int, ...]
    gradient_sum: tuple[int, ...]
    gradient_keeper: int


@dataclass(frozen=True)
class RegroupPlan:
    """Everything one layout change moves, identical on every rank.

    Attributes:
        old: the layout before.
        new: the layout after.
        moves: one entry per unit whose holders change (in unit order: the order of the messages).
    """

    old: Layout
    new: Layout
    moves: tuple[UnitMove, ...]

    def sends(self, rank: int) -> list[tuple[int, int]]:
        """``(unit, destination)`` pairs ``rank`` sends, in message order."""
        return [(m.unit, d) for m in self.moves if m.source == rank for d in m.destinations]

    def receives(self, rank: int) -> list[tuple[int, int]]:
        """``(unit, source)`` pairs ``rank`` receives, in message order."""
        return [(m.unit, m.source) for m in self.moves if rank in m.destinations]


def plan_regroup(old: Layout, new: Layout, num_blocks: int) -> RegroupPlan:
    """The moves from layout ``old`` to layout ``new`` (see the module docstring, point 4).

    The source is the lowest old holder that stays a holder (else the lowest old holder); it sums
    the old replicas' partial gradients and keeps the total when it stays, otherwise the lowest
    destination keeps it (it receives the total with the parameters), so the sum always reaches
    its keeper.

    Raises:
        ValueError: if the layouts do not cover ``num_blocks`` blocks on the same devices.
    """
    check_layouts([new], num_blocks, old.num_devices)
    check_layouts([old], num_blocks, old.num_devices)
    before, after = unit_holders(old, num_blocks), unit_holders(new, num_blocks)
    moves = []
    for unit, (was, will) in enumerate(zip(before, after, strict=True)):
        if was == will:
            continue
        staying = [rank for rank in was if rank in will]
        source = min(staying) if staying else min(was)
        destinations = tuple(d for d in will if d not in was)
        keeper = source if staying else min(destinations)
        moves.append(UnitMove(unit, source, destinations, tuple(sorted(was)), keeper))
    return RegroupPlan(old, new, tuple(moves))


def apply_gradient_moves(plan: RegroupPlan, partial: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """What :func:`plan_regroup` does to partial gradients, on numbers: ``{(unit, rank): value}``.

    The runtime does the same on tensors; this reference lets tests check that the sum of every
    unit's gradient over its holders is unchanged (the invariant that makes a regroup inside an
    accumulation window exact).
    """
    result = dict(partial)
    for move in plan.moves:
        total = sum(partial.get((move.unit, rank), 0.0) for rank in move.gradient_sum)
        for rank in move.gradient_sum:
            result.pop((move.unit, rank), None)
        for rank in plan.new.devices_of_stage(_stage_of_unit(plan.new, move.unit)):
            result[(move.unit, rank)] = total if rank == move.gradient_keeper else 0.0
    return result


def _stage_of_unit(layout: Layout, unit: int) -> int:
    if unit == 0:
        return 0
    block = unit - 1
    for stage in range(layout.num_stages):
        if block < layout.boundaries[stage + 1]:
            return stage
    return layout.num_stages - 1
