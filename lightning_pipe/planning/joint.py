"""The joint planner: partition x schedule family x microbatching x memory plan, for one batch.

Each lever alone has a planner (``plan_partition``, ``auto_schedule``, ``balance_microbatch_sizes``,
``plan_memory``); chained one after the other they optimise each part for the others' *previous*
choices. :func:`plan_joint` searches them together for one batch under a memory budget:

for every family and every microbatching (count x even/balanced sizes, and the chunkings of
``JointConfig.chunkings``: InfiniPipe's Algorithm 1 with each slice number, packed and sliced chunks
priced by their pieces and run as sliced 1F1B when sliced), it prices partitions

* ``free``: the exact fastest partition with no memory limit (``plan_partition``) and, if it does not
  fit the budget, the fastest memory plan for it (``plan_memory``);
* ``fit``: the exact fastest partition whose peak fits the budget without recomputation;
* ``recompute``: the exact fastest partition that fits with every block fully recomputed, then
  ``plan_memory`` on it (which recomputes only where needed);
* ``current``: the partition in use, with the fastest memory plan for it (and any ``partitions``
  given, such as each family's static partition);

and the split-placement families (``helix``, ``spipe``) where ``families`` lists them: their placement
follows the model and they take no memory plan, so each (family, count) is one simulation of its
program with costs cut from the same per-unit model (``planning/split_costs.py``), exact for that
model, in equal microbatches (what a split-placement run does). The strategy cannot switch a run into
or out of split placement, so ``plan_migration_seconds`` prices such a move as infinite: they win
offline (which schedule to start a run with) or within a run of their own family;

and returns the plan with the smallest simulated step time that fits, plus the seconds of moving to
it when a ``migration`` price is given (the migration-cost trigger: a plan that moves units must
gain more than the move costs). Memory plans only add time
(recompute and offload stalls lengthen actions; the simulated step time is monotone in action
durations), so the ``free`` partition's step time without a memory plan is a lower bound for every
partition and memory plan of that (family, microbatching); the smallest such bound gives the
**stated optimality gap** ``step / lower_bound - 1`` over the whole space of partitions and memory
plans, for the enumerated families and microbatchings (0 when the budget does not bind).

The search is a branch and bound, so that it fits beside a step (docs/joint-planning.md): groups
(family x microbatching) are priced in the order of a quick local search and skipped when their bound
is above the best step plus migration found (``pruned``); partition searches only look below that
best (``cutoff_seconds``); a partition whose step without a memory plan is above it gets no memory plan
(``bounded``). Time limits (``partition_time_limit`` per search, ``time_limit`` for the whole call)
stop searches at the bound they proved, which the gap then includes. A :class:`JointCache` reuses
searches for microbatch shapes seen before.

:func:`memory_profile_from_cost_model` derives the memory planner's per-unit profile from a cost
model (saved bytes without recomputation; a fully recomputed block keeps its input), so the
partition search and the memory plans price memory the same way.

Pure: numpy/scipy and ``schedules``; no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pipe.planning.boundaries import uniform_partition, unit_ranges
from lightning_pipe.planning.chunking import PlannedChunks, chunk_batch, chunk_program, chunk_time_model
from lightning_pipe.planning.cost_model import CostModel, LinearCost, MicrobatchShape
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
    padded_microbatch_sizes,
    sample_costs,
)
from lightning_pipe.planning.partition import PartitionPlan, evaluate_partition, plan_partition
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.planning.split_costs import split_placement_costs
from lightning_pipe.schedules import (
    Schedule,
    is_split_placement,
    merged_if_split,
    resolve_schedule,
    simulate,
    split_program,
)
from lightning_pipe.schedules.ir import Program

__all__ = [
    "JointCache",
    "JointCandidate",
    "JointConfig",
    "JointPlan",
    "evaluate_plan",
    "memory_profile_from_cost_model",
    "plan_joint",
    "plan_migration_seconds",
]

EVEN, BALANCED = "even", "balanced"
CHUNKS = "chunks"  # microbatching label prefix of a chunking: "chunks(N=4)"
PRUNED = "pruned"  # a group not priced: its bound was above the best plan found
BOUNDED = "bounded"  # a partition not priced: its step without a memory plan was above the best plan found
PLACED = "placed"  # a split-placement family (helix, spipe): its placement follows the model, nothing searched


@dataclass(frozen=True)
class JointConfig:
    """What the joint planner may choose.

    Attributes:
        families: schedule families (names or specs) to consider.
        microbatch_counts: microbatch counts to consider; None: ``(ranks, 2 * ranks, 4 * ranks)``.
        microbatching: ``"even"`` (the split a plan without sizes gets: equal sample counts, or
            length-grouped with ``grouped``) and/or ``"balanced"`` (sizes balancing the samples'
            cost in batch order, ``planning.microbatching``).
        memory_options: what memory plans may use (``"full"``, ``"keep_attention"``, ``"offload"``).
        memory_method: ``"greedy"`` (fast) or ``"milp"`` (exact per partition, slower).
        host_bandwidth: device-host bytes per second (offload stalls).
        relative_gap: partitions within this fraction of the optimum are accepted (faster; the
            stated gap accounts for it).
        memory_time_limit: seconds the MILP may take per memory plan.
        partition_time_limit: seconds one partition search may take (the best found is used after,
            and the bound it could still prove is stated: the gap grows, it is never understated).
        time_limit: seconds the whole search may take; None: no limit. Once spent, the (family,
            microbatching) groups not yet searched are left out with the bound known without a
            search, and searches in flight stop at what is left. For planning that must end within
            a step (lookahead).
        padded: every microbatch runs at its longest sample's length (a padded batch cut per
            microbatch, the strategy's ``trim_padding``): priced as that many samples of that length,
            not at each sample's own length.
        grouped: a plan without sizes runs the batch's samples longest first, in microbatches sized
            by :func:`~lightning_pipe.planning.microbatching.padded_microbatch_sizes` (what the
            strategy does to a padded batch with ``trim_padding`` and ``group_by_length``); price it so.
        chunkings: slice numbers ``N`` of InfiniPipe's Algorithm 1 to consider as microbatchings
            besides the padded ones (packing on: ``1`` packs whole sequences into chunks of at most the
            longest's tokens, ``N > 1`` also cuts the longest sequence into ``N`` slices of equal time
            and every sequence longer than the first slice with the same cut; the chunk length follows
            from ``N``). Chunks are priced by their pieces (attention's quadratic term per piece) and
            run as sliced 1F1B when sliced (family ``"1f1b"`` only), else with any family. Empty: no
            packing (the default). Needs a strategy that packs and slices
            (``Packer(max_tokens=..., slicing=True)``) to run the chosen chunks.
        max_chunk_tokens: chunkings whose longest chunk holds more tokens are left out (the packer's
            ``max_tokens``); None: no limit.
        family_scale: ``(family name, factor)`` pairs: that family's simulated seconds are multiplied by
            the factor (``AutoPlanner``'s measured over predicted steps per family: what the linear
            cost model leaves out, such as the fixed cost of a stage run, differs between families).
            Bounds, gap and ``best_where`` are then in scaled seconds. Unlisted families: 1.
        merge_split_backward: price zero-bubble families by the program the strategy runs with its
            ``merge_split_backward``: pairs merged into one ``B`` as ``schedules.merged_program`` decides
            with the cost model's ``split_backward``.
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
    time_limit: float | None = None
    padded: bool = False
    grouped: bool = False
    chunkings: tuple[int, ...] = ()
    max_chunk_tokens: int | None = None
    family_scale: tuple[tuple[str, float], ...] = ()
    merge_split_backward: bool = False

    def counts(self, num_ranks: int) -> tuple[int, ...]:
        """The microbatch counts for ``num_ranks`` pipeline ranks."""
        return self.microbatch_counts or (num_ranks, 2 * num_ranks, 4 * num_ranks)

    def scale(self, family: str) -> float:
        """The factor on ``family``'s simulated seconds (``family_scale``; 1 if unlisted)."""
        return dict(self.family_scale).get(family, 1.0)


@dataclass(frozen=True)
class JointCandidate:
    """One priced plan of the search.

    Attributes:
        plan: the plan (memory None: nothing recomputed or offloaded).
        microbatching: ``"even"`` or ``"balanced"``.
        origin: how its partition was found (``free``, ``fit``, ``recompute``, ``current``, ``given``;
            ``placed`` for a split-placement family, whose placement follows the model), or ``pruned``:
            its (family, microbatching) was not priced because its bound was above the best plan found
            (the plan is the unconstrained partition, not priced), or ``bounded``: this partition was not
            given a memory plan because its step without one was above the best found.
        step_seconds: simulated step time with the memory plan (inf if nothing fits, pruned or bounded).
        lower_bound_seconds: the bound for its (family, microbatching); for ``bounded``, its own step
            without a memory plan.
    """

    plan: PipelinePlan
    microbatching: str
    origin: str
    step_seconds: float
    lower_bound_seconds: float

    def scaled(self, factor: float) -> JointCandidate:
        """The candidate with its seconds multiplied by ``factor`` (``JointConfig.family_scale``)."""
        if factor == 1.0:
            return self
        return dataclasses.replace(
            self, step_seconds=self.step_seconds * factor, lower_bound_seconds=self.lower_bound_seconds * factor
        )


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
        scale: the factor the chosen family's seconds were multiplied by (``JointConfig.family_scale``):
            ``step_seconds / scale`` is the plan's simulated step.
    """

    plan: PipelinePlan
    step_seconds: float
    lower_bound_seconds: float
    gap: float
    candidates: tuple[JointCandidate, ...] = field(repr=False)
    planning_seconds: float = 0.0
    migration_seconds: float = 0.0
    scale: float = 1.0

    def best_where(self, **fixed: object) -> float:
        """The best step time among candidates whose plan has the given parts (``schedule=``,
        ``boundaries=``, ``num_microbatches=``, ``microbatching=``, ``memory=None``): what the plan
        would cost with those levers held. A pruned (family, microbatching) or a bounded partition that
        could hold them counts with its lower bound, so the result is then a lower bound of that cost."""
        best = math.inf
        for c in self.candidates:
            values = {
                "schedule": c.plan.schedule.name, "boundaries": c.plan.boundaries,
                "num_microbatches": c.plan.num_microbatches, "microbatching": c.microbatching, "memory": c.plan.memory,
            }
            if c.origin == PRUNED:
                if all(
                    values[k] == v for k, v in fixed.items() if k not in ("boundaries", "memory")
                ) and ("boundaries" not in fixed or len(fixed["boundaries"]) == len(c.plan.boundaries)):
                    best = min(best, c.lower_bound_seconds)
            elif c.origin == BOUNDED:
                if all(values[k] == v for k, v in fixed.items() if k != "memory"):
                    best = min(best, c.lower_bound_seconds)
            elif all(values[k] == v for k, v in fixed.items()):
                best = min(best, c.step_seconds)
        return best


def plan_migration_seconds(
    cost_model: CostModel, old: PipelinePlan | None, new: PipelinePlan, num_ranks: int, bandwidth: float | None = None
) -> float:
    """Seconds to move from ``old`` to ``new``: static bytes (parameters, gradients, optimizer state)
    of the units whose rank changes, on the busiest rank (sent plus received), over ``bandwidth``
    (default the cost model's link). Works across families with other stage counts or placements.

    Infinite between a split-placement family (helix, spipe) and any other schedule: the strategy cannot
    switch a run into or out of split placement (docs/joint-planning.md), so such a plan is never
    chosen over one it can run. Zero between plans of the same split-placement family (its placement is
    fixed by the model)."""
    if old is None:
        return 0.0
    if is_split_placement(old.schedule) or is_split_placement(new.schedule):
        return 0.0 if old.schedule == new.schedule else math.inf
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
    if is_split_placement(plan.schedule):  # no memory plan: the program as it runs
        config = dataclasses.replace(config, families=(plan.schedule,), microbatch_counts=(plan.num_microbatches,))
        found = _split_placement_candidates(cost_model, lengths, num_ranks, budget, config)
        if not found:
            raise ValueError(f"{plan.schedule.name!r} does not build for {plan.num_microbatches} microbatches of this batch.")
        return found[0].step_seconds, plan
    if plan.chunks is not None:  # packed and sliced chunks: priced by their pieces, run as sliced 1F1B if sliced
        shapes, program = plan.chunks.shapes, chunk_program(plan, num_ranks)
    else:
        if plan.microbatch_sizes is not None:
            shapes = _priced_shapes(lengths, plan.microbatch_sizes, config.padded)
        else:
            shapes = _unsized_shapes(lengths, plan.num_microbatches, num_ranks, config)
        program = _family_program(plan.schedule, num_ranks, len(shapes), cost_model, config)
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


def _unsized_shapes(lengths: Sequence[int], count: int, num_ranks: int, config: JointConfig) -> list[MicrobatchShape]:
    """The microbatch shapes of a plan without sizes: even counts in batch order, or with ``grouped``
    the samples longest first in padded-sized microbatches (the strategy's split of a padded batch)."""
    if not config.grouped:
        return _priced_shapes(lengths, even_microbatch_sizes(len(lengths), count), config.padded)
    ordered = sorted((int(n) for n in lengths), reverse=True)
    return _priced_shapes(ordered, padded_microbatch_sizes(ordered, count, num_ranks), config.padded)


def _priced_shapes(lengths: Sequence[int], sizes: Sequence[int], padded: bool) -> list[MicrobatchShape]:
    """Consecutive microbatches of ``sizes`` samples: at each sample's length, or with ``padded`` at
    each microbatch's longest."""
    if not padded:
        return microbatch_shapes(lengths, sizes)
    shapes, start = [], 0
    for n in sizes:
        shapes.append(MicrobatchShape.from_lengths([max(int(v) for v in lengths[start : start + n])] * n))
        start += n
    return shapes


class JointCache:
    """Results of :func:`plan_joint`'s searches kept for later batches (and later calls).

    A partition search depends on the cost model, the microbatch shapes, the family, the rank count,
    the memory limit and the search settings; a memory plan also on the partition, the memory profile
    and the memory planner's settings. Batches whose microbatches have the same shapes (a fixed-length
    dataset, or a length signature that comes back) reuse them instead of searching again. The cache
    belongs to one (cost model, profile, config): given another, it starts empty. Searches stopped by
    a time limit are reused as found (their stated bounds stay valid), so a plan, once made, is
    repeatable. Thread-safe (a lookahead thread and the training thread may share it).

    Args:
        max_entries: entries kept per kind (least recently used dropped first).
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._owner: tuple | None = None
        self._partitions: OrderedDict = OrderedDict()
        self._evaluations: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def bind(self, cost_model: CostModel, profile: MemoryProfile | None, config: JointConfig) -> None:
        """Use the cache for these inputs; forget everything if they are not the ones of before."""
        # neither the deadline nor the families' scales change what a search finds (scales apply after)
        config = dataclasses.replace(config, time_limit=None, family_scale=())
        with self._lock:
            owner = self._owner
            if owner is None or owner[0] is not cost_model or owner[1] is not profile or owner[2] != config:
                self._partitions.clear()
                self._evaluations.clear()
                self._owner = (cost_model, profile, config)

    def _get(self, table: OrderedDict, key: Any) -> Any:
        with self._lock:
            if key in table:
                table.move_to_end(key)
                self.hits += 1
                return table[key]
            self.misses += 1
            return None

    def _put(self, table: OrderedDict, key: Any, value: Any) -> None:
        with self._lock:
            table[key] = value
            table.move_to_end(key)
            while len(table) > self.max_entries:
                table.popitem(last=False)


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
    cache: JointCache | None = None,
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
        cache: searches of earlier calls to reuse (:class:`JointCache`); None: search everything.

    Returns:
        The :class:`JointPlan` (its ``gap`` is the stated optimality gap).

    Raises:
        MemoryBudgetError: if no candidate fits ``budget``.
    """
    started = time.perf_counter()
    given_profile = profile
    profile = profile or memory_profile_from_cost_model(cost_model)
    if cache is not None:
        cache.bind(cost_model, given_profile, config)  # None: the profile is a function of the cost model
    search = _JointSearch(cost_model, profile, num_ranks, None if budget is None else float(budget), config, cache)
    groups = _candidate_groups(search, cost_model, lengths, num_ranks, config)
    # Branch and bound over the (family, microbatching) groups, the most promising first (the best
    # partition a quick local search finds): a group whose lower bound is above the best step plus
    # migration found cannot hold the choice (memory plans and moves only add time), and a group's
    # exact search only looks below it. A family's scale multiplies its group's seconds and bounds;
    # the searches inside see the best found divided by it.
    price = migration or (lambda plan: 0.0)
    candidates: list[JointCandidate] = []
    moves: dict[int, float] = {}
    best_total = math.inf
    bounds = []
    scale_of = lambda group: config.scale(group.schedule.name)  # noqa: E731
    for candidate in _split_placement_candidates(cost_model, lengths, num_ranks, search.limit, config):
        candidates.append(candidate)  # priced first: one simulation each, and a best to prune the groups with
        bounds.append(candidate.lower_bound_seconds)
        if math.isfinite(candidate.step_seconds):
            moves[id(candidate)] = price(candidate.plan)
            best_total = min(best_total, candidate.step_seconds + moves[id(candidate)])
    for group in sorted(groups, key=lambda g: (g.quick.step_seconds * scale_of(g), g.bound * scale_of(g))):
        scale = scale_of(group)
        if group.bound * scale > best_total or (search.out_of_time() and math.isfinite(best_total)):
            bounds.append(group.bound * scale)
            candidates.append(group.pruned().scaled(scale))
            continue
        search.found_any = math.isfinite(best_total)
        group = search.search_free(group, best_total / scale)
        bounds.append(group.bound * scale)
        if group.free.step_seconds * scale >= best_total:  # nothing in the group is faster than the best found
            candidates.append(group.pruned().scaled(scale))
            continue
        unscaled_price = lambda plan, scale=scale: price(plan) / scale  # noqa: E731
        for candidate in search.price(group, current, partitions, best_total / scale, unscaled_price):
            candidate = candidate.scaled(scale)
            candidates.append(candidate)
            if math.isfinite(candidate.step_seconds):
                moves[id(candidate)] = price(candidate.plan)
                best_total = min(best_total, candidate.step_seconds + moves[id(candidate)])
    lower = min(bounds, default=math.inf)
    fitting = [c for c in candidates if math.isfinite(c.step_seconds)]
    if not candidates:
        raise ValueError(
            f"None of the families {list(config.families)} builds a program for {cost_model.num_blocks} blocks on "
            f"{num_ranks} pipeline ranks with microbatch counts {list(config.counts(num_ranks))} (at most "
            f"{len(lengths)} samples): allow other families or counts."
        )
    if not fitting:
        raise MemoryBudgetError(
            f"No plan fits the budget of {budget} bytes per device with families {list(config.families)} and "
            f"microbatch counts {list(config.counts(num_ranks))}: allow more microbatches, offload, or more stages."
        )
    best = min(fitting, key=lambda c: (c.step_seconds + moves[id(c)], c.origin != "current", c.plan.schedule.name))
    fastest = min(c.step_seconds for c in fitting)
    gap = fastest / lower - 1.0 if lower > 0 else 0.0
    return JointPlan(
        best.plan, best.step_seconds, lower, max(gap, 0.0), tuple(candidates), time.perf_counter() - started,
        moves[id(best)], config.scale(best.plan.schedule.name),
    )


def _candidate_groups(
    search: _JointSearch, cost_model: CostModel, lengths: Sequence[int], num_ranks: int, config: JointConfig
) -> list[_Group]:
    """One search group per (family, microbatching) the configuration allows and the family builds:
    even and cost-balanced counts, then packed (and sliced) chunkings."""
    per_sample = sample_costs(lengths, cost_model)
    groups = []
    chunkings = _chunkings(cost_model, lengths, config)
    for spec in config.families:
        schedule = resolve_schedule(spec)
        if is_split_placement(schedule):  # a fixed placement: priced by _split_placement_candidates
            continue
        if num_ranks * schedule.stages_per_rank > cost_model.num_blocks:
            continue
        for count in config.counts(num_ranks):
            splits: dict[tuple[MicrobatchShape, ...], tuple[tuple[int, ...], str]] = {}
            for mode in config.microbatching:
                if mode == EVEN:
                    shapes = tuple(_unsized_shapes(lengths, count, num_ranks, config))
                    sizes = tuple(shape.num_sequences for shape in shapes)
                else:
                    sizes = balance_microbatch_sizes(per_sample, count)
                    shapes = tuple(_priced_shapes(lengths, sizes, config.padded))
                splits.setdefault(shapes, (sizes, mode))  # balanced == even: price once
            for shapes, (sizes, mode) in splits.items():
                if not _runs(schedule, num_ranks, len(sizes)):
                    continue
                merged = _merged_program(schedule, num_ranks, len(sizes), cost_model, config)
                groups.append(search.group(schedule, sizes, mode, shapes, program=merged))
        for chunks in chunkings:  # packed (and sliced) chunks, priced by their pieces
            if chunks.is_sliced and schedule.name != "1f1b":
                continue  # slices run as sliced 1F1B (backward last slice first)
            if not chunks.is_sliced and not _runs(schedule, num_ranks, chunks.num_microbatches):
                continue
            program = None
            if chunks.is_sliced:
                draft = PipelinePlan((0, cost_model.num_blocks), schedule, chunks.num_microbatches, chunks=chunks)
                program = chunk_program(draft, num_ranks)
            label = f"{CHUNKS}(N={_slice_number(chunks)})"
            groups.append(search.group(schedule, (), label, tuple(chunks.shapes), chunks, program))
    return groups


def _split_placement_candidates(
    cost_model: CostModel, lengths: Sequence[int], num_ranks: int, limit: float | None, config: JointConfig
) -> list[JointCandidate]:
    """One candidate per split-placement family of ``config.families`` (HelixPipe, SPipe) and microbatch
    count their programs build for. Their placement follows the model (nothing to search) and they take no
    memory plan, so each is priced by one simulation of its program (``planning/split_costs.py``) and is
    its own lower bound; one that does not fit ``limit`` is left with infinite seconds (and bound: nothing
    of it fits). They run the batch's samples in equal microbatches in batch order, uncut (a split-placement
    run does not trim padding): with ``padded`` or ``grouped``, every sample at the batch's longest length."""
    found = []
    for spec in config.families:
        schedule = resolve_schedule(spec)
        if not is_split_placement(schedule):
            continue
        priced = [max(int(n) for n in lengths)] * len(lengths) if config.padded or config.grouped else lengths
        for count in config.counts(num_ranks):
            if count > len(lengths):
                continue
            try:
                program = split_program(schedule, num_ranks, count, cost_model.num_blocks)
                costs = split_placement_costs(
                    cost_model, schedule, program, _priced_shapes(priced, even_microbatch_sizes(len(lengths), count), False)
                )
            except ValueError:  # sizes this family does not run (block or microbatch counts)
                continue
            result = simulate(program, costs, record_events=False)
            seconds = result.makespan * config.scale(schedule.name)
            if limit is not None and max(result.peak_memory) > limit:
                seconds = math.inf
            plan = PipelinePlan(uniform_partition(cost_model.num_blocks, num_ranks), schedule, count)
            found.append(JointCandidate(plan, EVEN, PLACED, seconds, seconds))
    return found


def _merged_program(
    schedule: Schedule, num_ranks: int, count: int, cost_model: CostModel, config: JointConfig
) -> Program | None:
    """The program a zero-bubble family runs when the strategy merges its pairs
    (``config.merge_split_backward``); None for the family as built."""
    if not config.merge_split_backward:
        return None
    return merged_if_split(schedule, num_ranks, count, cost_model.split_backward)


def _family_program(schedule: Schedule, num_ranks: int, count: int, cost_model: CostModel, config: JointConfig) -> Program:
    """The program the strategy runs for the family: merged (:func:`_merged_program`) or as built."""
    return _merged_program(schedule, num_ranks, count, cost_model, config) or schedule.build(num_ranks, count)


@functools.lru_cache(maxsize=256)
def _runs(schedule: Schedule, num_ranks: int, count: int) -> bool:
    """Whether the family builds a program for this many microbatches."""
    try:
        schedule.build(num_ranks, count)
    except (ValueError, AssertionError):
        return False
    return True


@dataclass(frozen=True)
class _Group:
    """One (family, microbatching) of the search: its best unconstrained partition (``quick``: from a
    local search; ``free``: from the exact search, once made) and a lower bound of its step time."""

    schedule: Schedule
    sizes: tuple[int, ...]
    mode: str
    shapes: tuple[MicrobatchShape, ...]
    quick: PartitionPlan
    bound: float
    free: PartitionPlan | None = None
    chunks: PlannedChunks | None = None
    program: Program | None = None  # sliced chunks: the sliced 1F1B program (the family's otherwise)

    @property
    def source(self) -> Schedule | Program:
        """What the partition searches simulate: the sliced program, or the family."""
        return self.program if self.program is not None else self.schedule

    def plan(self, boundaries: tuple[int, ...]) -> PipelinePlan:
        if self.chunks is not None:
            return PipelinePlan(boundaries, self.schedule, self.chunks.num_microbatches, chunks=self.chunks)
        return PipelinePlan(boundaries, self.schedule, len(self.sizes), None, self.sizes if self.mode == BALANCED else None)

    def pruned(self) -> JointCandidate:
        found = self.free or self.quick
        return JointCandidate(self.plan(found.boundaries), self.mode, PRUNED, math.inf, self.bound)


class _JointSearch:
    """The searches of one :func:`plan_joint` call, through the cache when there is one."""

    def __init__(
        self, cost_model: CostModel, profile: MemoryProfile, num_ranks: int, limit: float | None,
        config: JointConfig, cache: JointCache | None,
    ) -> None:
        self.cost_model, self.profile, self.num_ranks, self.limit = cost_model, profile, num_ranks, limit
        self.config, self.cache = config, cache
        self.recompute_model: CostModel | None = None
        self.deadline = None if config.time_limit is None else time.perf_counter() + config.time_limit
        self.found_any = False

    def out_of_time(self) -> bool:
        """Whether ``config.time_limit`` is spent."""
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def search_seconds(self) -> float | None:
        """Seconds the next partition search may take: its own limit, within what the whole search has left."""
        limit = self.config.partition_time_limit
        if self.deadline is None or not self.found_any:  # until one plan fits, searches get their own limit
            return limit
        left = max(0.0, self.deadline - time.perf_counter())
        return left if limit is None else min(limit, left)

    def partition(
        self, kind: str, schedule: Schedule, shapes: tuple, limit: float | None, cutoff: float = math.inf,
        time_limit: float | None = None, candidates: Sequence[Sequence[int]] = (),
    ) -> PartitionPlan | None:
        """``plan_partition`` with the no-recompute (``quick``, ``free``, ``fit``) or all-recompute
        (``recompute``) model; None if nothing fits (or nothing faster than ``cutoff`` was found).
        Reused from the cache where a search with this cutoff would find the same."""
        key = (kind, schedule, shapes, self.num_ranks, limit)
        kept = None if self.cache is None else self.cache._get(self.cache._partitions, key)
        if kept is not None:
            found, searched_below = kept
            if (found is not None and found.step_seconds < searched_below) or cutoff <= searched_below:
                return found
        if kind == "recompute":
            if self.recompute_model is None:
                self.recompute_model = self.cost_model.with_full_recompute()
            model = self.recompute_model
        else:
            model = self.cost_model
        try:
            found = plan_partition(
                model, shapes, schedule, self.num_ranks, limit, relative_gap=self.config.relative_gap,
                time_limit=time_limit, cutoff_seconds=None if math.isinf(cutoff) else cutoff, candidates=candidates,
            )
        except ValueError:
            found = None
        if self.cache is not None and (kind == "quick" or time_limit == self.config.partition_time_limit):  # not cut short
            self.cache._put(self.cache._partitions, key, (found, cutoff))
        return found

    def group(
        self, schedule: Schedule, sizes: tuple[int, ...], mode: str, shapes: tuple,
        chunks: PlannedChunks | None = None, program: Program | None = None,
    ) -> _Group:
        """The group with its quick partition (seeds and local search only) and the bound that needs no search."""
        quick = self.partition("quick", program if program is not None else schedule, shapes, None, time_limit=0.0)
        assert quick is not None  # without a limit every partition fits
        return _Group(schedule, sizes, mode, shapes, quick, quick.lower_bound_seconds, None, chunks, program)

    def search_free(self, group: _Group, cutoff: float) -> _Group:
        """The group with its exact unconstrained partition below ``cutoff`` (the best one otherwise
        found) and the search's bound (at least ``cutoff / (1 + relative_gap)`` when nothing is faster)."""
        free = self.partition(
            "free", group.source, group.shapes, None, cutoff, self.search_seconds(),
            candidates=[group.quick.boundaries],
        )
        assert free is not None
        return dataclasses.replace(group, free=free, bound=max(group.bound, free.lower_bound_seconds))

    def evaluate(self, plan: PipelinePlan, shapes: tuple) -> tuple[float, PipelinePlan]:
        grouping = None if plan.chunks is None else (plan.chunks.slices, plan.chunks.pipelines)
        key = (plan.boundaries, plan.schedule, shapes, self.limit, grouping)
        kept = None if self.cache is None else self.cache._get(self.cache._evaluations, key)
        if kept is None:
            kept = _plan_memory_for(self.cost_model, self.profile, self.config, plan, shapes, self.num_ranks, self.limit)
            if self.cache is not None:
                self.cache._put(self.cache._evaluations, key, kept)
        seconds, memory = kept
        return seconds, PipelinePlan(
            plan.boundaries, plan.schedule, plan.num_microbatches, memory, plan.microbatch_sizes, plan.chunks
        )

    def price(
        self, group: _Group, current: PipelinePlan | None, extra: Sequence[Sequence[int]], best_total: float,
        migration: Callable[[PipelinePlan], float],
    ) -> list[JointCandidate]:
        """Every candidate partition of ``group`` with its fastest memory plan, unless its step without a
        memory plan already exceeds the best step plus migration found (memory plans only add time,
        moves cost at least nothing): then it is kept as ``bounded``, unpriced. ``fit`` is searched
        only below that best."""
        partitions: dict[tuple[int, ...], str] = {group.free.boundaries: "free"}
        found = []
        best = best_total

        def add(boundaries: tuple[int, ...], origin: str) -> float:
            nonlocal best
            plan = group.plan(boundaries)
            floor = group.free.step_seconds if boundaries == group.free.boundaries else self.unconstrained(plan, group)
            if floor > best:
                found.append(JointCandidate(plan, group.mode, BOUNDED, math.inf, floor))
                return math.inf
            seconds, planned = self.evaluate(plan, group.shapes)
            found.append(JointCandidate(planned, group.mode, origin, seconds, group.bound))
            if math.isfinite(seconds):
                best = min(best, seconds + migration(planned))
            return seconds

        if self.limit is not None and not group.free.fits(self.limit):
            add(group.free.boundaries, "free")
            for kind in ("fit", "recompute"):
                result = self.partition(
                    kind, group.source, group.shapes, self.limit, best if kind == "fit" else math.inf,
                    self.search_seconds(),
                )
                if result is not None:
                    partitions.setdefault(result.boundaries, kind)
        num_stages = self.num_ranks * group.schedule.stages_per_rank
        if current is not None and len(current.boundaries) - 1 == num_stages:
            partitions.setdefault(tuple(current.boundaries), "current")
        for boundaries in extra:
            if len(boundaries) - 1 == num_stages:
                partitions.setdefault(tuple(int(b) for b in boundaries), "given")
        for boundaries, origin in partitions.items():
            if found and boundaries == group.free.boundaries:
                continue  # priced above
            add(boundaries, origin)
        return found

    def unconstrained(self, plan: PipelinePlan, group: _Group) -> float:
        """Simulated step of ``plan``'s partition without a memory plan (a lower bound of it with any)."""
        return evaluate_partition(self.cost_model, list(group.shapes), group.source, self.num_ranks, plan.boundaries).step_seconds


def _plan_memory_for(
    cost_model: CostModel, profile: MemoryProfile, config: JointConfig, plan: PipelinePlan, shapes: Sequence,
    num_ranks: int, limit: float | None,
) -> tuple[float, MemoryPlan | None]:
    """Simulated seconds of ``plan``'s partition with its fastest memory plan under ``limit`` (inf if none fits)."""
    if plan.chunks is not None:
        program = chunk_program(plan, num_ranks)
    else:
        program = _family_program(plan.schedule, num_ranks, len(shapes), cost_model, config)
    try:
        result = plan_memory(
            program, plan.boundaries, list(shapes), profile, math.inf if limit is None else limit, cost_model=cost_model,
            options=config.memory_options, method=config.memory_method, host_bandwidth=config.host_bandwidth,
            time_limit=config.memory_time_limit,
        )
    except MemoryBudgetError:
        return math.inf, None
    return result.step_seconds, None if result.plan.is_empty else result.plan


def _chunkings(cost_model: CostModel, lengths: Sequence[int], config: JointConfig) -> list[PlannedChunks]:
    """Algorithm 1's chunks of the batch for every slice number of ``config.chunkings`` (distinct ones,
    within ``max_chunk_tokens``)."""
    if not config.chunkings or not lengths or min(lengths) < 1:
        return []
    time_model = chunk_time_model(cost_model)
    found: dict[tuple, PlannedChunks] = {}
    for num_slices in sorted(set(config.chunkings)):
        if not 1 <= num_slices <= max(lengths):
            continue
        chunked = chunk_batch(lengths, num_slices, time_model)
        if config.max_chunk_tokens is not None and max(c.tokens for c in chunked.chunks) > config.max_chunk_tokens:
            continue
        chunks = PlannedChunks.from_plan(chunked, lengths)
        found.setdefault((chunks.pieces, chunks.slices), chunks)
    return list(found.values())


def _slice_number(chunks: PlannedChunks) -> int:
    """Slices of the longest sequence."""
    return max(chunks.slices)
