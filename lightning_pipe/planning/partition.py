"""Exact partition planner: contiguous stage boundaries that minimize the *simulated* step time.

:func:`plan_partition` finds, for one batch (its microbatch shapes), the partition of blocks into
stages whose simulated step (:func:`lightning_pipe.schedules.simulate` of the schedule's program)
is shortest, among those whose simulated peak memory fits ``memory_limit`` on every rank.

How it stays exact without simulating all ``C(L-1, S-1)`` partitions (2.6 million for 32 blocks on
8 stages):

1. Every chain of actions that wait on each other gives a lower bound on the step time that is a
   *sum over stages* of what the chain does on each stage (:mod:`.bounds`). Summed stage by stage,
   such bounds drive a branch and bound over the boundaries.
2. Seeds (the caller's partitions, the min-max partition of per-stage work, the uniform partition)
   and a local search (move one boundary by one block while it helps) give a good incumbent.
3. Rounds: find the partitions with the smallest bound below the incumbent, simulate them (many at
   once, :mod:`.batch_simulation`), keep the best, and add each one's critical path as a new bound
   (it equals that partition's step time, so it is never proposed again). When no partition has a
   bound below the incumbent, the incumbent is optimal: this last, complete search is the proof.

Memory needs no bound: which saved activations are alive after each action depends on the program
order only, so the simulator's peak memory is computed exactly per stage range and infeasible
ranges are cut before the search; with several stages per rank, a rank's exact peak is checked as
soon as its last stage is placed, so partitions that do not fit are cut inside the search.

A caller that only needs partitions faster than some step (``cutoff_seconds``) makes the proof
cheap; a search stopped by ``time_limit`` states the bound it could still prove
(``lower_bound_seconds``: the smallest bound of the subtrees it had left). The simpler recipe of bisecting on the bottleneck stage time and
simulating the Pareto candidates is exact only when the step time depends on the bottleneck alone;
with variable-length microbatches the fill and drain depend on which stages are slow.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_pipe.planning.batch_simulation import CompiledProgram
from lightning_pipe.planning.boundaries import (
    balanced_partition,
    check_boundaries,
    minimize_bottleneck,
    random_partition,
    uniform_partition,
)
from lightning_pipe.planning.bounds import Chain, ProgramAnalysis, path_chain
from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.schedules import Program, resolve_schedule, simulate
from lightning_pipe.schedules.split_schedules import refuse_split_placement

__all__ = [
    "PartitionPlan",
    "balanced_partition",
    "evaluate_partition",
    "plan_partition",
    "random_partition",
    "uniform_partition",
]

logger = logging.getLogger(__name__)

_RELATIVE_TOLERANCE = 1e-9  # ties closer than this are not told apart (floating-point sums differ)
_GIB = 2**30
_LEAVES_PER_ROUND = 8  # partitions simulated per round of the search
_NODES_PER_ROUND = 2000  # search nodes a round may expand before it simulates what it found


@dataclass(frozen=True)
class PartitionPlan:
    """A partition and what the simulator predicts for it on one batch.

    Attributes:
        boundaries: stage boundaries over blocks (``pre`` on the first stage, ``post`` on the last).
        step_seconds: simulated step time (makespan) in seconds.
        peak_memory: simulated peak bytes per pipeline rank (static + saved activations).
        planning_seconds: wall-clock seconds spent planning (or evaluating).
        num_simulations: partitions simulated to find and prove the plan (most in batches).
        proven_optimal: True when no other feasible partition has a shorter simulated step.
        lower_bound_seconds: no partition that fits has a shorter simulated step than this: the step
            time itself when proven optimal (divided by ``1 + relative_gap`` when one was given), else
            the strongest bound the search had when it stopped (``time_limit``). 0 when unknown.
    """

    boundaries: tuple[int, ...]
    step_seconds: float
    peak_memory: tuple[float, ...]
    planning_seconds: float
    num_simulations: int = 1
    proven_optimal: bool = False
    lower_bound_seconds: float = 0.0

    def fits(self, memory_limit: float | None) -> bool:
        """True when every rank's peak memory is within ``memory_limit`` bytes (None: no limit)."""
        return memory_limit is None or max(self.peak_memory) <= memory_limit


@dataclass(frozen=True)
class _Analysis:
    bounds: ProgramAnalysis
    compiled: CompiledProgram


@functools.lru_cache(maxsize=64)
def _analyse_program(program: Program) -> _Analysis:
    refuse_split_placement(program, "the partition planner")
    return _Analysis(ProgramAnalysis.of(program), CompiledProgram.of(program))


@functools.lru_cache(maxsize=64)
def _build(schedule: Any, num_ranks: int, num_microbatches: int) -> Program:
    return schedule.build(num_ranks, num_microbatches)


def _analyse(schedule: Any, num_ranks: int, num_microbatches: int) -> _Analysis:
    if isinstance(schedule, Program):
        if schedule.num_ranks != num_ranks or schedule.num_microbatches != num_microbatches:
            raise ValueError(
                f"`schedule` is a program for {schedule.num_ranks} ranks x {schedule.num_microbatches} microbatches, "
                f"but num_ranks={num_ranks} and {num_microbatches} microbatches were given."
            )
        return _analyse_program(schedule)
    if num_ranks < 1:
        raise ValueError(f"`num_ranks` must be >= 1, got {num_ranks}.")
    return _analyse_program(_build(resolve_schedule(schedule), num_ranks, num_microbatches))


def evaluate_partition(
    cost_model: CostModel,
    microbatches: Sequence[MicrobatchShape],
    schedule: Any,
    num_ranks: int,
    boundaries: Sequence[int],
) -> PartitionPlan:
    """Simulate one given partition on one batch (what the trigger compares against).

    Args:
        cost_model: per-unit costs.
        microbatches: shapes of the batch's microbatches.
        schedule: family name, :class:`~lightning_pipe.schedules.Schedule`, DSL spec, or a built
            :class:`~lightning_pipe.schedules.Program`.
        num_ranks: pipeline ranks.
        boundaries: the partition over blocks.

    Returns:
        A :class:`PartitionPlan` (``proven_optimal`` False).

    Raises:
        ValueError: if the partition does not have the schedule's number of stages.
    """
    started = time.perf_counter()
    program = _analyse(schedule, num_ranks, len(microbatches)).bounds.program
    bounds = check_boundaries(boundaries, cost_model.num_blocks, program.num_stages)
    result = simulate(program, cost_model.stage_costs(bounds, microbatches))
    return PartitionPlan(bounds, result.makespan, result.peak_memory, time.perf_counter() - started)


class _Search:
    """Branch and bound over boundaries with chain lower bounds (one instance per plan call).

    Partitions are rows of an int array ``[N, S + 1]``; everything about them is computed for many
    rows at once.
    """

    def __init__(
        self,
        cost_model: CostModel,
        microbatches: Sequence[MicrobatchShape],
        analysis: _Analysis,
        memory_limit: float | None,
    ) -> None:
        self.cost_model = cost_model
        self.microbatches = list(microbatches)
        self.analysis = analysis.bounds
        self.compiled = analysis.compiled
        self.program = program = analysis.bounds.program
        self.memory_limit = memory_limit
        num_stages, num_blocks = program.num_stages, cost_model.num_blocks
        self.num_stages, self.num_blocks = num_stages, num_blocks
        tables = cost_model.tables(self.microbatches)
        size = num_blocks + 1
        blocks = np.arange(size)
        # Unit index where stage s starts (given its first block a) and ends (given its end block b).
        unit_start = np.stack([np.zeros(size, dtype=int) if s == 0 else blocks + 1 for s in range(num_stages)])
        unit_stop = np.stack(
            [np.full(size, num_blocks + 2) if s == num_stages - 1 else blocks + 1 for s in range(num_stages)]
        )
        a, b = np.meshgrid(blocks, blocks, indexing="ij")
        stage = np.arange(num_stages)[:, None, None]
        valid = (a < b)[None] & (a[None] >= stage) & (b[None] <= num_blocks - (num_stages - 1 - stage))
        valid[0] &= a == 0
        valid[-1] &= b == num_blocks
        self.valid = valid

        def spans(table: np.ndarray) -> np.ndarray:  # [stage, a, b, ...]: sums over the stage's units
            prefix = np.concatenate([np.zeros((1,) + table.shape[1:]), np.cumsum(table, axis=0)])
            return prefix[unit_stop][:, None] - prefix[unit_start][:, :, None]

        self.forward = spans(tables.forward)  # [stage, a, b, microbatch]
        self.backward = spans(tables.backward)
        self.saved = spans(tables.saved_bytes)
        self.static = spans(tables.static_bytes)  # [stage, a, b]
        output = tables.output_bytes[np.maximum(unit_stop - 1, 0)]  # [stage, b, microbatch]
        seconds = (0.0 if math.isinf(cost_model.bandwidth) else output / cost_model.bandwidth) + cost_model.latency
        self.transfer = np.broadcast_to(seconds[:, None], self.forward.shape)
        self.stage_memory = self._stage_memory(valid) if memory_limit is not None else None  # no limit: not needed
        self.one_stage_per_rank = len(set(program.stage_to_rank)) == num_stages
        # The limit gets the tie tolerance: prefix sums and the simulator's sums round differently.
        self.limit = None if memory_limit is None else memory_limit * (1.0 + _RELATIVE_TOLERANCE)
        self.allowed = valid if self.limit is None else valid & (self.stage_memory <= self.limit)
        # Stages after which a rank of several stages has all of them placed: its exact peak is known
        # there, so the search drops partitions that do not fit at that depth instead of at the leaves.
        self.completes: dict[int, int] = {}
        if self.limit is not None and not self.one_stage_per_rank:
            for rank in range(program.num_ranks):
                own = list(program.stages_of(rank))
                if len(own) > 1:
                    self.completes[max(own)] = rank
        self.tables = np.zeros((0,) + valid.shape)
        self.rest = np.zeros((0, num_stages + 1, size))
        self.num_evaluated = 0
        self.excluded: set[tuple[int, ...]] = set()
        self.round_bound = -np.inf  # see lowest_bounds
        for chain in self.analysis.rank_chains:
            self.add_chain(chain)

    def _stage_memory(self, valid: np.ndarray) -> np.ndarray:
        """Per stage and block range, the memory of that stage alone (static + alive saved bytes): the
        rank's memory with one stage per rank, a lower bound of it with several."""
        program = self.program
        stage_memory = np.empty(valid.shape)
        for s in range(self.num_stages):
            moments = np.unique(self.analysis.alive[program.rank_of(s)][:, s, :], axis=0)
            alive = np.einsum("tm,abm->tab", moments, self.saved[s]).max(axis=0) if moments.size else 0.0
            stage_memory[s] = self.static[s] + np.maximum(alive, 0.0)
        return np.where(valid, stage_memory, np.inf)

    def add_chain(self, chain: Chain) -> None:
        """Tabulate a chain over (stage, first block, end block) and its best completion."""
        table = (
            np.einsum("sabm,sm->sab", self.forward, chain.forward)
            + np.einsum("sabm,sm->sab", self.backward, chain.backward_counts(self.cost_model.split_backward))
            + np.einsum("sabm,sm->sab", self.transfer, chain.transfer)
        )
        table[0] += chain.constant
        table = np.where(self.allowed, table, np.inf)
        rest = np.full((self.num_stages + 1, self.num_blocks + 1), np.inf)
        rest[self.num_stages, self.num_blocks] = 0.0
        for s in range(self.num_stages - 1, -1, -1):
            rest[s] = (table[s] + rest[s + 1][None, :]).min(axis=1)
        self.tables = np.concatenate([self.tables, table[None]])
        self.rest = np.concatenate([self.rest, rest[None]])

    def global_lower_bound(self) -> float:
        """A step time no partition that fits memory stage by stage can beat, without a search.

        Two valid bounds, the larger is returned: every chain's own smallest sum over partitions
        (``max_k min_P chain_k(P) <= min_P max_k chain_k(P)``), and the total work spread evenly over
        the ranks (the sum of all stages' forward and backward seconds does not depend on the
        partition, and the busiest rank does at least its share).
        """
        chains = float(self.rest[:, 0, 0].max()) if len(self.rest) else 0.0
        any_partition = uniform_partition(self.num_blocks, self.num_stages)
        work = sum(
            float(self.forward[s, a, b].sum() + self.backward[s, a, b].sum())
            for s, (a, b) in enumerate(zip(any_partition[:-1], any_partition[1:]))
        )
        return max(chains, work / self.program.num_ranks)

    def rank_fits(self, stage: int, prefix: np.ndarray, end: np.ndarray) -> np.ndarray:
        """For partial partitions ``prefix`` ``[P, stage + 1]`` (boundaries up to ``stage``'s first
        block) ending ``stage`` at ``end`` ``[P]``: whether the rank that ``stage`` completes fits the
        limit (the same accounting as :meth:`fit_mask`)."""
        rank = self.completes[stage]
        moments = self.analysis.alive[rank]  # [moment, stage, microbatch]
        first = prefix[:, stage]
        static = self.static[stage, first, end].copy()
        alive = self.saved[stage, first, end] @ moments[:, stage, :].T  # [P, moment]
        for other in self.program.stages_of(rank):
            if other != stage:
                a, b = prefix[:, other], prefix[:, other + 1]
                static += self.static[other, a, b]
                alive += self.saved[other, a, b] @ moments[:, other, :].T
        peak = static + np.maximum(alive.max(axis=1, initial=0.0), 0.0)
        return peak <= self.limit

    def fit_mask(self, bounds: np.ndarray) -> np.ndarray:
        """Which partitions ``[N, S + 1]`` fit ``memory_limit`` on every rank (exact)."""
        stages = np.arange(self.num_stages)[None, :]
        first, end = bounds[:, :-1], bounds[:, 1:]
        fits = self.allowed[stages, first, end].all(axis=1)
        if self.memory_limit is not None and not self.one_stage_per_rank:
            saved = self.saved[stages, first, end]  # [N, S, microbatch]
            static = self.static[stages, first, end]  # [N, S]
            for rank in range(self.program.num_ranks):
                own = list(self.program.stages_of(rank))
                alive = np.einsum("tsm,nsm->nt", self.analysis.alive[rank][:, own, :], saved[:, own, :])
                peak = static[:, own].sum(axis=1) + np.maximum(alive.max(axis=1, initial=0.0), 0.0)
                fits &= peak <= self.limit
        return fits

    def evaluate(self, bounds: np.ndarray, learn: bool = False) -> np.ndarray:
        """Simulated step seconds of partitions ``[N, S + 1]``; ``inf`` where memory does not fit.

        With ``learn``, every partition's critical path also becomes a bound. That bound equals the
        partition's own step time, so it never comes back from :meth:`lowest_bounds` once it is not
        faster than the incumbent.
        """
        self.num_evaluated += len(bounds)
        stages = np.arange(self.num_stages)[None, :]
        first, end = bounds[:, :-1], bounds[:, 1:]

        def gather(table: np.ndarray) -> np.ndarray:  # [stage, a, b, mb] -> [stage, mb, N]
            return np.transpose(table[stages, first, end], (1, 2, 0))

        run = self.compiled.run(
            gather(self.forward), gather(self.backward), gather(self.transfer), self.cost_model.split_backward
        )
        if learn:
            for column in range(len(bounds)):
                self.add_chain(path_chain(self.program, run.critical_path(column)))
        return np.where(self.fit_mask(bounds), run.makespans, np.inf)

    def neighbours(self, bounds: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Partitions one boundary move (one block) away from ``bounds`` that fit memory."""
        moves = []
        for i in range(1, self.num_stages):
            for step in (-1, 1):
                moved = list(bounds)
                moved[i] += step
                if moved[i - 1] < moved[i] < moved[i + 1]:
                    moves.append(tuple(moved))
        if not moves:
            return []
        return [move for move, fits in zip(moves, self.fit_mask(np.array(moves))) if fits]

    def improve(self, start: tuple[int, ...], seconds: float) -> tuple[tuple[int, ...], float]:
        """Local search: move one boundary by one block while that shortens the step."""
        current, best = start, seconds
        while True:
            neighbours = self.neighbours(current)
            if not neighbours:
                return current, best
            values = self.evaluate(np.array(neighbours))
            index = int(np.argmin(values))
            if not values[index] < best:
                return current, best
            current, best = tuple(neighbours[index]), float(values[index])

    def lowest_bounds(self, threshold: float, count: int, budget: int | None = None) -> np.ndarray:
        """Up to ``count`` partitions with small chain bounds below ``threshold``, ``[n, S + 1]``.

        Depth-first over stages with each depth's frontier handled as arrays in chunks, smallest
        bounds first, so good leaves are found early and prune the rest. Without ``budget`` the
        result is exactly the ``count`` smallest bounds, and empty only if no partition has a bound
        below ``threshold`` (the proof of optimality). With ``budget``, the walk stops once it has
        expanded that many nodes and found at least one leaf.

        Afterwards ``round_bound`` is a lower bound on the chain bound of every partition that fits:
        the smallest of ``threshold``, the returned partitions' bounds and the bounds of the subtrees
        left unexplored (everything cut was cut at a limit at least one of these).
        """
        last, num_blocks = self.num_stages - 1, self.num_blocks
        chunk = max(64, 2_000_000 // (len(self.tables) * (num_blocks + 1)))
        found_bounds = np.zeros(0)
        found = np.zeros((0, self.num_stages + 1), dtype=int)
        stack = [(0, np.zeros(1, dtype=int), np.zeros((1, len(self.tables))), np.zeros((1, 1), dtype=int), -np.inf)]
        expanded = 0
        while stack:
            if budget is not None and expanded > budget and len(found):
                break
            s, first, partial, prefix, _ = stack.pop()
            expanded += len(first)
            limit = threshold if len(found) < count else float(found_bounds.max())
            values = partial[:, :, None] + np.transpose(self.tables[:, s, first, :], (1, 0, 2))  # [N, K, L+1]
            if s == last:
                bound = values[:, :, num_blocks].max(axis=1)
                keep = bound < limit
                if s in self.completes and keep.any():
                    keep[keep] = self.rank_fits(s, prefix[keep], np.full(int(keep.sum()), num_blocks))
                leaves = np.concatenate([prefix[keep], np.full((int(keep.sum()), 1), num_blocks)], axis=1)
                bound = bound[keep]
                if self.excluded:
                    allowed = np.array([tuple(leaf) not in self.excluded for leaf in leaves.tolist()], dtype=bool)
                    leaves, bound = leaves[allowed], bound[allowed]
                found_bounds = np.concatenate([found_bounds, bound])
                found = np.concatenate([found, leaves])
                if len(found) > count:
                    best = np.argsort(found_bounds, kind="stable")[:count]
                    found_bounds, found = found_bounds[best], found[best]
                continue
            completion = (values + self.rest[None, :, s + 1, :]).max(axis=1)  # [N, L+1]
            node, end = np.nonzero(completion < limit)
            if s in self.completes and len(node):
                fits = self.rank_fits(s, prefix[node], end)
                node, end = node[fits], end[fits]
            if len(node) == 0:
                continue
            order = np.argsort(completion[node, end], kind="stable")
            node, end = node[order], end[order]
            floors = completion[node, end]  # ascending: a chunk's first is its subtrees' smallest bound
            children = (end, values[node, :, end], np.concatenate([prefix[node], end[:, None]], axis=1))
            for start in range(((len(node) - 1) // chunk) * chunk, -1, -chunk):  # best chunk on top
                stack.append((s + 1, *(part[start : start + chunk] for part in children), float(floors[start])))
        self.round_bound = min(
            [threshold, float(found_bounds.min(initial=np.inf))] + [entry[-1] for entry in stack]
        )
        return found[np.argsort(found_bounds, kind="stable")]

    def seeds(self, candidates: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Partitions worth trying first: the caller's, the min-max of per-stage work, uniform."""
        work = np.where(self.allowed, (self.forward + self.backward).sum(axis=-1), np.inf)
        bottleneck, _ = minimize_bottleneck(work)
        found = [check_boundaries(c, self.num_blocks, self.num_stages) for c in candidates]
        found += [bottleneck] if bottleneck else []
        found.append(uniform_partition(self.num_blocks, self.num_stages))
        return list(dict.fromkeys(found))

    def infeasible_message(self) -> str:
        """Why nothing fits: the smallest per-rank memory any partition needs, and what to change."""
        bounds, needed = minimize_bottleneck(np.where(self.valid, self.stage_memory, np.inf))
        qualifier = "exactly" if self.one_stage_per_rank else "at least"
        stage = int(np.argmax([self.stage_memory[s, bounds[s], bounds[s + 1]] for s in range(self.num_stages)]))
        static = self.static[stage, bounds[stage], bounds[stage + 1]]
        return (
            f"`memory_limit`={self.memory_limit / _GIB:.2f} GiB per rank is too small for this batch: every partition of "
            f"{self.num_blocks} blocks into {self.num_stages} stages ({self.program.name!r} on "
            f"{self.program.num_ranks} ranks, {len(self.microbatches)} microbatches, up to "
            f"{max(mb.tokens for mb in self.microbatches)} tokens in one) needs more. The best, {list(bounds)}, needs "
            f"{qualifier} {needed / _GIB:.2f} GiB on stage {stage} ({static / _GIB:.2f} GiB parameters, gradients and "
            f"optimizer state + {(needed - static) / _GIB:.2f} GiB saved activations). Raise `memory_limit`, use more "
            "pipeline ranks, split the batch into more (smaller) microbatches, or recompute activations."
        )


def plan_partition(
    cost_model: CostModel,
    microbatches: Sequence[MicrobatchShape],
    schedule: Any,
    num_ranks: int,
    memory_limit: float | None = None,
    *,
    candidates: Sequence[Sequence[int]] = (),
    relative_gap: float = 0.0,
    time_limit: float | None = None,
    cutoff_seconds: float | None = None,
) -> PartitionPlan:
    """Contiguous stage boundaries minimizing the simulated step time of one batch.

    Exact: the returned partition's simulated step time is the minimum over all partitions (every
    stage owning at least one block) whose simulated peak memory fits ``memory_limit`` on every rank,
    up to a relative ``1e-9`` for ties and for memory at the limit (floating-point sums), or up to
    ``relative_gap`` when given. See the module docstring for the method.

    Args:
        cost_model: per-unit costs (``pre``, blocks, ``post``) and the stage-to-stage link.
        microbatches: shapes of the batch's microbatches, in schedule order.
        schedule: family name (``"1f1b"``), :class:`~lightning_pipe.schedules.Schedule`, DSL spec, or
            a built :class:`~lightning_pipe.schedules.Program`. The partition has as many stages as
            the program (``num_ranks * stages_per_rank``).
        num_ranks: pipeline ranks.
        memory_limit: bytes per rank (parameters, gradients, optimizer state and saved activations
            as the simulator counts them); None for no limit.
        candidates: partitions to try first, such as the one in use; they only speed the search.
        relative_gap: accept a plan within this fraction of the optimum (0: exact); speeds the search.
        time_limit: stop the search after this many seconds and return the best partition found
            (``proven_optimal`` False, ``lower_bound_seconds`` what the search could still prove);
            None: search to the end. Proving that nothing fits a tight ``memory_limit`` can take long
            with several stages per rank.
        cutoff_seconds: only partitions faster than this are wanted (a caller's best plan so far):
            the search skips every partition whose bound is not below it, which makes proving that
            nothing better fits fast. A partition found faster than the cutoff is exact as without it;
            otherwise the best partition the seeds gave is returned (``proven_optimal`` False).

    Returns:
        The :class:`PartitionPlan`.

    Raises:
        ValueError: if no partition fits ``memory_limit`` (the message gives the minimum memory
            needed and what to change), or, with ``cutoff_seconds`` or ``time_limit``, if no partition
            that fits was found; if there are fewer blocks than stages; for bad arguments.
    """
    started = time.perf_counter()
    if len(microbatches) == 0:
        raise ValueError("`microbatches` is empty: a step needs at least one microbatch.")
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(f"`memory_limit` must be > 0 bytes or None, got {memory_limit}.")
    if not relative_gap >= 0:
        raise ValueError(f"`relative_gap` must be >= 0, got {relative_gap}.")
    analysis = _analyse(schedule, num_ranks, len(microbatches))
    program = analysis.bounds.program
    if cost_model.num_blocks < program.num_stages:
        raise ValueError(
            f"Every stage must own at least one block: the model has {cost_model.num_blocks} blocks but "
            f"{program.name!r} on num_ranks={num_ranks} needs {program.num_stages} stages."
        )
    search = _Search(cost_model, microbatches, analysis, memory_limit)
    cutoff = math.inf if cutoff_seconds is None else float(cutoff_seconds)
    seeds = search.seeds(candidates)
    seconds = search.evaluate(np.array(seeds))
    best_index = int(np.argmin(seconds))
    incumbent, best = seeds[best_index], float(seconds[best_index])
    if math.isfinite(best):
        incumbent, best = search.improve(incumbent, best)
        search.evaluate(np.array(list(dict.fromkeys([incumbent, *search.neighbours(incumbent), *seeds]))), learn=True)
    timed_out = False
    while True:
        if time_limit is not None and time.perf_counter() - started > time_limit:
            timed_out = True
            break
        threshold = min(best, cutoff) * (1.0 - _RELATIVE_TOLERANCE) / (1.0 + relative_gap)
        leaves = search.lowest_bounds(threshold, _LEAVES_PER_ROUND, _NODES_PER_ROUND)
        if len(leaves) == 0:
            break
        fits = search.fit_mask(leaves)
        search.excluded.update(tuple(int(b) for b in leaf) for leaf in leaves[~fits])
        if fits.any():
            seconds = search.evaluate(leaves[fits], learn=True)
            index = int(np.argmin(seconds))
            if seconds[index] < best:
                incumbent, best = tuple(int(b) for b in leaves[fits][index]), float(seconds[index])
    if not math.isfinite(best):
        if timed_out:
            raise ValueError(f"No partition that fits was found within `time_limit={time_limit}` seconds.")
        if math.isfinite(cutoff):
            raise ValueError(f"No partition that fits is faster than `cutoff_seconds={cutoff_seconds}`.")
        raise ValueError(search.infeasible_message())
    result = simulate(program, cost_model.stage_costs(incumbent, microbatches))
    if timed_out:  # the last round's frontier, or the bounds that need no search, whichever is stronger
        lower = min(result.makespan, max(search.round_bound * (1.0 - _RELATIVE_TOLERANCE), search.global_lower_bound()))
    elif best < cutoff:  # proven (ties closer than the tolerance are equal, as for the plan itself)
        lower = result.makespan / (1.0 + relative_gap)
    else:  # every partition left has a bound of at least the last threshold (ties as above)
        lower = cutoff / (1.0 + relative_gap)
    return PartitionPlan(
        boundaries=incumbent,
        step_seconds=result.makespan,
        peak_memory=result.peak_memory,
        planning_seconds=time.perf_counter() - started,
        num_simulations=search.num_evaluated + 1,
        proven_optimal=relative_gap == 0.0 and not timed_out and best < cutoff,
        lower_bound_seconds=lower,
    )
