"""Run a zero-bubble pair's ``I`` and ``W`` as one ``B`` where splitting buys nothing.

A zero-bubble family splits every backward so that some ``W`` can be deferred into what would be a
bubble. Most of its ``W`` are not deferred at all: the program runs them right after their ``I``, or
after nothing but the sends that ``I``'s gradient feeds. Split, such a pair costs more than one full
backward: measured on CPU, a 2-block GPT stage's ``I + W`` is 1.14-1.24x its ``B``, because
``W``'s products read back the gradients and activations that ``B`` would use at once
(``docs/schedules.md``). Merged, the pair runs as one ``B`` at ``I``'s place and its sends leave after
it, later by ``W``'s time, which matters only where the receiving rank waits for them.

:func:`merge_split_backwards` decides which of the pairs whose ``W`` follows its ``I`` with only sends
between to merge, with the simulator (two greedy searches, see there). The result is never slower than
the program it started from under the same costs (checked), and holds no more memory (a merged pair
frees its activations at ``B``, not at ``W``). :func:`merged_program` is the decision for a family under
uniform microbatch costs: what the strategy runs and the planners price. The merge changes only the
order of work on one rank, never a message: every rank may run a merged or unmerged program against any
other, and gradients are the same sums either way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection

from .costs import ActionCosts, SplitBackward
from .ir import Action, ActionType, Program
from .registry import Schedule
from .simulate import simulate
from .validate import validate

__all__ = ["mergeable_pairs", "merge_backward_pairs", "merge_split_backwards", "merge_decision_costs", "merged_program",
           "merged_if_split", "measured_merge_costs"]

_I, _W, _B = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT, ActionType.BACKWARD
_SENDS = frozenset({ActionType.SEND_F, ActionType.SEND_B})

Pair = tuple[int, int]
"""``(stage, microbatch)``."""
Makespan = Callable[[Collection[Pair]], float]
"""The simulated step with a set of pairs merged."""


def mergeable_pairs(program: Program) -> tuple[Pair, ...]:
    """The pairs whose ``W`` its rank runs right after their ``I``, with at most sends between them.

    Only sends may sit between: running ``W`` before a receive or another compute action would change
    what the rank does meanwhile, which is a different schedule, not a merge.
    """
    pairs = []
    for actions in program.actions:
        for i, action in enumerate(actions):
            if action.type is not _I:
                continue
            j = i + 1
            while j < len(actions) and actions[j].type in _SENDS:
                j += 1
            if j < len(actions) and actions[j] == Action(action.stage, _W, action.microbatch):
                pairs.append((action.stage, action.microbatch))
    return tuple(pairs)


def merge_backward_pairs(program: Program, pairs: Collection[Pair]) -> Program:
    """``program`` with each of ``pairs`` run as one ``B`` where its ``I`` was (its ``W`` removed).

    Raises:
        ValueError: if a pair is not in :func:`mergeable_pairs`.
    """
    chosen = set(pairs)
    unknown = chosen - set(mergeable_pairs(program))
    if unknown:
        raise ValueError(
            f"Cannot merge {sorted(unknown)}: only pairs whose W follows their I with at most sends between can be "
            "merged into one B."
        )
    return validate(_merged(program, chosen)) if chosen else program


def _merged(program: Program, chosen: Collection[Pair]) -> Program:
    """The merge itself, unchecked (the searches simulate many; what they return is validated)."""
    actions = tuple(
        tuple(
            Action(a.stage, _B, a.microbatch) if a.type is _I and (a.stage, a.microbatch) in chosen else a
            for a in row
            if not (a.type is _W and (a.stage, a.microbatch) in chosen)
        )
        for row in program.actions
    )
    return dataclasses.replace(program, actions=actions)


def merge_decision_costs(program: Program, split: SplitBackward | None = None) -> ActionCosts:
    """Uniform costs for deciding merges of ``program``: ``F`` 1 and ``B`` 2 per stage, ``I`` and ``W``
    priced by ``split``'s shares (default :class:`SplitBackward`'s ideal halves, under which a merge
    wins only where it delays nothing on the critical path)."""
    split = split or SplitBackward()
    costs = ActionCosts.uniform(program.num_stages, program.num_microbatches, forward=1.0, backward=2.0)
    stages = range(program.num_stages)
    rows = [split.shares(s) for s in stages]
    per_microbatch = program.num_microbatches

    def table(index: int) -> tuple[tuple[float, ...], ...]:
        return tuple((2.0 * rows[s][index],) * per_microbatch for s in stages)

    return dataclasses.replace(costs, backward_input=table(0), backward_weight=table(1))


def measured_merge_costs(
    program: Program,
    forward: dict[int, float],
    backward: dict[int, float],
    input_gradient: dict[int, float],
    weight_gradient: dict[int, float],
) -> ActionCosts | None:
    """Costs for deciding ``program``'s merges from what its stages measured (seconds per action, by stage).

    :func:`merge_decision_costs` prices every stage alike and the split at ideal halves, which is all a
    program built before the first step can know; a step measures more: the first and last stages carry
    the embeddings and the head, and a split costs more than one ``B`` (``docs/schedules.md``). The split's
    shares come from the stages that ran both kinds (:meth:`SplitBackward.measured`); a stage that ran
    only split pairs is priced at its ``I + W`` over those shares. Microbatches cost alike (fixed shapes;
    with varying lengths the measurements are typical values).

    Returns:
        Per-stage costs, or None when they cannot be priced: a stage without a forward or a backward
        measured, or no stage after the first that ran both a whole ``B`` and a split pair.
    """
    stages = range(program.num_stages)
    both = [s for s in stages if s > 0 and s in backward and s in input_gradient and s in weight_gradient]
    if not both or any(s not in forward for s in stages):
        return None
    split = SplitBackward.measured(
        sum(input_gradient[s] for s in both), sum(weight_gradient[s] for s in both), sum(backward[s] for s in both)
    )
    full = {}
    for s in stages:
        if s in backward:
            full[s] = backward[s]
        elif s > 0 and s in input_gradient and s in weight_gradient:
            full[s] = (input_gradient[s] + weight_gradient[s]) / sum(split.shares(s))
        else:
            return None
    m = program.num_microbatches

    def table(value: Callable[[int], float]) -> tuple[tuple[float, ...], ...]:
        return tuple((float(value(s)),) * m for s in stages)

    return ActionCosts(
        forward=table(forward.__getitem__),
        backward=table(full.__getitem__),
        backward_input=table(lambda s: split.shares(s)[0] * full[s]),
        backward_weight=table(lambda s: split.shares(s)[1] * full[s]),
        saved_bytes=table(lambda s: 1.0),
    )


def merge_split_backwards(program: Program, costs: ActionCosts | None = None) -> Program:
    """``program`` with the pairs merged into one ``B`` whose split does not make the step shorter.

    Two greedy searches over :func:`mergeable_pairs`, each simulating one pair's change at a time:
    merging from the program as it is (a merge kept when the step gets no longer) and splitting from
    every pair merged (a split kept when the step gets shorter); the shorter result wins, the one with
    more merges on a tie. Beyond :data:`PAIRWISE_LIMIT` candidates, the first search only, trying
    groups of pairs at once and halving a group that makes the step longer (deterministic, so every
    rank builds the same program).

    Args:
        program: a validated program; one without ``I`` (or with split placement) comes back as it is.
        costs: what the simulator charges; default :func:`merge_decision_costs` with ideal halves.

    Returns:
        A validated program whose simulated step under ``costs`` is no longer than ``program``'s.
    """
    if program.pair_ranks is not None or not program.splits_backward:
        return program
    costs = costs or merge_decision_costs(program)
    candidates = mergeable_pairs(program)

    def makespan(merged: Collection[Pair]) -> float:
        return simulate(_merged(program, set(merged)), costs, record_events=False).makespan

    original = makespan(())
    options = [_merge_greedily(candidates, makespan, original, pairwise=len(candidates) <= PAIRWISE_LIMIT)]
    if len(candidates) <= PAIRWISE_LIMIT:
        options.append(_split_greedily(candidates, makespan))
    time, merged = min(options, key=lambda option: (round(option[0] / original, 9), -len(option[1])))
    return merge_backward_pairs(program, merged) if time <= original * (1 + 1e-9) else program


@functools.lru_cache(maxsize=64)
def merged_program(
    schedule: Schedule, num_ranks: int, num_microbatches: int, split: SplitBackward | None = None
) -> Program:
    """``schedule``'s program with its pairs merged as :func:`merge_split_backwards` decides under
    :func:`merge_decision_costs` with ``split``: the program the strategy runs (``merge_split_backward``),
    and what a planner that prices a family for it must simulate. Cached: the decision simulates."""
    program = validate(schedule.build(num_ranks, num_microbatches))
    return merge_split_backwards(program, merge_decision_costs(program, split))


def merged_if_split(
    schedule: Schedule, num_ranks: int, num_microbatches: int, split: SplitBackward | None = None
) -> Program | None:
    """:func:`merged_program` for a family whose program splits its backward; None for one that does
    not (a planner then simulates the family as it is)."""
    if not _splits_backward(schedule, num_ranks, num_microbatches):
        return None
    return merged_program(schedule, num_ranks, num_microbatches, split)


@functools.lru_cache(maxsize=256)
def _splits_backward(schedule: Schedule, num_ranks: int, num_microbatches: int) -> bool:
    return schedule.build(num_ranks, num_microbatches).splits_backward


PAIRWISE_LIMIT = 64
"""Most candidate pairs searched one at a time (one simulation each, twice); more are searched in groups."""


def _merge_greedily(
    candidates: tuple[Pair, ...], makespan: Makespan, start: float, pairwise: bool
) -> tuple[float, set[Pair]]:
    merged: set[Pair] = set()
    best = start

    def try_merging(group: tuple[Pair, ...]) -> None:
        nonlocal best
        if (time := makespan(merged.union(group))) <= best * (1 + 1e-9):
            merged.update(group)
            best = min(best, time)
        elif len(group) > 1:
            try_merging(group[: len(group) // 2])
            try_merging(group[len(group) // 2 :])

    for group in [(pair,) for pair in candidates] if pairwise else [candidates]:
        try_merging(group)
    return best, merged


def _split_greedily(candidates: tuple[Pair, ...], makespan: Makespan) -> tuple[float, set[Pair]]:
    merged = set(candidates)
    best = makespan(merged)
    for pair in candidates:
        if (time := makespan(merged - {pair})) < best * (1 - 1e-9):
            merged.discard(pair)
            best = time
    return best, merged
