"""Pure planning: plans, cost and memory models, partition and memory planners, repartition trigger.

Numbers in, numbers out (numpy and scipy; no torch, no Lightning, no processes). Uses
:mod:`lightning_pipe.schedules` to simulate programs. See ``docs/repartitioning.md`` and
``docs/memory.md``.

Plans: :class:`PipelinePlan` (typed parts), :class:`PlanProposal` and :func:`merge_proposals` (one
plan per step from many planners), :func:`plan_joint` (all levers together, ``joint.py``).

Public API: the names in ``__all__`` below. Modules ``bounds`` and ``batch_simulation`` are the
planner's machinery and may change.
"""

from lightning_pipe.planning.boundaries import (
    balanced_partition,
    check_boundaries,
    random_partition,
    uniform_partition,
    unit_ranges,
)
from lightning_pipe.planning.chunk_memory import ChunkMemory, chunk_memory, chunk_shapes
from lightning_pipe.planning.chunking import PlannedChunks
from lightning_pipe.planning.cost_model import CostModel, LinearCost, MicrobatchShape, UnitCost, UnitTables
from lightning_pipe.planning.depth_estimators import AggregateDepthEstimator, CostModelDepthEstimator
from lightning_pipe.planning.fit import LinearFit, TimingSample, UnitFit, fit_linear_cost, fit_unit_cost
from lightning_pipe.planning.gpt import gpt_1_3b, gpt_7b, gpt_cost_model
from lightning_pipe.planning.grouping import SequenceGrouping, group_sequences
from lightning_pipe.planning.hbsa import (
    DepthDecision,
    DepthEstimator,
    MemoryPlanCost,
    SearchBounds,
    SearchResult,
    brute_force_layouts,
    decide_depth,
    minimum_stages,
    search_bounds,
    search_layouts,
)
from lightning_pipe.planning.layout import (
    Layout,
    LayoutMigration,
    estimate_layout_migration,
    even_widths,
    uniform_layout,
)
from lightning_pipe.planning.layout_simulation import (
    LayoutSimulation,
    NodeTopology,
    estimate_layout_seconds,
    simulate_layout,
)
from lightning_pipe.planning.joint import JointCache, JointCandidate, JointConfig, JointPlan, plan_joint
from lightning_pipe.planning.memory_model import (
    MemoryPlan,
    MemoryPrediction,
    MemoryProfile,
    StageMemory,
    predict_memory,
)
from lightning_pipe.planning.memory_lowering import lower_memory_plan, read_memory_plan
from lightning_pipe.planning.memory_planner import MemoryBudgetError, MemoryPlanResult, plan_memory
from lightning_pipe.planning.microbatching import balance_microbatch_sizes, even_microbatch_sizes, sample_costs
from lightning_pipe.planning.migration import MigrationCalibration, MigrationEstimate, estimate_migration
from lightning_pipe.planning.partition import PartitionPlan, evaluate_partition, plan_partition
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.planning.regroup import RegroupPlan, UnitMove, plan_regroup, replica_groups, replica_microbatches
from lightning_pipe.planning.proposals import MergedPlan, PlanProposal, merge_proposals
from lightning_pipe.planning.traces import (
    LengthTrace,
    flan_like_trace,
    github_like_trace,
    sample_flan_lengths,
    sample_github_lengths,
    split_microbatches,
)
from lightning_pipe.planning.trigger import (
    StepPrediction,
    TriggerConfig,
    TriggerDecision,
    decide_repartition,
    predicted_gain,
)

# Public API: everything below; the other modules (`bounds`, `batch_simulation`) are machinery.
__all__ = [
    "AggregateDepthEstimator",
    "ChunkMemory",
    "CostModel",
    "CostModelDepthEstimator",
    "DepthDecision",
    "DepthEstimator",
    "JointCache",
    "JointCandidate",
    "JointConfig",
    "JointPlan",
    "Layout",
    "LayoutMigration",
    "LayoutSimulation",
    "LengthTrace",
    "LinearCost",
    "LinearFit",
    "MemoryBudgetError",
    "lower_memory_plan",
    "read_memory_plan",
    "MemoryPlan",
    "MemoryPlanCost",
    "MemoryPlanResult",
    "MemoryPrediction",
    "MemoryProfile",
    "MergedPlan",
    "MicrobatchShape",
    "MigrationCalibration",
    "MigrationEstimate",
    "NodeTopology",
    "PartitionPlan",
    "PipelinePlan",
    "PlanProposal",
    "PlannedChunks",
    "SequenceGrouping",
    "RegroupPlan",
    "SearchBounds",
    "SearchResult",
    "StageMemory",
    "StepPrediction",
    "TimingSample",
    "TriggerConfig",
    "TriggerDecision",
    "UnitCost",
    "UnitFit",
    "UnitMove",
    "UnitTables",
    "balance_microbatch_sizes",
    "balanced_partition",
    "brute_force_layouts",
    "check_boundaries",
    "chunk_memory",
    "chunk_shapes",
    "decide_depth",
    "decide_repartition",
    "estimate_layout_migration",
    "estimate_layout_seconds",
    "estimate_migration",
    "evaluate_partition",
    "even_microbatch_sizes",
    "even_widths",
    "fit_linear_cost",
    "fit_unit_cost",
    "flan_like_trace",
    "github_like_trace",
    "gpt_1_3b",
    "gpt_7b",
    "gpt_cost_model",
    "group_sequences",
    "merge_proposals",
    "minimum_stages",
    "plan_joint",
    "plan_memory",
    "plan_partition",
    "plan_regroup",
    "predict_memory",
    "predicted_gain",
    "random_partition",
    "replica_groups",
    "replica_microbatches",
    "sample_costs",
    "sample_flan_lengths",
    "sample_github_lengths",
    "search_bounds",
    "search_layouts",
    "simulate_layout",
    "split_microbatches",
    "uniform_layout",
    "uniform_partition",
    "unit_ranges",
]
