"""What callbacks may use of the pipeline strategy, as a :class:`typing.Protocol`.

The planner and monitor callbacks used to take ``strategy: Any``; they are now typed by
:class:`PipelineStrategy`, which lists the strategy's public surface they read. Structural: any
object with these members fits (``ElasticPipelineStrategy`` does; a test double may), and a name
a callback reads that is not listed here is a type error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from lightning_pipe.planning.plan import PipelinePlan
    from lightning_pipe.planning.proposals import PlanProposal
    from lightning_pipe.runtime.groups import RankLayout
    from lightning_pipe.runtime.migration import MigrationReport
    from lightning_pipe.runtime.step_clock import StepClock
    from lightning_pipe.schedules import Program, Schedule
    from lightning_pipe.strategies.costs import StrategyCosts
    from lightning_pipe.strategies.memory import StrategyMemory
    from lightning_pipe.strategies.plan_merging import PlanGate

__all__ = ["PipelineStrategy"]


class PipelineStrategy(Protocol):
    """The pipeline strategy as callbacks see it (``ElasticPipelineStrategy`` implements it).

    Attributes:
        boundaries: block boundaries of every stage in force.
        schedule: the schedule in force.
        program: every rank's actions for one step of the plan in force.
        costs: cost models and batch shapes for planners.
        memory: memory plans, budget and probes.
        last_migration: what the latest plan change moved (None before any).
        last_outcome: the latest step's measured outcome on this rank (None before any).
        step_clock: the current step's parts outside the program (planning, preparing the
            microbatches, sharing the loss and logs, gradient synchronization, the optimizer).
        root_device: this rank's device.
        regrouping: the elastic-depth helper (``strategies/regrouping.py``) with
            ``elastic_depth=True``, else None.
        plan_gate: opened once the current training batch's plan is applied (a new gate per batch);
            lookahead jobs made while the batch is planned start then.
        merges_split_backward: whether zero-bubble pairs run as one ``B`` where splitting them buys
            nothing (``schedules.merged_program``); planners then price a family's merged program.
    """

    boundaries: tuple[int, ...]
    schedule: Schedule
    program: Program
    costs: StrategyCosts
    memory: StrategyMemory
    last_migration: MigrationReport | None
    last_outcome: Any
    step_clock: StepClock
    regrouping: Any
    plan_gate: PlanGate
    merges_split_backward: bool

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline ranks per replica."""

    @property
    def num_microbatches(self) -> int:
        """Microbatches per batch."""

    def groups_by_length(self, batch: Any) -> bool:
        """Whether a plan without microbatch sizes runs ``batch`` length-grouped."""

    @property
    def world_size(self) -> int:
        """Number of processes."""

    @property
    def global_rank(self) -> int:
        """This process's rank."""

    @property
    def layout(self) -> RankLayout:
        """This process's place in the pipeline x data-parallel grid."""

    @property
    def plan(self) -> PipelinePlan:
        """The plan in force."""

    def propose(self, proposal: PlanProposal) -> None:
        """Propose parts of the next step's plan; the strategy merges all proposals and applies one plan."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of global rank ``src`` on every process."""

    def apply_plan(self, plan: PipelinePlan) -> Any:
        """Make ``plan`` the plan of the next step (moving units if the partition changes)."""

    def default_boundaries(self, num_stages: int) -> tuple[int, ...]:
        """The boundaries the strategy's ``partition`` argument gives for ``num_stages`` stages."""

    def peek_next_batch(self) -> tuple[bool, Any]:
        """Whether a next training batch exists, and that batch (without consuming it)."""

    def gather_from_pipeline(self, obj: Any) -> list[Any] | None:
        """One object per pipeline rank on global rank 0 (None elsewhere)."""

    @property
    def first_in_pipeline(self) -> bool:
        """Whether this process runs its pipeline's first rank (the one that decides for the pipeline)."""

    def share_in_pipeline(self, obj: Any, what: str) -> Any:
        """The pipeline's first rank's ``obj`` on every rank of this pipeline (``what`` names it in errors)."""

    def split_batch(self, batch: Any, plan: PipelinePlan | None = None, train: bool | None = None) -> Any:
        """The microbatch plan of ``batch`` and its microbatches (a ``SplitBatch``), cut once."""
