"""Executing programs on one rank: stages, point-to-point transfers, collectives."""

from lightning_pipe.runtime.executor import ActionRecord, PipelineExecutor, StepOutcome, StepWork
from lightning_pipe.runtime.step_clock import StepClock
from lightning_pipe.runtime.failures import CollectiveFailure, PeerFailure
from lightning_pipe.runtime.groups import ProcessGroups, RankLayout, create_process_groups
from lightning_pipe.runtime.loss_weights import LossWeights
from lightning_pipe.runtime.microbatch import BatchDim, MicrobatchPlan, SplitBatch, plan_microbatches, split_batch
from lightning_pipe.runtime.p2p import PointToPoint
from lightning_pipe.runtime.packing import Packer, PackingPlan

# Public: the executor and the process-group layout the strategy builds on; the errors a rank raises
# when a peer is gone (to catch them).
__all__ = [
    "ActionRecord",
    "BatchDim",
    "LossWeights",
    "MicrobatchPlan",
    "Packer",
    "PackingPlan",
    "CollectiveFailure",
    "PeerFailure",
    "PipelineExecutor",
    "PointToPoint",
    "ProcessGroups",
    "RankLayout",
    "SplitBatch",
    "StepOutcome",
    "StepClock",
    "StepWork",
    "create_process_groups",
    "plan_microbatches",
    "split_batch",
]
