"""``MemoryPlanner``: choose recompute and offload per (stage, microbatch) for every batch, under a budget."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L

from lightning_pipe.callbacks._lookahead import LookaheadJob
from lightning_pipe.planning.memory_model import FULL, KEEP_ATTENTION, OFFLOAD, MemoryPlan, parse_size
from lightning_pipe.planning.memory_planner import MemoryPlanResult
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.planning.proposals import PlanProposal

log = logging.getLogger(__name__)


class MemoryPlanner(L.Callback):
    """Before every batch, plan recompute/offload from the batch's shapes so that it fits ``budget``.

    The first batch is probed (each rank runs its stages on the first microbatch in every recompute
    mode and counts what autograd saves per block; ranks share the counts), then every batch is
    planned from its own microbatch shapes: a long batch gets more recomputation than a short one.
    The plan with the smallest simulated step time that fits (``planning.memory_planner``) is
    *proposed* as the ``memory`` part of the next step's plan, as a function of the draft plan: the
    strategy calls it after the partition, family and microbatches proposed by other callbacks are
    merged, so the memory plan is made for what will run, whatever the callbacks' order.

    Args:
        budget: bytes per device (``"60GiB"``) for parameters, gradients, optimizer state and saved
            activations; None: the strategy's ``memory_budget``. Also enforced on the accounted bytes.
        options: what the planner may use among ``"full"``, ``"keep_attention"``, ``"offload"``.
        method: ``"milp"`` (HiGHS, greedy fallback) or ``"greedy"``.
        objective: ``"makespan"`` (simulated step time) or ``"recompute"`` (InfiniPipe's total recompute).
        lengths: given a microbatch, the length of each of its samples (default: dimension 1 of its
            first integer ``[B, T]`` tensor).
        host_bandwidth: device-host bytes per second, for offload stalls.
        cost_model: a :class:`~lightning_pipe.planning.cost_model.CostModel` for seconds; default: flop
            counts from the probe.
        time_limit: seconds the MILP solver may take per batch (its best plan so far is used after).
        priority: wins the memory part over proposals of lower priority (``planning/proposals.py``).
        lookahead: solve the next batch's plan on a background thread while this batch trains, for
            the plan this batch runs (when the next batch's draft plan is the same, the step takes it
            at no cost; otherwise it solves its own).
    """

    def __init__(
        self,
        budget: str | int | None = None,
        options: Sequence[str] = (FULL, KEEP_ATTENTION, OFFLOAD),
        method: str = "milp",
        objective: str = "makespan",
        lengths: Callable[[Any], Sequence[int]] | None = None,
        host_bandwidth: float = 25e9,
        cost_model: Any = None,
        time_limit: float = 10.0,
        priority: int = 0,
        lookahead: bool = True,
    ) -> None:
        unknown = set(options) - {FULL, KEEP_ATTENTION, OFFLOAD}
        if unknown:
            raise ValueError(f"`MemoryPlanner(options=...)`: unknown {sorted(unknown)}; use 'full', 'keep_attention', 'offload'.")
        if method not in ("milp", "greedy"):
            raise ValueError(f"`MemoryPlanner(method={method!r})`: use 'milp' or 'greedy'.")
        if objective not in ("makespan", "recompute"):
            raise ValueError(f"`MemoryPlanner(objective={objective!r})`: use 'makespan' or 'recompute'.")
        self.budget = None if budget is None else parse_size(budget)
        self.options = tuple(options)
        self.method = method
        self.objective = objective
        self.lengths = lengths
        self.host_bandwidth = host_bandwidth
        self.cost_model = cost_model
        self.time_limit = time_limit
        self.priority = priority
        self.lookahead = lookahead
        self.results: list[MemoryPlanResult] = []
        self.looked_ahead: list[bool] = []  # per planned batch: whether the plan was solved ahead
        self._job: LookaheadJob | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check the strategy and give it the budget to enforce."""
        memory = getattr(trainer.strategy, "memory", None)
        if memory is None:
            raise TypeError(
                f"`MemoryPlanner` needs `ElasticPipelineStrategy`, got `{type(trainer.strategy).__name__}`."
            )
        if self.budget is None and memory.budget is None:
            raise ValueError("`MemoryPlanner(budget=None)` needs `ElasticPipelineStrategy(memory_budget=...)`.")
        if self.budget is not None:
            memory.set_budget(self.budget)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        """Propose this batch's memory plan, made for the draft plan (every rank computes the same)."""
        strategy = trainer.strategy
        memory = strategy.memory
        options = dict(
            options=self.options, method=self.method, objective=self.objective, host_bandwidth=self.host_bandwidth,
            cost_model=self.cost_model, time_limit=self.time_limit,
        )

        def plan_for(draft: PipelinePlan) -> MemoryPlan:
            with strategy.step_clock.measure("plan"):  # run while the strategy applies the plan: planning, not applying
                return solve_for(draft)

        def solve_for(draft: PipelinePlan) -> MemoryPlan:
            # a rank that only receives the plan leaves its request to the planning rank (every rank builds
            # the first one: it probes the profile, a collective)
            request = None
            if memory.plans_here or memory.profile is None:
                request = memory.memory_request(batch, (batch_idx,), self.budget, self.lengths, draft, **options)
            job, self._job = self._job, None
            solved = job.join() if job is not None and job.key == request else None
            looked_ahead = solved is not None
            if looked_ahead:
                strategy.step_clock.add_background("plan", job.seconds)
            elif memory.plans_here:
                solved = request.solve()
            with strategy.step_clock.measure("plan_sync"):  # waiting for the other ranks, not planning
                result = memory.share_plan(request, solved)
            self.results.append(result)
            self.looked_ahead.append(looked_ahead)
            log.debug(
                "batch %d: memory plan by %s%s, predicted peak %s bytes, step %.3g s", batch_idx, result.method,
                " (solved ahead)" if looked_ahead else "", [round(p) for p in result.prediction.peak_bytes],
                result.step_seconds,
            )
            if self.lookahead and memory.plans_here and draft.chunks is None:  # chunks describe this batch only
                found, upcoming = strategy.peek_next_batch()
                if found:  # solved for this draft: the next batch usually runs the same partition and family
                    ahead = memory.memory_request(upcoming, (batch_idx + 1,), self.budget, self.lengths, draft, **options)
                    self._job = LookaheadJob(ahead, ahead.solve, "MemoryPlanner-plan", strategy.plan_gate)
            return result.plan

        strategy.propose(PlanProposal(type(self).__name__, memory=plan_for, priority=self.priority))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Finish a plan still being solved in the background."""
        if self._job is not None:
            self._job.wait()
            self._job = None

