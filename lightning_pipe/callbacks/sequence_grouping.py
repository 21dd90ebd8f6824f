"""``SequenceGrouper``: every batch as InfiniPipe's chunks in consecutive 1F1B pipelines, each with its own
checkpointing plan (§3.2 Algorithm 1, §3.3.2 sequence grouping, §3.3.3 adaptive checkpointing)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import lightning as L

from lightning_pipe.planning.chunking import PlannedChunks, chunk_batch, chunk_time_model
from lightning_pipe.planning.cost_model import CostModel
from lightning_pipe.planning.grouping import SequenceGrouping, group_sequences
from lightning_pipe.planning.joint import memory_profile_from_cost_model
from lightning_pipe.planning.memory_model import FULL, KEEP_ATTENTION, MemoryPlan, MemoryProfile, parse_size
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.planning.proposals import PlanProposal

log = logging.getLogger(__name__)


class SequenceGrouper(L.Callback):
    """Before every batch, propose its chunks grouped into consecutive pipelines, with their memory plans.

    The batch's sequences become Algorithm 1's chunks (``num_slices`` slices for the longest); the
    dynamic program of Eq. 14 (``planning.grouping.group_sequences``) splits them, by chunk count,
    into one or more consecutive sliced 1F1B pipelines with the per-(stage, chunk) checkpointing MILP
    of each under ``budget``. Both are proposed for the coming step: the chunks (with their
    ``pipelines``) as the microbatching part, the pipelines' combined plan as the memory part (for the
    running partition; a draft with another partition or other chunks gets no memory plan from this
    callback). Exact, as any plan: the pipelines run one after the other within the optimizer step and
    gradients accumulate across them. The pipeline's first rank solves and sends the result to the
    others: the MILPs' time limits may end differently on another rank, and every stage must run the
    same chunks.

    Needs ``ElasticPipelineStrategy(schedule="1f1b", packing=Packer(max_tokens=..., slicing=True))``
    with one stage per rank.

    Args:
        cost_model: seconds and bytes per unit (Algorithm 1's chunk cost, the MILP's recompute prices).
        budget: bytes per device (``"60GiB"``).
        num_slices: slices of each batch's longest sequence (Algorithm 1's ``N``).
        profile: saved bytes per unit and mode; default: from ``cost_model``
            (``planning.joint.memory_profile_from_cost_model``).
        objective: ``"recompute"`` (the paper's ``delta + T_ckpt``) or ``"makespan"``.
        options: what the memory plans may use (``"full"``, ``"keep_attention"``, ``"offload"``).
        time_limit: seconds HiGHS may take per memory plan.
        relative_gap: each memory plan's MILP stops once proven within this fraction of its best
            (``group_sequences``; the result's ``gap`` says what was reached).
        priority: wins the parts it sets over proposals of lower priority.
    """

    def __init__(
        self,
        cost_model: CostModel,
        budget: str | int,
        num_slices: int = 4,
        profile: MemoryProfile | None = None,
        objective: str = "recompute",
        options: Sequence[str] = (FULL, KEEP_ATTENTION),
        time_limit: float = 10.0,
        relative_gap: float = 0.01,
        priority: int = 0,
    ) -> None:
        if num_slices < 1:
            raise ValueError(f"`SequenceGrouper(num_slices={num_slices})` must be >= 1.")
        self.cost_model = cost_model
        self.budget = parse_size(budget)
        self.num_slices = num_slices
        self.profile = profile or memory_profile_from_cost_model(cost_model)
        self.objective = objective
        self.options = tuple(options)
        self.time_limit = time_limit
        self.relative_gap = relative_gap
        self.priority = priority
        self.results: list[SequenceGrouping] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        """Group this batch's chunks (on the pipeline's first rank) and propose them with their memory plan."""
        strategy = trainer.strategy
        unchunked = dataclasses.replace(strategy.plan, chunks=None)  # the running plan's chunks were another batch's
        lengths = getattr(strategy.split_batch(batch, unchunked).plan, "sequence_lengths", None)
        if lengths is None:
            raise ValueError(
                "`SequenceGrouper` needs a strategy that packs and slices: "
                "`ElasticPipelineStrategy(schedule='1f1b', packing=Packer(max_tokens=..., slicing=True))`."
            )
        boundaries = strategy.plan.boundaries
        found = None
        if strategy.first_in_pipeline:
            chunked = chunk_batch(list(lengths), min(self.num_slices, max(lengths)), chunk_time_model(self.cost_model))
            found = group_sequences(
                PlannedChunks.from_plan(chunked, lengths), boundaries, self.profile, self.budget,
                cost_model=self.cost_model, objective=self.objective, options=self.options,
                time_limit=self.time_limit, relative_gap=self.relative_gap,
            )
        found = strategy.share_in_pipeline(found, "the sequence grouping")
        self.results.append(found)
        log.debug("batch %d: %d pipelines, groups per pipeline %s", batch_idx, found.num_pipelines, found.chunks.pipelines)

        def memory_for(draft: PipelinePlan) -> MemoryPlan | None:
            if draft.chunks != found.chunks or tuple(draft.boundaries) != tuple(boundaries):
                return None
            return found.memory

        strategy.propose(PlanProposal(type(self).__name__, chunks=found.chunks, memory=memory_for, priority=self.priority))
