"""Apply the one plan of a step: merge the callbacks' proposals, install and migrate once.

``ElasticPipelineStrategy.on_train_batch_start`` runs after every callback's hook; it calls
:func:`apply_proposals`, which merges what the callbacks proposed (``planning/proposals.py``: the
rule) and applies the result with ``strategy.apply_plan`` only when it differs from the running plan:
one program build and validation, one migration per step, whatever the number of callbacks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.planning.proposals import MergedPlan, PlanProposal, merge_proposals
from lightning_pipe.runtime.migration import MigrationReport

log = logging.getLogger(__name__)


class PlanGate:
    """Work held back until the current training batch's plan is applied (``strategy.plan_gate``,
    a new gate per batch): lookahead jobs that planners make while the batch is planned. Started at
    once, they shared the GIL with the hooks, the plan's broadcast and the migration every rank waits
    for. Held work is never started if the gate never opens (an error in a hook), so nothing waits
    on it at exit. Used from the training thread only."""

    def __init__(self) -> None:
        self._open = False
        self._held: list[Callable[[], None]] = []

    def defer(self, start: Callable[[], None]) -> None:
        """``start()`` now if the plan is applied, else when it is."""
        if self._open:
            start()
        else:
            self._held.append(start)

    def open(self) -> None:
        """The plan is in place: start what was held, in order."""
        self._open = True
        held, self._held = self._held, []
        for start in held:
            start()


@dataclass(frozen=True)
class PlanApplication:
    """How one step's plan was decided and applied (``strategy.last_application``).

    Attributes:
        batch_idx: the batch the plan is for.
        merged: the merged plan, the winning source of each part and what was overridden.
        changed: whether the plan differs from the one before (and was applied).
        migration: what this rank moved (None without a change).
        seconds: wall seconds of merging (memory planning included) and applying on this rank.
        finished: ``time.perf_counter()`` when the plan was in place (the step starts after).
    """

    batch_idx: int
    merged: MergedPlan
    changed: bool
    migration: MigrationReport | None
    seconds: float
    finished: float

    @property
    def plan(self) -> PipelinePlan:
        """The plan the step runs."""
        return self.merged.plan


def apply_proposals(strategy: Any, proposals: Sequence[PlanProposal], batch_idx: int) -> PlanApplication:
    """Merge ``proposals`` with the running plan and apply the result once if it changed."""
    started = time.perf_counter()
    current = strategy.plan
    merged = merge_proposals(current, proposals, strategy.pipeline_parallel_size, strategy.default_boundaries)
    for source, part, reason in merged.overridden:
        log.debug("batch %d: %s's %s proposal not used: %s", batch_idx, source, part, reason)
    changed = merged.plan != current
    migration = strategy.apply_plan(merged.plan) if changed else None
    finished = time.perf_counter()
    return PlanApplication(batch_idx, merged, changed, migration, finished - started, finished)
