"""What merging zero-bubble pairs into one B does to a step, simulated: decided once for uniform
microbatches (what the strategy runs: ``schedules.merged_program``) or per batch with its real costs.

The GPT cost model (8 blocks, h=1024) with a split backward that costs 1.2 backwards (``I`` 0.62, ``W``
0.58 of ``B``: about what a CPU measures, docs/schedules.md), 2 ranks, a model cut evenly. Batches:
16 sequences of lognormal lengths (median 64, clipped to 8-512), longest first, in equal microbatches
padded to their longest (``--lengths fixed``: every sequence 128). Per family and microbatch count it
prints the median and worst ratio over the batches of the merged program's simulated step to the
family's as written. Runs in seconds, no processes.

    python benchmarks/simulated_merging.py
    python benchmarks/simulated_merging.py --lengths fixed
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np

from lightning_pipe.planning import gpt_cost_model
from lightning_pipe.planning.microbatching import even_microbatch_sizes, microbatch_shapes
from lightning_pipe.schedules import (
    SplitBackward,
    merge_split_backwards,
    merged_program,
    resolve_schedule,
    simulate,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=["lognormal", "fixed"], default="lognormal")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    split = SplitBackward(0.62, 0.58, 0.0, 1.0)
    model = dataclasses.replace(gpt_cost_model(8, 1024, 8, 8000), split_backward=split)
    rng = np.random.default_rng(args.seed)
    batches = [
        sorted(np.clip(rng.lognormal(np.log(64), 1.0, size=16).astype(int), 8, 512).tolist(), reverse=True)
        if args.lengths == "lognormal"
        else [128] * 16
        for _ in range(args.batches)
    ]
    print(f"{args.lengths} lengths, {args.batches} batches of 16 sequences, 2 ranks; merged step / written step")
    print(f"{'family':8} {'mb':>3} | {'uniform decision: median':>25} {'worst':>6} | {'per-batch decision: median':>27} {'worst':>6}")
    for name in ("zbv", "zb_h1"):
        for count in (4, 8):
            schedule = resolve_schedule(name)
            written = schedule.build(2, count)
            uniform = merged_program(schedule, 2, count, split)
            boundaries = tuple(range(0, 9, 8 // written.num_stages))
            ratios: dict[str, list[float]] = {"uniform": [], "batch": []}
            for lengths in batches:
                costs = model.stage_costs(boundaries, microbatch_shapes(lengths, even_microbatch_sizes(16, count)))
                base = simulate(written, costs, record_events=False).makespan
                per_batch = merge_split_backwards(written, costs)
                ratios["uniform"].append(simulate(uniform, costs, record_events=False).makespan / base)
                ratios["batch"].append(simulate(per_batch, costs, record_events=False).makespan / base)
            u, b = ratios["uniform"], ratios["batch"]
            print(
                f"{name:8} {count:>3} | {statistics.median(u):>25.3f} {max(u):>6.3f} | "
                f"{statistics.median(b):>27.3f} {max(b):>6.3f}"
            )


if __name__ == "__main__":
    main()
