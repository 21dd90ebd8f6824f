"""Sequence grouping (InfiniPipe §3.3.2): a batch's chunks as one or more consecutive 1F1B pipelines.

In one 1F1B pipeline every stage holds ``d_p - p + N_prefill`` chunks in flight (Eq. 7), where
``N_prefill`` is the slice count of the pipeline's *longest* sequence. Short sequences scheduled
behind a long one therefore live in its wide window and need more checkpointing than they would
alone; several pipelines, one after the other within the step (gradients accumulate across them),
each get their own window and their own checkpointing plan, at the price of one more warm-up and
cool-down ``delta`` each (Fig. 6b, Fig. 7a).

:func:`group_sequences` is the paper's dynamic program (Eq. 14) over the sequences' chunk counts:
sequences with the same count always share a pipeline, a pipeline holds the sequences of a range of
consecutive counts (longest first, the scheduling rule of §3.3.1), and

    dp[j] = min over i < j of dp[i] + cost(counts i .. j - 1)

with two prices for a pipeline ``P``:

* ``objective="recompute"`` (the paper's Eq. 13): ``delta + T_ckpt(P)``, ``delta = (d_p - 1) *
  avg(T_tot)`` (the mean forward plus backward seconds of a chunk on one stage, over the batch's
  chunks) and ``T_ckpt(P)`` the recompute seconds of the per-(stage, chunk) checkpointing MILP of
  §3.3.3 (:func:`~lightning_pipe.planning.memory_planner.plan_memory` with ``objective="recompute"``,
  the same HiGHS MILP the memory planner uses), per rank (the total over ranks divided by ``d_p``:
  Eq. 17's ``F * sum(C)`` when recompute is tied along diagonals);
* ``objective="makespan"``: the simulated seconds of ``P`` with its fastest memory plan. Pipelines
  run one after the other (a flush between them: rank 0 ends one pipeline last and starts the next
  first), so the step's simulated time is the sum and the dynamic program minimises it exactly
  under the model.

A pipeline whose chunks fit no memory plan costs infinity. With ``m`` distinct chunk counts the
search solves ``m (m + 1) / 2`` memory plans (§3.3.4), each on a pipeline's chunks only.

Pure computation: chunks, a cost model and a memory profile in; a
:class:`~lightning_pipe.planning.chunking.PlannedChunks` with ``pipelines`` and the combined memory
plan out. The strategy runs it as consecutive sliced 1F1B pipelines
(``schedules/families/sliced_1f1b.py``'s ``pipelines``); exact, because gradients are sums.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lightning_pipe.planning.chunk_memory import ChunkMemory
from lightning_pipe.planning.chunking import PlannedChunks
from lightning_pipe.planning.cost_model import CostModel
from lightning_pipe.planning.memory_model import FULL, KEEP_ATTENTION, MemoryPlan, MemoryProfile
from lightning_pipe.planning.memory_planner import MemoryBudgetError, plan_memory
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b

__all__ = ["SequenceGrouping", "group_sequences", "pipeline_delta_seconds"]

OBJECTIVES = ("recompute", "makespan")


@dataclass(frozen=True)
class SequenceGrouping:
    """The dynamic program's choice: the batch's chunks as consecutive pipelines, each with its plan.

    Attributes:
        chunks: the chunks in schedule order (sequences with more chunks first; reordered from the
            input only if it was not so), with ``pipelines`` set (None: one pipeline).
        memory: the pipelines' checkpointing plans combined per (stage, microbatch) of ``chunks``;
            None: nothing recomputed.
        seconds: the objective over all pipelines (Eq. 13's ``sum delta + T_ckpt``, or the
            simulated step seconds).
        pipeline_seconds: the objective of each pipeline, in order.
        recompute_seconds: added recompute (and offload stall) seconds of each pipeline, summed over
            ranks.
        delta: the warm-up and cool-down price of a pipeline (``objective="recompute"``; 0 otherwise).
        order: for each microbatch of ``chunks``, its index in the input chunks.
        solves: memory plans solved (``m (m + 1) / 2`` for ``m`` distinct chunk counts).
        planning_seconds: wall seconds of the search.
        gap: the largest relative gap of any pipeline's memory plan the search priced (0: all proven
            optimal; inf: some plan came from the greedy fallback). Every price is then at most
            ``1 / (1 - gap)`` times its optimum, so ``seconds`` is within that factor of the best
            grouping under the model.
    """

    chunks: PlannedChunks
    memory: MemoryPlan | None
    seconds: float
    pipeline_seconds: tuple[float, ...]
    recompute_seconds: tuple[float, ...]
    delta: float
    order: tuple[int, ...]
    solves: int
    planning_seconds: float
    gap: float = 0.0

    @property
    def num_pipelines(self) -> int:
        """Consecutive 1F1B pipelines of the step."""
        return 1 if self.chunks.pipelines is None else len(self.chunks.pipelines)


def pipeline_delta_seconds(cost_model: CostModel, boundaries: Sequence[int], chunks: PlannedChunks) -> float:
    """Eq. 13's ``delta = (d_p - 1) * avg(T_tot)``: the warm-up and cool-down of one 1F1B pipeline, with
    ``T_tot`` a chunk's forward plus backward seconds on one stage, averaged over stages and chunks."""
    costs = cost_model.stage_costs(tuple(boundaries), chunks.shapes)
    stages = len(costs.forward)
    total = sum(f + b for fs, bs in zip(costs.forward, costs.backward) for f, b in zip(fs, bs))
    return (stages - 1) * total / (stages * chunks.num_microbatches)


def group_sequences(
    chunks: PlannedChunks,
    boundaries: Sequence[int],
    profile: MemoryProfile,
    budget: float,
    *,
    cost_model: CostModel,
    chunk_bytes: ChunkMemory | None = None,
    objective: str = "recompute",
    options: Sequence[str] = (FULL, KEEP_ATTENTION),
    tie_diagonals: bool = False,
    time_limit: float = 10.0,
    relative_gap: float = 0.01,
    max_pipelines: int | None = None,
    workers: int | None = None,
) -> SequenceGrouping:
    """InfiniPipe's sequence grouping (Eq. 14): the cheapest split of the batch's sequences into
    consecutive 1F1B pipelines, each with its own checkpointing plan under ``budget``.

    Args:
        chunks: the batch's chunks (``slices``: chunks per sequence group; a sliced sequence's slices
            and its tail's chunk form one group, every batched chunk a group of one).
        boundaries: stage boundaries over blocks (one stage per rank: ``len(boundaries) - 1`` ranks).
        profile: saved bytes per unit and mode.
        budget: bytes per device.
        cost_model: seconds per unit (prices chunks and recompute).
        chunk_bytes: what each chunk keeps beyond the profile (``planning/chunk_memory.py``), in the
            order of ``chunks``; None: nothing.
        objective: ``"recompute"`` (the paper's ``delta + T_ckpt``) or ``"makespan"`` (simulated
            seconds of each pipeline with its fastest memory plan).
        options: what the memory plans may use.
        tie_diagonals: the paper's Eq. 15 (one recompute variable per backward diagonal); only with
            ``objective="recompute"``.
        time_limit: seconds HiGHS may take per memory plan.
        relative_gap: each memory plan's MILP stops once proven within this fraction of its best.
            The search prices up to ``m (m + 1) / 2`` plans, and the checkpointing MILP closes its
            last fraction of a percent slowly (7B, 4 stages, a 20-chunk pipeline: within 0.4% in
            0.4 s, still 0.26% after 10 s), so the default 1% keeps a batch's search to seconds (the
            paper: "within 5 seconds"); ``gap`` in the result states what was reached.
        max_pipelines: at most this many pipelines; None: no limit.
        workers: memory plans solved at once (threads: HiGHS releases the GIL), as the paper solves its
            MILPs "concurrently on multiple cores"; None: the machine's cores, at most 8.

    Returns:
        The :class:`SequenceGrouping`.

    Raises:
        MemoryBudgetError: no grouping fits ``budget`` (not even one pipeline per chunk count).
        ValueError: an unknown ``objective``.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"`objective={objective!r}`: use one of {list(OBJECTIVES)}.")
    started = time.perf_counter()
    num_ranks = len(boundaries) - 1
    groups = _groups(chunks)  # (count, microbatch indices) per scheduled group, in input order
    ordered = sorted(range(len(groups)), key=lambda g: -groups[g][0])  # stable: longest first
    order = tuple(m for g in ordered for m in groups[g][1])
    slices = tuple(groups[g][0] for g in ordered)
    pieces = tuple(chunks.pieces[m] for m in order)
    shapes = [chunks.shapes[m] for m in order]
    kept = None
    if chunk_bytes is not None:
        kept = (tuple(chunk_bytes.attention[m] for m in order), tuple(chunk_bytes.kept[m] for m in order))
    counts = sorted({count for count in slices}, reverse=True)
    # class c: the groups with the c-th largest count, contiguous in schedule order
    first_group = [slices.index(count) for count in counts] + [len(slices)]
    first_mb = [sum(slices[:g]) for g in first_group]
    base = PlannedChunks(pieces, slices, chunks.sequence_lengths)
    delta = pipeline_delta_seconds(cost_model, boundaries, base) if objective == "recompute" else 0.0

    def price(a: int, b: int) -> tuple[float, float, MemoryPlan | None, float]:
        """Objective, recompute seconds, memory plan and its gap of one pipeline of classes ``a .. b - 1``."""
        g0, g1, m0, m1 = first_group[a], first_group[b], first_mb[a], first_mb[b]
        program = sliced_1f1b(num_ranks, m1 - m0, slices[g0:g1])
        sub_bytes = None if kept is None else ChunkMemory(kept[0][m0:m1], kept[1][m0:m1])
        try:
            result = plan_memory(
                program, boundaries, shapes[m0:m1], profile, budget, cost_model=cost_model, options=options,
                objective=objective, tie_diagonals=tie_diagonals and objective == "recompute",
                time_limit=time_limit, chunks=sub_bytes, relative_gap=relative_gap,
            )
        except MemoryBudgetError:
            return math.inf, math.inf, None, 0.0
        value = delta + result.recompute_seconds / num_ranks if objective == "recompute" else result.step_seconds
        return value, result.recompute_seconds, None if result.plan.is_empty else result.plan, result.gap

    limit = len(counts) if max_pipelines is None else max(1, int(max_pipelines))
    solved: dict[tuple[int, int], tuple[float, float, MemoryPlan | None, float]] = {}
    workers = workers or min(8, os.cpu_count() or 1)

    def costs(ranges: list[tuple[int, int]]) -> list[float]:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(ranges)))) as pool:
            for key, found in zip(ranges, pool.map(lambda r: price(*r), ranges)):
                solved[key] = found
        return [solved[key][0] for key in ranges]

    total, ranges = _cheapest_segmentation(len(counts), limit, costs)
    if not math.isfinite(total):
        raise MemoryBudgetError(
            f"No grouping of the batch's {len(slices)} sequence groups (chunk counts {counts}) into at most {limit} "
            f"pipelines fits the budget of {budget:.4g} bytes per device with {list(options)}: slice the sequences "
            "finer (more slices, a smaller `max_tokens`), use more pipeline stages, or raise the budget."
        )
    entries: dict[tuple[int, int], object] = {}
    default = None
    values, recomputes = [], []
    for a, b in ranges:
        value, recompute, plan, _ = solved[(a, b)]
        values.append(value)
        recomputes.append(recompute)
        if plan is not None:
            default = default or plan.default
            for (s, m), choice in plan.microbatches.items():
                entries[(s, first_mb[a] + m)] = choice
    memory = MemoryPlan(default, {}, entries) if entries else None
    pipelines = tuple(first_group[b] - first_group[a] for a, b in ranges)
    grouped = PlannedChunks(pieces, slices, chunks.sequence_lengths, pipelines)
    return SequenceGrouping(
        grouped, memory, total, tuple(values), tuple(recomputes), delta, order, len(solved),
        time.perf_counter() - started, max((entry[3] for entry in solved.values()), default=0.0),
    )


def _cheapest_segmentation(
    num_classes: int, limit: int, costs: Callable[[list[tuple[int, int]]], list[float]]
) -> tuple[float, list[tuple[int, int]]]:
    """The split of classes ``0 .. num_classes - 1`` into at most ``limit`` consecutive ranges with the
    smallest summed cost (Eq. 14's dynamic program), and those ranges in order; ``(inf, [])`` when no
    split has a finite cost. ``costs(ranges)`` prices ``(start, stop)`` ranges together (all ranges
    ending at one class at once, so they may be solved in parallel), and is asked only for ranges
    that can extend a reachable split."""
    # best[j][p]: cheapest split of classes 0 .. j - 1 in p ranges; back[j][p]: where the last one starts
    best = [[math.inf] * (limit + 1) for _ in range(num_classes + 1)]
    back = [[-1] * (limit + 1) for _ in range(num_classes + 1)]
    best[0][0] = 0.0
    for j in range(1, num_classes + 1):
        # useful only from a reachable state that leaves a range for the classes after j
        starts = [
            i for i in range(j)
            if any(math.isfinite(best[i][p]) and (j == num_classes or p + 1 < limit) for p in range(limit))
        ]
        for i, value in zip(starts, costs([(i, j) for i in starts]) if starts else []):
            for p in range(limit):
                if best[i][p] + value < best[j][p + 1]:
                    best[j][p + 1] = best[i][p] + value
                    back[j][p + 1] = i
    total = min(best[num_classes])
    if not math.isfinite(total):
        return total, []
    ranges, j, p = [], num_classes, best[num_classes].index(total)
    while j > 0:
        i = back[j][p]
        ranges.append((i, j))
        j, p = i, p - 1
    ranges.reverse()
    return total, ranges


def _groups(chunks: PlannedChunks) -> list[tuple[int, tuple[int, ...]]]:
    """Per scheduled group of ``chunks`` (in order): its chunk count and its microbatches."""
    out, start = [], 0
    for count in chunks.slices:
        out.append((count, tuple(range(start, start + count))))
        start += count
    return out
