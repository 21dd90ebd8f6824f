"""Plan proposals and the rule that merges them into the one plan a step runs.

Planning callbacks do not apply plans; each *proposes* changes to the next step's
:class:`~lightning_pipe.planning.plan.PipelinePlan` (``strategy.propose``). Before the step, after
every callback's ``on_train_batch_start``, the strategy merges the proposals with
:func:`merge_proposals` and applies the result once (one program build and validation, one
migration).

The merge rule (deterministic, independent of the order proposals arrive in):

1. The plan has four parts, resolved in this order, each given the parts before it:
   **microbatching** (count and sizes, or count and chunks, together), **schedule** (family), **partition**
   (boundaries), **memory** (recompute/offload plan).
2. For each part, among the proposals that set it, the one with the highest ``priority`` wins; at
   equal priority the smallest ``source`` name wins (then the smallest text form of the value, so
   even two proposals from one source are ordered). The others are recorded as overridden.
3. A part nobody proposes keeps the running plan's value, except: microbatch *sizes* and *chunks*
   describe one batch, so without a proposal the batch is split evenly (or packed by the packer); boundaries that do not have the stage
   count of the chosen family (``num_ranks * stages_per_rank``) are not used (a proposal's are
   dropped with a reason; the running ones are replaced by ``default_boundaries(num_stages)``).
   The partition part carries the stages' widths (elastic depth): a proposal with ``widths`` fits
   when they sum to ``num_ranks`` and the family has one stage per rank; one without them means one
   replica per stage; the running widths stay while nobody proposes a partition.
4. The memory part may be a function of the draft plan (parts 1 to 3 resolved): the memory
   planner plans for the partition, family and microbatches that will actually run. Only the
   winning function is called.

Pure: no torch, no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

from lightning_pipe.planning.chunking import PlannedChunks
from lightning_pipe.planning.memory_model import MemoryPlan
from lightning_pipe.planning.plan import PipelinePlan, check_microbatch_sizes
from lightning_pipe.schedules import Schedule, resolve_schedule

__all__ = ["MemoryProposal", "MergedPlan", "PlanProposal", "PARTS", "merge_proposals"]

MemoryProposal = Union[MemoryPlan, Callable[[PipelinePlan], "MemoryPlan | None"]]
"""A memory plan, or a function of the draft plan (partition, family, microbatches resolved) giving one."""

PARTS = ("microbatching", "schedule", "partition", "memory")


@dataclass(frozen=True)
class PlanProposal:
    """Changes one planner wants for the next step's plan; unset parts (None) are left to others.

    Attributes:
        source: who proposes (the callback's name); decides ties at equal priority.
        boundaries: stage boundaries over blocks.
        widths: data-parallel replicas of every stage (elastic depth, with ``boundaries``); None:
            one per stage.
        schedule: schedule family (a name or spec is resolved to a :class:`Schedule`).
        num_microbatches: microbatches per batch (``len(microbatch_sizes)`` when sizes are given).
        microbatch_sizes: samples of each microbatch of the coming batch.
        chunks: the coming batch's microbatches as packed and sliced chunks
            (:class:`~lightning_pipe.planning.chunking.PlannedChunks`; sets the count too).
        memory: a :class:`MemoryPlan`, or a function of the draft plan returning one (or None to
            keep the strategy's static plan).
        priority: higher wins a part several proposals set.
    """

    source: str
    boundaries: tuple[int, ...] | None = None
    schedule: Schedule | None = None
    num_microbatches: int | None = None
    microbatch_sizes: tuple[int, ...] | None = None
    memory: MemoryProposal | None = None
    priority: int = 0
    chunks: PlannedChunks | None = None
    widths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"`PlanProposal.source` must be a non-empty name, got {self.source!r}.")
        if self.boundaries is not None:
            object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        if self.widths is not None:
            if self.boundaries is None or len(self.widths) != len(self.boundaries) - 1:
                raise ValueError(
                    f"`PlanProposal({self.source!r})`: widths {list(self.widths)} need `boundaries` with one stage per width."
                )
            object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            object.__setattr__(self, "schedule", resolve_schedule(self.schedule))
        if self.microbatch_sizes is not None:
            sizes = check_microbatch_sizes(self.microbatch_sizes)
            if self.num_microbatches is not None and self.num_microbatches != len(sizes):
                raise ValueError(
                    f"`PlanProposal({self.source!r})`: {len(sizes)} microbatch sizes but "
                    f"num_microbatches={self.num_microbatches}."
                )
            object.__setattr__(self, "microbatch_sizes", sizes)
            object.__setattr__(self, "num_microbatches", len(sizes))
        if self.chunks is not None:
            if not isinstance(self.chunks, PlannedChunks) or self.microbatch_sizes is not None:
                raise ValueError(
                    f"`PlanProposal({self.source!r}).chunks` must be PlannedChunks, without `microbatch_sizes`."
                )
            if self.num_microbatches not in (None, self.chunks.num_microbatches):
                raise ValueError(
                    f"`PlanProposal({self.source!r})`: {self.chunks.num_microbatches} chunks but "
                    f"num_microbatches={self.num_microbatches}."
                )
            object.__setattr__(self, "num_microbatches", self.chunks.num_microbatches)
        if self.num_microbatches is not None and (isinstance(self.num_microbatches, bool) or self.num_microbatches < 1):
            raise ValueError(
                f"`PlanProposal({self.source!r})`: num_microbatches must be >= 1, got {self.num_microbatches!r}."
            )
        if self.memory is not None and not (isinstance(self.memory, MemoryPlan) or callable(self.memory)):
            raise TypeError(
                f"`PlanProposal({self.source!r}).memory` must be a MemoryPlan or a function of the draft plan, "
                f"got {type(self.memory).__name__}."
            )

    def sets(self, part: str) -> bool:
        """Whether this proposal sets ``part`` (one of :data:`PARTS`)."""
        if part == "microbatching":
            return self.num_microbatches is not None
        if part == "schedule":
            return self.schedule is not None
        if part == "partition":
            return self.boundaries is not None
        if part == "memory":
            return self.memory is not None
        raise ValueError(f"Unknown plan part {part!r}; parts are {list(PARTS)}.")

    def value(self, part: str) -> Any:
        """The value this proposal gives ``part``."""
        return {
            "microbatching": (self.num_microbatches, self.microbatch_sizes, self.chunks),
            "schedule": self.schedule,
            "partition": self.boundaries if self.widths is None else (self.boundaries, self.widths),
            "memory": self.memory,
        }[part]


@dataclass(frozen=True)
class MergedPlan:
    """The plan a step runs and how it was decided.

    Attributes:
        plan: the merged plan.
        winners: per part set by a proposal, the winning source.
        overridden: ``(source, part, reason)`` of every proposal part that did not win.
    """

    plan: PipelinePlan
    winners: dict[str, str] = field(default_factory=dict)
    overridden: tuple[tuple[str, str, str], ...] = ()


def _order(part: str) -> Callable[[PlanProposal], tuple]:
    def key(p: PlanProposal) -> tuple:
        value = p.value(part)
        text = getattr(value, "__qualname__", None) if callable(value) and not isinstance(value, MemoryPlan) else None
        return (-p.priority, p.source, text if text is not None else repr(value))

    return key


def merge_proposals(
    current: PipelinePlan,
    proposals: Sequence[PlanProposal],
    num_ranks: int,
    default_boundaries: Callable[[int], Sequence[int]],
) -> MergedPlan:
    """Merge ``proposals`` into the plan of the next step (the rule is in the module docstring).

    Args:
        current: the running plan.
        proposals: what planners proposed for the next step, in any order.
        num_ranks: pipeline ranks (stages = ranks x the family's stages per rank).
        default_boundaries: boundaries for a stage count when neither a proposal nor the running
            plan has that many stages (the strategy's ``partition`` rule).

    Returns:
        The merged plan with the winners and what was overridden.
    """
    winners: dict[str, str] = {}
    overridden: list[tuple[str, str, str]] = []

    def contest(part: str, valid: Callable[[PlanProposal], str | None] = lambda p: None) -> PlanProposal | None:
        ranked = sorted((p for p in proposals if p.sets(part)), key=_order(part))
        chosen = None
        for p in ranked:
            reason = valid(p)
            if reason is not None:
                overridden.append((p.source, part, reason))
            elif chosen is None:
                chosen = p
                winners[part] = p.source
            else:
                overridden.append((p.source, part, f"{chosen.source} won (priority {chosen.priority} vs {p.priority})"))
        return chosen

    mb = contest("microbatching")
    count = mb.num_microbatches if mb is not None else current.num_microbatches
    sizes = mb.microbatch_sizes if mb is not None else None
    chunks = mb.chunks if mb is not None else None

    sched = contest("schedule")
    schedule = sched.schedule if sched is not None else current.schedule
    num_stages = num_ranks * schedule.stages_per_rank

    def fits(p: PlanProposal) -> str | None:
        stages = len(p.boundaries) - 1
        if p.widths is not None:
            if sum(p.widths) != num_ranks or schedule.stages_per_rank != 1:
                return f"widths {list(p.widths)} on {num_ranks} ranks with schedule {schedule.name!r}"
            return None
        if stages != num_stages:
            return f"{stages} stages, but schedule {schedule.name!r} on {num_ranks} ranks has {num_stages}"
        return None

    part = contest("partition", fits)
    widths = None
    if part is not None:
        boundaries, widths = part.boundaries, part.widths
    elif current.widths is not None and schedule.stages_per_rank == 1:
        boundaries, widths = current.boundaries, current.widths
    elif len(current.boundaries) - 1 == num_stages:
        boundaries = current.boundaries
    else:
        boundaries = tuple(default_boundaries(num_stages))

    draft = PipelinePlan(boundaries, schedule, count, current.memory, sizes, chunks, widths)
    mem = contest("memory")
    if mem is not None:
        memory = mem.memory(replace(draft, memory=None)) if callable(mem.memory) else mem.memory
        draft = replace(draft, memory=memory)
    return MergedPlan(draft, winners, tuple(overridden))
