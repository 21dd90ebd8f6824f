"""The joint planner: partition x schedule family x microbatching x memory plan, for one batch.

Each lever alone has a planner (``plan_partition``, ``auto_schedule``, ``balance_microbatch_sizes``,
``plan_memory``); chained one after the other they optimise each part for the others' *previous*
choices. :func:`plan_joint` searches them together for one batch under a memory budget:

for every family and every microbatching (count x even/balanced sizes), it prices partitions

* ``free``: the exact fastest partition with no memory limit (``plan_partition``) and, if it does not
  fit the budget, the fastest memory plan for it (``plan_memory``);
* ``fit``: the exact fastest partition whose peak fits the budget without recomputation;
* ``recompute``: the exact fastest partition that fits with every block fully recomputed, then
  ``plan_memory`` on it (which recomputes only where needed);
* ``current``: the partition in use, with the fastest memory plan for it (and any ``partitions``
  given, such as each family's static partition);

and returns the plan with the smallest simulated step time that fits, plus the seconds of moving to
it when a ``migration`` price is given (the migration-cost trigger: a plan that moves units must
gain more than the move costs). Memory plans only add time
(recompute and offload stalls lengthen actions; the simulated step time is monotone in action
durations), so the ``free`` partition's step time without a memory plan is a lower bound for every
partition and memory plan of that (family, microbatching); the smallest such bound gives the
**stated optimality gap** ``step / lower_bound - 1`` over the whole space of partitions and memory
plans, for the enumerated families and microbatchings (0 when the budget does not bind).

:func:`memory_profile_from_cost_model` derives the memory planner's per-unit profile from a cost
model (saved bytes without recomputation; a fully recomputed block keeps its input), so the
partition search and the memory plans price memory the same way.

Pure: numpy/scipy and ``schedules``; no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lightning_pipe.planning.boundaries import unit_ranges
from lightning_pipe.planning.chunking import chunk_program
from lightning_pipe.planning.cost_model import CostModel, LinearCost
from lightning_pipe.planning.memory_model import (
    FULL,
    NONE,
    OFFLOAD,
    MemoryPlan,
    MemoryProfile,
    UnitMemory,
    predict_memory,
)
from lightning_pipe.planning.memory_planner import MemoryBudgetError, plan_memory, step_seconds
from lightning_pipe.planning.microbatching import (
    balance_microbatch_sizes,
    even_microbatch_sizes,
    microbatch_shapes,
    sample_costs,
)
from lightning_pipe.planning.partition import plan_partition
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.schedules import Schedule, resolve_schedule

__all__ = [
    "JointCandidate",
    "JointConfig",
    "JointPlan",
    "evaluate_plan",
    "memory_profile_from_cost_model",
    "plan_joint",
    "plan_migration_seconds",
]

EVEN, BALANCED = "even", "balanced"


@dataclass(frozen=True)
class JointConfig:
    """What the joint planner may choose.

    Attributes:
        families: schedule families (names or specs) to consider.
        microbatch_counts: microbatch counts to consider; None: ``(ranks, 2 * ranks, 4 * ranks)``.
        microbatching: ``"even"`` (equal sample counts) and/or ``"balanced"`` (sizes balancing the
            samples' cost, ``planning.microbatching``).
        memory_options: what memory plans may use (``"full"``, ``"keep_attention"``, ``"offload"``).
        memory_method: ``"greedy"`` (fast) or ``"milp"`` (exact per partition, slower).
        host_bandwidth: device-host bytes per second (offload stalls).
        relative_gap: partitions within this fraction of the optimum are accepted (faster; the
            stated gap accounts for it).
        memory_time_limit: seconds the MILP may take per memory plan.
        partition_time_limit: seconds a partition search under the budget may take (the best found
            is used after; proving that nothing fits can be slow). The unconstrained search that gives
            the lower bound always runs to the end.
    """

    families: tuple = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b")
    microbatch_counts: tuple[int, ...] | None = None
    microbatching: tuple[str, ...] = (EVEN, BALANCED)
    memory_options: tuple[str, ...] = (FULL, OFFLOAD)
    memory_method: str = "greedy"
    host_bandwidth: float = 25e9
    relative_gap: float = 0.0
    memory_time_limit: float = 5.0
    partition_time_limit: float | None = 5.0

    def counts(self, num_ranks: int) -> tuple[int, ...]:
        """The microbatch counts for ``num_ranks`` pipeline ranks."""
        return self.microbatch_counts or (num_ranks, 2 * num_ranks, 4 * num_ranks)


@dataclass(frozen=True)
class JointCandidate:
    """One priced plan of the search.

    Attributes:
        plan: the plan (memory None: nothing recomputed or offloaded).
        microbatching: ``"even"`` or ``"balanced"``.
        origin: how its partition was found (``free``, ``fit``, ``recompute``, ``current``).
        step_seconds: simulated step time with the memory plan (inf if nothing fits).
        lower_bound_seconds: the bound for its (family, microbatching).
    """

    plan: PipelinePlan
    microbatching: str
    origin: str
    step_seconds: float
    lower_bound_seconds: float


@dataclass(frozen=True)
class JointPlan:
    """The joint planner's choice for one batch and what it knows about it.

    Attributes:
        plan: the chosen plan.
        step_seconds: its simulated step time.
        lower_bound_seconds: no plan of the searched families and microbatchings is faster.
        gap: ``fastest candidate's step / lower_bound_seconds - 1`` (0: proven optimal): the search's
            optimality gap. The chosen plan may be slower than the fastest by less than the
            migration it avoids.
        candidates: every priced candidate.
        planning_seconds: wall seconds of the search.
        migration_seconds: the price of moving to the chosen plan (0 without a ``migration`` price).
    """

    plan: PipelinePlan
    step_seconds: float
    lower_bound_seconds: float
    gap: float
    candidates: tuple[JointCandidate, ...] = field(repr=False)
    planning_seconds: float = 0.0
    migration_seconds: float = 0.0

    def best_where(self, **fixed: object) -> float:
        """The best step time among candidates whose plan has the given parts (``schedule=``,
        ``boundaries=``, ``num_microbatches=``, ``microbatching=``, ``memory=None``): what the plan
        would cost with those levers held."""
        best = math.inf
        for c in self.candidates:
            values = {
                "schedule": c.plan.schedule.name, "boundaries": c.plan.boundaries,
                "num_microbatches": c.plan.num_microbatches, "microbatching": c.microbatching, "memory": c.plan.memory,
            }
            if all(values[k] == v for k, v in fixed.items()):
                best = min(best, c.step_seconds)
        return best


def plan_migration_seconds(
    cost_model: CostModel, old: PipelinePlan | None, new: PipelinePlan, num_ranks: int, bandwidth: float | None = None
) -> float:
    """Seconds to move from ``old`` to ``new``: static bytes (parameters, gradients, optimizer state)
    of the units whose rank changes, on the busiest rank (sent plus received), over ``bandwidth``
    (default the cost model's link). Works across families with other stage counts or placements."""
    if old is None:
        return 0.0
    link = cost_model.bandwidth if bandwidth is None else bandwidth

    def unit_ranks(plan: PipelinePlan) -> list[int]:
        program = plan.schedule.build(num_ranks, num_ranks)
        owner = [0] * len(cost_model.units)
        for stage, (start, stop) in enumerate(unit_ranges(plan.boundaries, cost_model.num_blocks)):
            for unit in range(start, stop):
                owner[unit] = program.stage_to_rank[stage]
        return owner

    load = [0.0] * num_ranks
    for unit, (a, b) in enumerate(zip(unit_ranks(old), unit_ranks(new))):
        if a != b:
            load[a] += cost_model.units[unit].static_bytes
            load[b] += cost_model.units[unit].static_bytes
    return max(load) / link if math.isfinite(link) else 0.0


def memory_profile_from_cost_model(cost_model: CostModel) -> MemoryProfile:
    """A :class:`MemoryProfile` with the cost model's bytes: ``none`` keeps the unit's saved bytes,
    ``full`` (blocks) keeps the block's input (its predecessor's output per token); static bytes are
    the units' parameter, gradient and optimizer bytes."""
    units = []
    for index, unit in enumerate(cost_model.units):
        saved = {NONE: unit.saved_bytes}
        if 0 < index < len(cost_model.units) - 1:
            saved[FULL] = LinearCost(0.0, cost_model.units[index - 1].output_bytes_per_token, 0.0)
        units.append(UnitMemory(unit.name, saved, parameter_bytes=unit.static_bytes))
    return MemoryProfile(tuple(units), static_bytes_per_parameter_byte=1.0)


def evaluate_plan(
    cost_model: CostModel,
    lengths: Sequence[int],
    plan: PipelinePlan,
    num_ranks: int,
    budget: float | None,
    *,
    profile: MemoryProfile | None = None,
    config: JointConfig = JointConfig(),
    plan_memory_too: bool = True,
) -> tuple[float, PipelinePlan]:
    """Simulated step seconds of ``plan`` on a batch of ``lengths`` (its microbatching; even if it
    has no sizes) and the plan with the fastest memory plan that fits ``budget`` for its partition
    (inf and the plan unchanged if none fits). With ``plan_memory_too=False`` the plan's own memory
    plan is priced as it is."""
    profile = profile or memory_profile_from_cost_model(cost_model)
    if plan.chunks is not None:  # packed and sliced chunks: priced by their pieces, run as sliced 1F1B if sliced
        shapes, program = plan.chunks.shapes, chunk_program(plan, num_ranks)
    else:
        sizes = plan.microbatch_sizes or even_microbatch_sizes(len(lengths), plan.num_microbatches)
        shapes = microbatch_shapes(lengths, sizes)
        program = plan.schedule.build(num_ranks, len(shapes))
    limit = math.inf if budget is None else budget
    if not plan_memory_too:
        memory = plan.memory or MemoryPlan()
        if not predict_memory(program, plan.boundaries, shapes, memory, profile).fits(limit):
            return math.inf, plan
        return step_seconds(program, plan.boundaries, shapes, profile, memory, cost_model=cost_model,
                            host_bandwidth=config.host_bandwidth), plan
    try:
        result = plan_memory(
            program, plan.boundaries, shapes, profile, limit, cost_model=cost_model, options=config.memory_options,
            method=config.memory_method, host_bandwidth=config.host_bandwidth, time_limit=config.memory_time_limit,
        )
    except MemoryBudgetError:
        return math.inf, plan
    memory = None if result.plan.is_empty else result.plan
    return result.step_seconds, PipelinePlan(
        plan.boundaries, plan.schedule, len(shapes), memory, plan.microbatch_sizes, plan.chunks
    )


def plan_joint(
    cost_model: CostModel,
    lengths: Sequence[int],
    num_ranks: int,
    budget: float | None = None,
    *,
    profile: MemoryProfile | None = None,
    config: JointConfig = JointConfig(),
    current: PipelinePlan | None = None,
    partitions: Sequence[Sequence[int]] = (),
    migration: Callable[[PipelinePlan], float] | None = None,
) -> JointPlan:
    """The fastest (partition, family, microbatching, memory plan) for one batch under ``budget``.

    Args:
        cost_model: per-unit seconds and bytes.
        lengths: sequence length of every sample of the batch, in batch order.
        num_ranks: pipeline ranks.
        budget: bytes per device (static state and activations); None: no limit.
        profile: saved bytes per unit and recompute mode; default from ``cost_model``.
        config: what may be chosen.
        current: the plan in use (its partition is priced too, for the migration trigger).
        partitions: more partitions to price where their stage count fits a family (static ones).
        migration: seconds of moving from the plan in use to a plan; the choice minimises step plus
            migration seconds. None: moving is free.

    Returns:
        The :class:`JointPlan` (its ``gap`` is the stated optimality gap).

    Raises:
        MemoryBudgetError: if no candidate fits ``budget``.
    """
    started = time.perf_counter()
    profile = profile or memory_profile_from_cost_model(cost_model)
    recompute_model = cost_model.with_full_recompute()
    limit = None if budget is None else float(budget)
    candidates: list[JointCandidate] = []
    bounds: list[float] = []
    per_sample = sample_costs(lengths, cost_model)
    for spec in config.families:
        schedule = resolve_schedule(spec)
        if num_ranks * schedule.stages_per_rank > cost_model.num_blocks:
            continue
        for count in config.counts(num_ranks):
            splits = {}
            for mode in config.microbatching:
                if mode == EVEN:
                    sizes = even_microbatch_sizes(len(lengths), count)
                else:
                    sizes = balance_microbatch_sizes(per_sample, count)
                splits.setdefault(sizes, mode)  # balanced == even: price once
            for sizes, mode in splits.items():
                _price(
                    candidates, bounds, cost_model, recompute_model, profile, lengths, schedule, sizes, mode,
                    num_ranks, limit, config, current, partitions,
                )
    lower = min(bounds, default=math.inf)
    fitting = [c for c in candidates if math.isfinite(c.step_seconds)]
    if not fitting:
        raise MemoryBudgetError(
            f"No plan fits the budget of {budget} bytes per device with families {list(config.families)} and "
            f"microbatch counts {list(config.counts(num_ranks))}: allow more microbatches, offload, or more stages."
        )
    price = migration or (lambda plan: 0.0)
    moves = {id(c): price(c.plan) for c in fitting}
    best = min(fitting, key=lambda c: (c.step_seconds + moves[id(c)], c.origin != "current", c.plan.schedule.name))
    fastest = min(c.step_seconds for c in fitting)
    gap = fastest / lower - 1.0 if lower > 0 else 0.0
    return JointPlan(
        best.plan, best.step_seconds, lower, max(gap, 0.0), tuple(candidates), time.perf_counter() - started,
        moves[id(best)],
    )


def _price(
    candidates: list[JointCandidate], bounds: list[float], cost_model: CostModel, recompute_model: CostModel,
    profile: MemoryProfile, lengths: Sequence[int], schedule: Schedule, sizes: tuple[int, ...], mode: str,
    num_ranks: int, limit: float | None, config: JointConfig, current: PipelinePlan | None,
    extra: Sequence[Sequence[int]],
) -> None:
    shapes = microbatch_shapes(lengths, sizes)
    count = len(shapes)
    try:
        schedule.build(num_ranks, count)
    except (ValueError, AssertionError):  # the family does not run this many microbatches
        return
    partitions: dict[tuple[int, ...], str] = {}
    gap = config.relative_gap
    free = plan_partition(cost_model, shapes, schedule, num_ranks, None, relative_gap=gap)
    bound = free.step_seconds / (1.0 + gap)
    bounds.append(bound)
    partitions[free.boundaries] = "free"
    if limit is not None and not free.fits(limit):
        for model, origin in ((cost_model, "fit"), (recompute_model, "recompute")):
            try:
                found = plan_partition(
                    model, shapes, schedule, num_ranks, limit, relative_gap=gap, time_limit=config.partition_time_limit
                )
            except ValueError:
                continue
            partitions.setdefault(found.boundaries, origin)
    num_stages = num_ranks * schedule.stages_per_rank
    if current is not None and len(current.boundaries) - 1 == num_stages:
        partitions.setdefault(tuple(current.boundaries), "current")
    for boundaries in extra:
        if len(boundaries) - 1 == num_stages:
            partitions.setdefault(tuple(int(b) for b in boundaries), "given")
    for boundaries, origin in partitions.items():
        plan = PipelinePlan(boundaries, schedule, count, None, sizes if mode == BALANCED else None)
        seconds, planned = evaluate_plan(cost_model, lengths, plan, num_ranks, limit, profile=profile, config=config)
        candidates.append(JointCandidate(planned, mode, origin, seconds, bound))
