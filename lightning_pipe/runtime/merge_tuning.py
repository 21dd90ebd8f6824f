"""Re-decide, once, which zero-bubble pairs run split, from the steps' own measured action times.

A program is built before any step has run, so :func:`~lightning_pipe.schedules.merged_program` decides
its merges on uniform costs: every stage alike, ``I`` and ``W`` half a ``B`` each. Real stages differ (the
first carries the embeddings, the last the head and the loss) and a split costs more than one ``B``; priced
with what the steps measured, the simulator keeps a different set of pairs split (on the benchmark GPT,
ZB-V at 2 ranks and 4 microbatches: 1.8% shorter with the partition ``"auto"`` picks; measured, no faster
on that 2-core machine: ``docs/schedules.md``, so it is opt-in, ``merge_split_backward="measured"``).
:class:`MergeTuning` times the actions of a few steps of one program, sums
each stage's median over the pipeline group (every stage has one rank), and keeps the per-stage seconds
that :func:`~lightning_pipe.schedules.measured_merge_costs` turns into costs for the merge decision.

What it changes is how, never what: a merge only reorders work on one rank (a pair's ``W`` runs at its
``I``), no message changes, and gradients are the same sums either way.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_pipe.runtime.collectives import all_reduce_tensor
from lightning_pipe.runtime.executor import ActionRecord
from lightning_pipe.schedules import ActionCosts, ActionType, Program, measured_merge_costs

_KINDS = (ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)


@dataclass(frozen=True, eq=False)  # compared (and hashed, in program caches) by identity: one per agreement
class StageSeconds:
    """Median seconds of each kind of compute action, per stage (a stage that ran no such action is absent)."""

    forward: dict[int, float]
    backward: dict[int, float]
    input_gradient: dict[int, float]
    weight_gradient: dict[int, float]

    def costs(self, program: Program) -> ActionCosts | None:
        """Costs for deciding ``program``'s merges (None when these seconds cannot price it)."""
        return measured_merge_costs(program, self.forward, self.backward, self.input_gradient, self.weight_gradient)


class MergeTuning:
    """Times a program's compute actions over a few training steps, then agrees on per-stage seconds.

    Every rank of a pipeline must record the same steps (the strategy records every training step of a
    program that splits its backward) and call :meth:`agree` at the same step: it is one all-reduce.

    Args:
        skip_steps: steps of a program not timed (the first step observes the model and probes shapes).
        timed_steps: steps timed before :attr:`due`.
    """

    def __init__(self, skip_steps: int = 2, timed_steps: int = 3) -> None:
        self.skip_steps = skip_steps
        self.timed_steps = timed_steps
        self.key: Hashable | None = None
        self.seconds: StageSeconds | None = None  # agreed for ``key``
        self._steps = 0
        self._samples: dict[tuple[int, ActionType], list[float]] = defaultdict(list)

    def record(self, key: Hashable, records: Sequence[ActionRecord]) -> None:
        """Time one training step of the program identified by ``key`` (family, partition, ...)."""
        if key != self.key:  # another program: what was measured (or agreed) does not describe it
            self.key, self.seconds, self._steps = key, None, 0
            self._samples.clear()
        if self.seconds is not None:
            return
        self._steps += 1
        if self._steps <= self.skip_steps:
            return
        for record in records:
            if record.action.type in _KINDS:
                busy = record.end - record.start - record.wait
                self._samples[(record.action.stage, record.action.type)].append(busy)

    @property
    def due(self) -> bool:
        """Enough steps of the current program are timed and nothing is agreed for it yet."""
        return self.seconds is None and self._steps >= self.skip_steps + self.timed_steps

    def agree(self, num_stages: int, group: dist.ProcessGroup | None) -> StageSeconds:
        """Sum every rank's medians over ``group`` (each stage is timed on one rank) and keep the result."""
        table = torch.zeros(2, num_stages, len(_KINDS), dtype=torch.float64)
        for (stage, kind), samples in self._samples.items():
            table[0, stage, _KINDS.index(kind)] = statistics.median(samples)
            table[1, stage, _KINDS.index(kind)] = 1.0
        if dist.is_available() and dist.is_initialized() and group is not None:
            all_reduce_tensor(table, "sum", "the all-reduce of the measured action times (merge tuning)", group)
        columns = [
            {s: float(table[0, s, k]) for s in range(num_stages) if table[1, s, k] > 0} for k in range(len(_KINDS))
        ]
        self.seconds = StageSeconds(*columns)
        self._samples.clear()
        return self.seconds
