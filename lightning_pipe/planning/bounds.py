"""Lower bounds on a program's simulated step time and memory that are linear in stage costs.

These make :func:`~lightning_pipe.planning.partition.plan_partition` exact without simulating every
partition. The idea: a program fixes *which* action waits on which (program order on a rank, a
receive on its send); only durations depend on the partition. So any chain of actions, each waiting
on the previous one, gives ``makespan >= sum of the chain's durations`` for *every* partition, and
that sum is a sum over stages of what the chain does on each stage: a function of one stage's block
range at a time. Two kinds of chain are used:

- a rank's whole action list (its busy time), valid for any program;
- the simulator's critical path of a partition already simulated (tight for that partition and
  usually close for its neighbours).

Peak memory needs no bound: the simulator counts static bytes plus saved activations alive, and
which (stage, microbatch) pairs are alive after each action depends on the program order only, so
:class:`ProgramAnalysis` computes the simulator's peak memory exactly from stage costs.

Pure numpy; the accounting of :func:`lightning_pipe.schedules.simulate` (sends take no time, a
receive ends no earlier than its send plus the transfer time), with durations and memory read from
the one table of :mod:`lightning_pipe.schedules.action_rules` (``I`` and ``W`` cost their shares of a ``B``:
chains count them apart, and :meth:`Chain.backward_counts` prices them with a ``SplitBackward``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_pipe.schedules.action_rules import ACTION_RULES, backward_share, instruction_seconds, saves_again
from lightning_pipe.schedules.costs import SplitBackward
from lightning_pipe.schedules.ir import Action, ActionType, Program

_SEND_TO_RECV = {ActionType.SEND_F: (ActionType.RECV_F, +1), ActionType.SEND_B: (ActionType.RECV_B, -1)}


@dataclass(frozen=True)
class Chain:
    """How often a chain of actions runs each (stage, microbatch) piece of work.

    Attributes:
        forward: ``[stage, microbatch]`` count of forwards (and recomputes, which cost a forward).
        backward: ``[kind, stage, microbatch]`` count of backward actions, kind 0 ``B``, 1 ``I``, 2 ``W``
            (priced by :meth:`backward_counts`).
        transfer: ``[stage, microbatch]`` count of transfers across the boundary after ``stage``.
        constant: seconds of actions whose cost does not depend on the partition.
    """

    forward: np.ndarray
    backward: np.ndarray
    transfer: np.ndarray
    constant: float = 0.0

    def backward_counts(self, split: SplitBackward | None = None) -> np.ndarray:
        """``[stage, microbatch]`` full backwards the chain lasts: a ``B`` counts 1, ``I`` and ``W`` their
        shares under ``split`` (None: half each)."""
        stages = range(self.backward.shape[1])
        shares = [
            [backward_share(kind, s, split) for s in stages]
            for kind in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)
        ]
        return np.einsum("ks,ksm->sm", np.array(shares), self.backward)


_BACKWARD_KIND = {ActionType.BACKWARD: 0, ActionType.BACKWARD_INPUT: 1, ActionType.BACKWARD_WEIGHT: 2}


def _empty_chain(program: Program) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shape = (program.num_stages, program.num_microbatches)
    return np.zeros(shape), np.zeros((3, *shape)), np.zeros(shape)


def _charge(action: Action, forward: np.ndarray, backward: np.ndarray) -> None:
    rule, s, mb = ACTION_RULES[action.type], action.stage, action.microbatch
    if rule.forward_share:
        forward[s, mb] += rule.forward_share
    if rule.backward_share:
        backward[_BACKWARD_KIND[action.type], s, mb] += 1


def _backward_kinds(program: Program) -> dict[tuple[int, int | None], ActionType]:
    return {(a.stage, a.microbatch): a.type for acts in program.actions for a in acts if a.type.is_backward}


def _add_tail(program: Program, kinds: dict, last: Action, backward: np.ndarray, transfer: np.ndarray) -> None:
    """Backwards of ``last``'s microbatch on the stages before it, which must follow ``last``."""
    if not last.type.is_backward:
        return
    for s in range(last.stage - 1, -1, -1):
        kind = kinds.get((s, last.microbatch))
        if kind is None:
            return
        backward[_BACKWARD_KIND[kind], s, last.microbatch] += 1
        if program.rank_of(s) != program.rank_of(s + 1):
            transfer[s, last.microbatch] += 1


def rank_chain(program: Program, rank: int) -> Chain:
    """All of ``rank``'s actions in program order, with the work that must precede and follow them.

    Before the rank's first action, a forward ``F(s, m)``, the forwards of ``m`` on stages
    ``0 .. s - 1`` must run; after its last action, a backward of ``(s, m)``, the backwards of ``m``
    on stages ``s - 1 .. 0`` must still run. A valid bound for any partition: busy time plus the
    pipeline fill and drain this rank cannot hide.
    """
    forward, backward, transfer = _empty_chain(program)
    constant = 0.0
    actions = program.actions[rank]
    for action in actions:
        _charge(action, forward, backward)
        constant += instruction_seconds(action)
    compute = [a for a in actions if a.type.is_compute]
    if compute and compute[0].type is ActionType.FORWARD:
        first = compute[0]
        for s in range(first.stage - 1, -1, -1):
            forward[s, first.microbatch] += 1
            if program.rank_of(s) != program.rank_of(s + 1):
                transfer[s, first.microbatch] += 1
    if compute:
        _add_tail(program, _backward_kinds(program), compute[-1], backward, transfer)
    return Chain(forward, backward, transfer, constant)


def path_chain(program: Program, path: Sequence[Action]) -> Chain:
    """The chain of a path of actions, each waiting on the previous one (a simulator critical path).

    A receive that follows its own send on the path adds the transfer time of that boundary; any
    other link is program order on one rank and adds nothing.
    """
    forward, backward, transfer = _empty_chain(program)
    constant = 0.0
    previous: Action | None = None
    for action in path:
        _charge(action, forward, backward)
        constant += instruction_seconds(action)
        if previous is not None and previous.type in _SEND_TO_RECV:
            receive, step = _SEND_TO_RECV[previous.type]
            if (
                action.type is receive
                and action.stage == previous.stage + step
                and action.microbatch == previous.microbatch
            ):
                transfer[min(previous.stage, action.stage), action.microbatch] += 1
        previous = action
    return Chain(forward, backward, transfer, constant)


@dataclass(frozen=True)
class ProgramAnalysis:
    """What the partition search needs to know about a program, computed once per program.

    Attributes:
        program: the program.
        rank_chains: one :func:`rank_chain` per rank.
        alive: per rank, a 0/1 matrix ``[moment, stage, microbatch]``: which saved activations are
            alive after each action that changes them (the simulator's memory accounting).
    """

    program: Program
    rank_chains: tuple[Chain, ...]
    alive: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, program: Program) -> ProgramAnalysis:
        """Analyse ``program``."""
        return cls(
            program=program,
            rank_chains=tuple(rank_chain(program, r) for r in range(program.num_ranks)),
            alive=tuple(_alive_moments(program, r) for r in range(program.num_ranks)),
        )

    def peak_memory(self, rank: int, saved: np.ndarray, static: np.ndarray) -> float:
        """Peak bytes of ``rank`` exactly as the simulator counts them.

        Args:
            rank: pipeline rank.
            saved: saved activation bytes ``[stage, microbatch]``.
            static: static bytes ``[stage]``.
        """
        stages = list(self.program.stages_of(rank))
        moments = self.alive[rank]
        activations = float(np.einsum("tsm,sm->t", moments, saved).max()) if moments.size else 0.0
        return float(static[stages].sum()) + max(activations, 0.0)


def _alive_moments(program: Program, rank: int) -> np.ndarray:
    """0/1 ``[moment, stage, microbatch]`` of alive saved activations after each change (see simulate)."""
    actions = program.actions[rank]
    training = any(a.type.is_backward for acts in program.actions for a in acts)
    recomputed = {(a.stage, a.microbatch) for a in actions if saves_again(a.type)}
    current = np.zeros((program.num_stages, program.num_microbatches))
    held: set[tuple[int, int]] = set()
    offloaded: set[tuple[int, int]] = set()
    moments = []
    for a in actions:
        key = (a.stage, a.microbatch)
        if a.microbatch is None:
            continue
        rule = ACTION_RULES[a.type]
        if rule.saves and (not rule.starts_pair or (training and key not in recomputed)):
            held.add(key)
        elif rule.frees:
            held.discard(key)
        elif rule.offloads and key in held:
            held.discard(key)
            offloaded.add(key)
        elif rule.reloads and key in offloaded:
            offloaded.discard(key)
            held.add(key)
        else:
            continue
        current[:] = 0.0
        for s, mb in held:
            current[s, mb] = 1.0
        moments.append(current.copy())
    if not moments:
        return np.zeros((0, program.num_stages, program.num_microbatches))
    return np.unique(np.stack(moments), axis=0)
