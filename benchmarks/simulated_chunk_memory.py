"""Simulated: adaptive checkpointing per (stage, chunk) under a binding memory budget (InfiniPipe §3.3.3).

GPT 7B (32 layers, h=4096, bf16, flash attention, mixed-precision Adam: 16 bytes of static state per
parameter), 4 pipeline stages (uniform), GitHub-like batches of 256K tokens truncated to a 64K context
(``planning/traces.py``), each turned into workload-balanced chunks (Algorithm 1, the slice number
of ``benchmarks/simulated_long.py``: the fastest whose token limit fits 64K) and run as sliced 1F1B.
Saved bytes per token of a block are measured on the example GPT block in bf16 and scaled to 7B
(``benchmarks/simulated_memory.py``); what chunks keep beyond that (a slice's context keys and
values, the key/value store with its dK/dV buffers, Eq. 5) comes from ``planning/chunk_memory.py``
for a kernel that takes the context without a mask (``masked=False, masked_slices=False``).

For every budget per device, each policy's total step time over the batches is the simulated
makespan (recompute priced by ``planning.memory_planner.step_seconds``); a policy is OOM when the
predicted peak of any batch (static + saved + one-block transient, the chunks' bytes included)
exceeds the budget:

- ``none`` / ``full`` / ``keep_attn``: the same mode for every block and chunk;
- ``planner (blind)``: the MILP's plan per (stage, chunk) from the profile alone (what the planner
  did before chunks were counted), checked against the true peak with the chunks' bytes;
- ``planner``: the MILP's plan per (stage, chunk) counting each chunk's length and its bytes.

    python benchmarks/simulated_chunk_memory.py            # the table (a few minutes on 2 cores)
    python benchmarks/simulated_chunk_memory.py --quick    # smoke test
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
from lightning_pipe.planning.gpt import gpt_7b  # noqa: E402
from lightning_pipe.planning.memory_model import MemoryPlan, predict_memory  # noqa: E402
from lightning_pipe.planning.memory_planner import MemoryBudgetError, plan_memory, step_seconds  # noqa: E402
from lightning_pipe.planning.traces import github_like_trace  # noqa: E402
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b  # noqa: E402

CONTEXT = 65536
FIXED = {
    "none": MemoryPlan(),
    "full": MemoryPlan.from_options("full"),
    "keep_attn": MemoryPlan.from_options("keep_attention"),
}
POLICIES = (*FIXED, "planner (blind)", "planner")


def batch_cases(num_batches: int) -> list[dict]:
    """Per batch: its chunks' program, shapes and bytes beyond the profile."""
    cost = gpt_7b(unit_overhead_seconds=UNIT_OVERHEAD)
    trace = github_like_trace(num_batches, tokens_per_batch=TOKENS_PER_BATCH, max_length=131072, seed=0)
    cases = []
    for batch in trace.batches:
        lengths = [min(n, CONTEXT) for n in batch]
        _, plan = chunked(cost, lengths, CONTEXT)
        pieces = [[(p.sequence, p.start, p.length) for p in chunk.pieces] for chunk in plan.chunks]
        cases.append(
            {
                "program": sliced_1f1b(NUM_STAGES, len(plan.chunks), plan.slices),
                "shapes": plan.shapes,
                "chunks": chunk_memory(pieces, lengths, 4096, 2, masked=False, masked_slices=False),
                "count": len(plan.chunks),
                "sliced": sum(1 for s in plan.slices if s > 1),
            }
        )
    return cases


def run_budget(cases: list[dict], budget: float, profile, cost, time_limit: float) -> dict[str, float | None]:
    """Total simulated seconds of every policy over the batches (None: some batch does not fit)."""
    boundaries = uniform_boundaries(cost.num_blocks, NUM_STAGES)
    totals: dict[str, float | None] = {p: 0.0 for p in POLICIES}
    for case in cases:
        args = (case["program"], boundaries, case["shapes"])
        plans: dict[str, MemoryPlan | None] = dict(FIXED)
        for name, chunks in (("planner (blind)", None), ("planner", case["chunks"])):
            try:
                plans[name] = plan_memory(
                    *args,
                    profile,
                    budget,
                    cost_model=cost,
                    options=("full", "keep_attention"),
                    chunks=chunks,
                    time_limit=time_limit,
                ).plan
            except MemoryBudgetError:
                plans[name] = None
        for name, plan in plans.items():
            if totals[name] is None:
                continue
            fits = plan is not None and predict_memory(*args, plan, profile, chunks=case["chunks"]).fits(budget)
            totals[name] = totals[name] + step_seconds(*args, profile, plan, cost_model=cost) if fits else None
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two batches, two budgets")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds HiGHS may take per plan")
    args = parser.parse_args()
    started = time.perf_counter()
    profile = gpt7b_profile(measure_block_coefficients())
    cost = gpt_7b(unit_overhead_seconds=UNIT_OVERHEAD)
    cases = batch_cases(2 if args.quick else args.batches)
    boundaries = uniform_boundaries(cost.num_blocks, NUM_STAGES)
    for name in ("none", "full"):
        peaks = [
            max(
                predict_memory(
                    c["program"], boundaries, c["shapes"], FIXED[name], profile, chunks=c["chunks"]
                ).peak_bytes
            )
            for c in cases
        ]
        print(f"largest predicted peak with '{name}' everywhere: {max(peaks) / GIB:.1f} GiB")
    print("chunks per batch:", [c["count"] for c in cases], "sliced sequences:", [c["sliced"] for c in cases])
    budgets = (56, 72) if args.quick else (48, 56, 64, 72, 80, 96)
    header = "| budget GiB | " + " | ".join(f"{p} s" for p in POLICIES) + " | planner vs best fixed |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for budget in budgets:
        totals = run_budget(cases, budget * GIB, profile, cost, args.time_limit)
        fixed = [totals[p] for p in FIXED if totals[p] is not None]
        gain = f"{min(fixed) / totals['planner']:.2f}x" if fixed and totals["planner"] else "-"
        cells = ["OOM" if totals[p] is None else f"{totals[p]:.2f}" for p in POLICIES]
        print(f"| {budget} | " + " | ".join(cells) + f" | {gain} |")
    print(
        f"\npython {platform.python_version()}, command: python {' '.join(sys.argv)}; wall {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
