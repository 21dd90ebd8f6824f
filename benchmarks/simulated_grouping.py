"""Simulated: sequence grouping (InfiniPipe §3.3.2) under tight memory: one pipeline vs Eq. 14's groups.

GPT 7B (32 layers, h=4096, bf16, 16 bytes of static state per parameter), 4 pipeline stages
(uniform), GitHub-like batches of 256K tokens truncated to a 64K context, turned into Algorithm 1's
chunks (the slice number of ``benchmarks/simulated_long.py``) with what chunks keep beyond the profile
(``planning/chunk_memory.py``, a kernel without a mask), as in ``benchmarks/simulated_chunk_memory.py``.
For every budget per device and batch:

- ``one pipeline``: all chunks in one sliced 1F1B pipeline with the fastest per-(stage, chunk)
  memory plan (``plan_memory``, objective the simulated step), given the same total solver time as
  the dynamic program below (``--time-limit`` times its number of solves, at most 120 s);
- ``grouped (simulated)``: ``planning.grouping.group_sequences`` pricing each pipeline by its
  simulated seconds with its fastest memory plan (the sum is the grouped step's simulated time);
- ``one pipeline (Eq. 20)``: one pipeline with the paper's recompute-minimising MILP (Eq. 20; 20
  times the per-plan solver time), its step simulated;
- ``grouped (Eq. 13)``: the dynamic program with the paper's price ``delta + T_ckpt`` (the
  recompute-minimising MILP per pipeline), the grouped step then simulated under the pipelines' plans.

The gain of grouping compares like with like: ``one pipeline`` / ``grouped (simulated)`` (the
makespan MILP) and ``one pipeline (Eq. 20)`` / ``grouped (Eq. 13)`` (the paper's objective).

Every plan is checked with ``predict_memory`` (chunks' bytes included) against the budget. Seconds are
simulated step times summed over the batches; OOM: no plan found that fits. Each MILP stops once proven
within ``--relative-gap`` of its best (or at ``--time-limit``); the largest gap reached is printed, and
the grouping's memory plans are solved on the machine's cores at once (``group_sequences(workers=)``).

    python benchmarks/simulated_grouping.py            # the table (about 10 minutes on 2 loaded cores)
    python benchmarks/simulated_grouping.py --quick    # one batch, one budget
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.simulated_long import NUM_STAGES, TOKENS_PER_BATCH, UNIT_OVERHEAD, chunked, uniform_boundaries  # noqa: E402
from benchmarks.simulated_memory import GIB, gpt7b_profile, measure_block_coefficients  # noqa: E402
from lightning_pipe.planning.chunk_memory import chunk_memory  # noqa: E402
from lightning_pipe.planning.chunking import PlannedChunks  # noqa: E402
from lightning_pipe.planning.gpt import gpt_7b  # noqa: E402
from lightning_pipe.planning.grouping import group_sequences  # noqa: E402
from lightning_pipe.planning.memory_model import MemoryPlan, predict_memory  # noqa: E402
from lightning_pipe.planning.memory_planner import MemoryBudgetError, plan_memory, step_seconds  # noqa: E402
from lightning_pipe.planning.traces import github_like_trace  # noqa: E402
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b  # noqa: E402

CONTEXT = 65536
OPTIONS = ("full", "keep_attention")
POLICIES = ("one pipeline", "grouped (simulated)", "one pipeline (Eq. 20)", "grouped (Eq. 13)")


def batch_chunks(num_batches: int, seed: int) -> list[tuple[PlannedChunks, list[int]]]:
    """Algorithm 1's chunks of each batch of the trace, with its (truncated) lengths."""
    cost = gpt_7b(unit_overhead_seconds=UNIT_OVERHEAD)
    trace = github_like_trace(num_batches, tokens_per_batch=TOKENS_PER_BATCH, max_length=131072, seed=seed)
    out = []
    for batch in trace.batches:
        lengths = [min(n, CONTEXT) for n in batch]
        _, plan = chunked(cost, lengths, CONTEXT)
        out.append((PlannedChunks.from_plan(plan, lengths), lengths))
    return out


def _bytes(chunks: PlannedChunks, lengths: list[int]):
    return chunk_memory(chunks.pieces, lengths, 4096, 2, masked=False, masked_slices=False)


def _program(chunks: PlannedChunks):
    return sliced_1f1b(NUM_STAGES, chunks.num_microbatches, chunks.slices, chunks.pipelines)


def run_batch(
    chunks: PlannedChunks, lengths: list[int], budget: float, profile, cost, time_limit: float, relative_gap: float
) -> dict:
    """Seconds (None: OOM), pipelines and planning seconds of every policy on one batch."""
    boundaries = uniform_boundaries(cost.num_blocks, NUM_STAGES)
    out: dict[str, tuple] = {}
    solves = 0
    for name, objective, most in (
        ("grouped (Eq. 13)", "recompute", None), ("grouped (simulated)", "makespan", None),
        ("one pipeline (Eq. 20)", "recompute", 1),
    ):
        started = time.perf_counter()
        try:
            found = group_sequences(
                chunks, boundaries, profile, budget, cost_model=cost, chunk_bytes=_bytes(chunks, lengths),
                objective=objective, options=OPTIONS, time_limit=time_limit if most is None else 20 * time_limit,
                max_pipelines=most, relative_gap=relative_gap,
            )
        except MemoryBudgetError:
            out[name] = (None, "-", time.perf_counter() - started, None)
            continue
        solves = max(solves, found.solves if most is None else 0)
        grouped, memory = found.chunks, found.memory or MemoryPlan()
        args = (_program(grouped), boundaries, grouped.shapes)
        fits = predict_memory(*args, memory, profile, chunks=_bytes(grouped, lengths)).fits(budget)
        seconds = step_seconds(*args, profile, memory, cost_model=cost) if fits else None
        out[name] = (seconds, found.num_pipelines, time.perf_counter() - started, found.gap)
    started = time.perf_counter()
    args = (_program(chunks), boundaries, chunks.shapes)
    try:
        result = plan_memory(
            *args, profile, budget, cost_model=cost, options=OPTIONS, chunks=_bytes(chunks, lengths),
            time_limit=min(120.0, time_limit * max(solves, 1)), relative_gap=relative_gap,
        )
        fits = predict_memory(*args, result.plan, profile, chunks=_bytes(chunks, lengths)).fits(budget)
        out["one pipeline"] = (result.step_seconds if fits else None, 1, time.perf_counter() - started, result.gap)
    except MemoryBudgetError:
        out["one pipeline"] = (None, 1, time.perf_counter() - started, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one batch, one budget")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", type=float, nargs="*", default=[48, 56, 64], help="GiB per device")
    parser.add_argument("--time-limit", type=float, default=2.0, help="seconds HiGHS may take per memory plan")
    parser.add_argument(
        "--relative-gap", type=float, default=0.01, help="each memory plan's MILP stops within this fraction of its best"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    profile = gpt7b_profile(measure_block_coefficients())
    cost = gpt_7b(unit_overhead_seconds=UNIT_OVERHEAD)
    cases = batch_chunks(1 if args.quick else args.batches, args.seed)
    budgets = args.budgets[:1] if args.quick else args.budgets
    for chunks, _ in cases:
        print(f"chunks {chunks.num_microbatches}, chunk counts per sequence {sorted(set(chunks.slices), reverse=True)}")
    header = "| budget GiB | " + " | ".join(POLICIES) + " | pipelines per batch (simulated / Eq. 13) | gain of grouping (simulated / Eq. 13) |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for budget in budgets:
        totals: dict[str, float | None] = {p: 0.0 for p in POLICIES}
        pipelines = {p: [] for p in POLICIES}
        planning = {p: 0.0 for p in POLICIES}
        gaps = {p: 0.0 for p in POLICIES}
        for chunks, lengths in cases:
            row = run_batch(chunks, lengths, budget * GIB, profile, cost, args.time_limit, args.relative_gap)
            for p in POLICIES:
                seconds, count, spent, gap = row[p]
                totals[p] = None if totals[p] is None or seconds is None else totals[p] + seconds
                pipelines[p].append(count)
                planning[p] += spent
                gaps[p] = max(gaps[p], gap or 0.0)
        cells = ["OOM" if totals[p] is None else f"{totals[p]:.2f} s" for p in POLICIES]
        gains = []
        for base, grouped in ((POLICIES[0], POLICIES[1]), (POLICIES[2], POLICIES[3])):
            one, many = totals[base], totals[grouped]
            gains.append(f"{one / many:.3f}x" if one and many else "-")
        gain = " / ".join(gains)
        counts = f"{pipelines[POLICIES[1]]} / {pipelines[POLICIES[3]]}"
        print(f"| {budget:g} | " + " | ".join(cells) + f" | {counts} | {gain} |")
        print("  planning seconds:", {p: round(planning[p], 1) for p in POLICIES})
        print("  largest stated MILP gap:", {p: f"{100 * gaps[p]:.2f}%" for p in POLICIES})
    print(
        f"\npython {platform.python_version()}, command: python {' '.join(sys.argv)}; wall {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
