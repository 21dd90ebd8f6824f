"""Where a rank runs its step's side task: work outside the program that is ready before the program ends.

The side task is the step's outcome on the rank of the last stage (``ElasticPipelineStrategy``: the
loss and logs reduced, their broadcast to the other ranks, the log replay): it needs every forward of
the last stage and nothing else. In a 1F1B program those forwards end just before the rank's last
backwards, and the task might as well run after the program. In a V-shaped or zero-bubble program the
last stage shares its rank with the first, whose backwards wait for the other ranks' gradients at the
very end: 2.5-3 ms a step of outcome on the benchmark GPT's CPU run fits in those waits instead of
following them.

:class:`SideTaskPlacer` picks, per program, the action before which the task runs: among the actions
after the task became possible, the one that waited longest for a message in the last step of the same
program (counting the task's own time where the task ran right before it), if that wait was at least
as long as the task; otherwise none (after the program). The first step of a program has no history
and runs the task after it. Where the task runs changes when it runs, never what it computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.schedules.ir import ActionType, Program

__all__ = ["SideTaskPlacer", "ready_index"]


def ready_index(program: Program, rank: int) -> int | None:
    """Index of the first action of ``rank`` after its last forward of the last stage (where the
    outcome is known); None if ``rank`` runs no forward of the last stage."""
    last = program.num_stages - 1
    found = [i for i, a in enumerate(program.actions[rank]) if a.type is ActionType.FORWARD and a.stage == last]
    return found[-1] + 1 if found else None


@dataclass
class _Placement:
    program: Program
    point: int | None  # run the task before this action; None: after the program


class SideTaskPlacer:
    """Remembers, per program (the same object, as the strategy caches them), where its side task runs next."""

    def __init__(self, capacity: int = 16) -> None:
        self._placements: dict[int, _Placement] = {}
        self._capacity = capacity

    def point(self, program: Program) -> int | None:
        """Index of the action before which the side task runs in this step of ``program`` (None: after it)."""
        placement = self._placements.get(id(program))
        return placement.point if placement is not None and placement.program is program else None

    def observe(
        self, program: Program, ready: int, waits: Sequence[float], ran_before: int | None, seconds: float
    ) -> None:
        """Learn from a step of ``program``: each action's wait (seconds blocked in receives), the
        action the task ran before (None: after the program) and how long the task took."""
        idle = list(waits)
        if ran_before is not None and ran_before < len(idle):
            idle[ran_before] += seconds  # the wait the task filled
        candidates = range(ready, len(idle))
        best = max(candidates, key=lambda i: idle[i], default=None)
        point = best if best is not None and idle[best] >= seconds else None
        if len(self._placements) >= self._capacity and id(program) not in self._placements:
            self._placements.pop(next(iter(self._placements)))
        self._placements[id(program)] = _Placement(program, point)
