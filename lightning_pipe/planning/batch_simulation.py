"""The simulator's step time for many partitions at once, as numpy vector operations.

:func:`lightning_pipe.schedules.simulate` walks a program action by action in Python; pricing every
candidate partition that way costs milliseconds each. Here the same computation is "compiled" once
per program into a list of max/plus operations and run on vectors with one entry per partition, so
thousands of partitions cost about as much as a few single simulations.

Semantics are those of ``simulate`` (and tested against it): a rank runs its actions in order; a
compute action lasts its cost as :mod:`lightning_pipe.schedules.action_rules` says (``RECOMPUTE`` a
forward, ``I`` and ``W`` their shares of a backward, half each unless a measured ``SplitBackward`` is
given, a custom instruction its fixed seconds); a send takes no time; a receive ends at
``max(its start, send end + transfer time of the boundary)``. The order in which ``simulate``
appends events does not depend on durations (it sweeps ranks until each blocks on a receive), so one
run with unit costs gives a valid evaluation order for every partition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_pipe.schedules import ActionCosts, Program, SplitBackward, simulate
from lightning_pipe.schedules.action_rules import ACTION_RULES, backward_share
from lightning_pipe.schedules.ir import Action, ActionType

_SEND_TO_RECV = {ActionType.SEND_F: (ActionType.RECV_F, +1), ActionType.SEND_B: (ActionType.RECV_B, -1)}

# What an operation adds to its start time.
_NOTHING, _FORWARD, _BACKWARD, _SHARE_OF_BACKWARD, _CONSTANT = range(5)


def _operation_kind(action: Action, simulated_seconds: float) -> tuple[int, float]:
    """The operation kind of ``action`` from its row of the action-rule table, and its constant seconds
    (a custom instruction's, as the unit-cost simulation timed it)."""
    rule = ACTION_RULES[action.type]
    if rule.forward_share == 1.0 and not rule.backward_share:
        return _FORWARD, 0.0
    if rule.backward_share == 1.0 and not rule.forward_share:
        return _BACKWARD, 0.0
    if rule.backward_share and not rule.forward_share:  # I and W: their share (backward_share)
        return _SHARE_OF_BACKWARD, 0.0
    assert not (rule.forward_share or rule.backward_share), f"no operation kind for the shares of {action.type}"
    if rule.duration == "instruction" and simulated_seconds > 0:
        return _CONSTANT, simulated_seconds
    return _NOTHING, 0.0


@dataclass(frozen=True)
class Operation:
    """One action of the compiled program.

    Attributes:
        action: the action.
        previous: index of the operation before it on the same rank, or -1.
        sender: for a receive, index of its send (-1 otherwise).
        boundary: for a receive, the stage boundary the message crosses.
        kind: what the action costs (nothing, a forward, a backward, a share of a backward, a constant).
        stage: stage whose cost is charged.
        microbatch: microbatch whose cost is charged.
        seconds: for a constant-cost action (a custom instruction), its seconds.
    """

    action: Action
    previous: int
    sender: int
    boundary: int
    kind: int
    stage: int
    microbatch: int
    seconds: float = 0.0


@dataclass(frozen=True)
class CompiledProgram:
    """A program as a list of operations in an order valid for every duration.

    Attributes:
        program: the program.
        operations: one per action, dependencies first.
        last_of_rank: index of every rank's last operation (-1 for an empty rank).
    """

    program: Program
    operations: tuple[Operation, ...]
    last_of_rank: tuple[int, ...]

    @classmethod
    def of(cls, program: Program) -> CompiledProgram:
        """Compile ``program`` (runs :func:`simulate` once with unit costs for the order).

        Raises:
            ScheduleError: if the program deadlocks.
        """
        result = simulate(program, ActionCosts.uniform(program.num_stages, program.num_microbatches))
        last = [-1] * program.num_ranks
        sends: dict[tuple[ActionType, int, int | None], int] = {}
        operations = []
        for index, event in enumerate(result.events):
            action = event.action
            sender, boundary = -1, 0
            if action.type in _SEND_TO_RECV:
                receive, step = _SEND_TO_RECV[action.type]
                sends[(receive, action.stage + step, action.microbatch)] = index
            elif action.type in (ActionType.RECV_F, ActionType.RECV_B):
                sender = sends[(action.type, action.stage, action.microbatch)]
                boundary = min(action.stage, result.events[sender].action.stage)
            kind, seconds = _operation_kind(action, event.end - event.start)
            operations.append(
                Operation(
                    action, last[event.rank], sender, boundary, kind, action.stage, action.microbatch or 0, seconds
                )
            )
            last[event.rank] = index
        return cls(program, tuple(operations), tuple(last))

    def run(
        self, forward: np.ndarray, backward: np.ndarray, transfer: np.ndarray, split: SplitBackward | None = None
    ) -> BatchRun:
        """Simulate ``N`` cost assignments at once.

        Args:
            forward: forward seconds ``[stage, microbatch, N]``.
            backward: backward seconds ``[stage, microbatch, N]``.
            transfer: transfer seconds across the boundary after each stage ``[stage, microbatch, N]``.
            split: the shares of ``I`` and ``W`` (None: half each).

        Returns:
            The :class:`BatchRun`: makespans as :func:`simulate` computes them, and what is needed
            to trace each one's critical path.
        """
        count = forward.shape[-1]
        zero = np.zeros(count)
        end: list[np.ndarray] = []
        waited: dict[int, np.ndarray] = {}
        for index, op in enumerate(self.operations):
            start = zero if op.previous < 0 else end[op.previous]
            if op.sender >= 0:
                arrival = end[op.sender] + transfer[op.boundary, op.microbatch]
                waited[index] = arrival > start
                start = np.maximum(start, arrival)
            if op.kind == _FORWARD:
                start = start + forward[op.stage, op.microbatch]
            elif op.kind == _BACKWARD:
                start = start + backward[op.stage, op.microbatch]
            elif op.kind == _SHARE_OF_BACKWARD:
                start = start + backward_share(op.action.type, op.stage, split) * backward[op.stage, op.microbatch]
            elif op.kind == _CONSTANT:
                start = start + op.seconds
            end.append(start)
        return BatchRun(self, end, waited)


@dataclass(frozen=True)
class BatchRun:
    """The result of :meth:`CompiledProgram.run` for ``N`` cost assignments.

    Attributes:
        compiled: the compiled program that ran.
        end: end time of every operation, one ``[N]`` array each.
        waited: for every receive, ``[N]`` True where it waited on its send (the send is then its
            predecessor on the critical path).
    """

    compiled: CompiledProgram
    end: list[np.ndarray]
    waited: dict[int, np.ndarray]

    @property
    def makespans(self) -> np.ndarray:
        """``[N]`` step seconds: the latest end of any rank."""
        finished = [self.end[i] for i in self.compiled.last_of_rank if i >= 0]
        return np.max(finished, axis=0)

    def critical_path(self, column: int) -> list[Action]:
        """The critical path of assignment ``column``, as :func:`simulate` reports it."""
        operations = self.compiled.operations
        ends = [end[column] for end in self.end]
        index = max(range(len(ends)), key=lambda i: (ends[i], -i))
        path = []
        while index >= 0:
            path.append(operations[index].action)
            waited = self.waited.get(index)
            index = operations[index].sender if waited is not None and waited[column] else operations[index].previous
        return path[::-1]
