"""Simulated throughput of per-batch repartitioning against static partitions (FlexPipe-style).

For each length trace (FLANv2-like, GitHub-like), GPT model (1.3B: 24 layers, h=2048; 7B: 32 layers,
h=4096; analytic costs on an A100-class device: 312 TFLOP/s bf16 at 50% efficiency, 80 GiB, 50 GB/s
links) and pipeline depth (4 and 8 stages, 1F1B, 2 microbatches per stage), every batch's step time
is the simulated makespan (``lightning_pipe.schedules.simulate``) under three policies:

- ``elastic``: before every batch, plan the exact best partition for it (``plan_partition``), then
  let the trigger decide (``decide_repartition``, mode ``auto``: gain over a 16-step horizon,
  forecast from the last 4 batches, must beat the migration cost by 25%). A migration costs
  ``bytes moved by the busiest rank / bandwidth`` (parameters and Adam state), added to that step.
- ``static``: the exact best partition for the trace's longest batch (the one holding the longest
  sequence), never changed: what a static framework plans so that the longest batch fits.
- ``uniform``: equal block counts per stage.

Throughput is real tokens per simulated second over the whole trace. Batches are split into
microbatches of similar token counts (``split_microbatches``). Where the longest batch does not fit
80 GiB with any partition, that (trace, model, stages) runs with full activation recomputation for
all three policies (column ``recompute``). A step that does not fit under a static partition is
counted in ``OOM`` (its time is still counted, as if memory were larger).

How it was run (numbers in docs/repartitioning.md)::

    python benchmarks/simulated_repartition.py --batches 32

on 2 CPU cores; it prints its own wall time. ``--batches`` sizes it (about linearly); ``--quick``
runs one small configuration as a smoke test; ``--plot PATH`` draws the first configuration's
elastic partitions over the batches (docs/img/partitions_over_time.png).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from lightning_pipe.planning import (
    CostModel,
    MicrobatchShape,
    StepPrediction,
    TriggerConfig,
    decide_repartition,
    estimate_migration,
    evaluate_partition,
    flan_like_trace,
    github_like_trace,
    gpt_1_3b,
    gpt_7b,
    plan_partition,
    split_microbatches,
    uniform_partition,
)
from lightning_pipe.planning.render import plot_partitions

GIB = 2**30
MODELS = {"1.3b": gpt_1_3b, "7b": gpt_7b}


@dataclass
class PolicyResult:
    """What one policy did over a trace."""

    seconds: float = 0.0
    migrations: int = 0
    migration_seconds: float = 0.0
    out_of_memory_steps: int = 0
    planning_seconds: list[float] = field(default_factory=list)
    partitions: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class Row:
    """One (trace, model, stages) line of the table."""

    trace: str
    model: str
    costs: str
    stages: int
    recompute: bool
    tokens: int
    longest: list[int]
    elastic: PolicyResult
    static: PolicyResult
    uniform: PolicyResult

    def throughput(self, policy: PolicyResult) -> float:
        """Real tokens per simulated second of ``policy`` over the trace."""
        return self.tokens / policy.seconds


def traces(num_batches: int, seed: int) -> dict[str, list[tuple[int, ...]]]:
    """The two workloads, deterministic by seed."""
    return {
        "flan": list(flan_like_trace(num_batches, batch_size=64, seed=seed).batches),
        "github": list(github_like_trace(num_batches, tokens_per_batch=262144, seed=seed).batches),
    }


class Evaluator:
    """Simulated step seconds of (partition, batch) pairs, cached."""

    def __init__(self, model: CostModel, batches: list[list[MicrobatchShape]], stages: int) -> None:
        self.model, self.batches, self.stages = model, batches, stages
        self.cache: dict[tuple[tuple[int, ...], int], tuple[float, float]] = {}

    def __call__(self, boundaries: tuple[int, ...], index: int) -> tuple[float, float]:
        """(step seconds, peak bytes of the fullest rank)."""
        key = (boundaries, index)
        if key not in self.cache:
            plan = evaluate_partition(self.model, self.batches[index], "1f1b", self.stages, boundaries)
            self.cache[key] = (plan.step_seconds, max(plan.peak_memory))
        return self.cache[key]


def run_static(evaluate: Evaluator, boundaries: tuple[int, ...], limit: float) -> PolicyResult:
    """One partition for every batch; steps above ``limit`` bytes are counted as out of memory."""
    result = PolicyResult()
    for index in range(len(evaluate.batches)):
        seconds, peak = evaluate(boundaries, index)
        result.seconds += seconds
        result.out_of_memory_steps += peak > limit * (1 + 1e-9)
    return result


def run_elastic(
    evaluate: Evaluator, limit: float, config: TriggerConfig, recent_steps: int, bandwidth: float, gap: float
) -> PolicyResult:
    """Plan every batch exactly; migrate when the trigger says so (cost added to that step)."""
    model, stages = evaluate.model, evaluate.stages
    result = PolicyResult()
    current: tuple[int, ...] | None = None
    for index, batch in enumerate(evaluate.batches):
        best = plan_partition(
            model, batch, "1f1b", stages, limit, candidates=[current] if current else (), relative_gap=gap
        )
        result.planning_seconds.append(best.planning_seconds)
        if current is None:  # initial placement: free, as for the static policies
            current = best.boundaries
        seconds, peak = evaluate(current, index)
        coming = [StepPrediction(seconds, best.step_seconds)]
        recent = [
            StepPrediction(evaluate(current, j)[0], evaluate(best.boundaries, j)[0])
            for j in range(max(0, index - recent_steps), index)
        ]
        migration = estimate_migration(model, current, best.boundaries, bandwidth=bandwidth)
        decision = decide_repartition(
            config,
            index,
            migration.seconds,
            coming,
            recent,
            candidate_differs=best.boundaries != current,
            current_fits=peak <= limit * (1 + 1e-9),
        )
        if decision.migrate:
            current = best.boundaries
            seconds = best.step_seconds + migration.seconds
            result.migrations += 1
            result.migration_seconds += migration.seconds
        result.seconds += seconds
        result.partitions.append(current)
    return result


def longest_batch(batches: list[tuple[int, ...]]) -> int:
    """Index of the batch holding the longest sequence (ties: more tokens)."""
    return max(range(len(batches)), key=lambda i: (max(batches[i]), sum(batches[i])))


def cost_sources(args: argparse.Namespace) -> dict[str, dict[str, CostModel]]:
    """Cost models per source: the FLOP model, and with ``--profile`` the GPU-measured one."""
    sources = {"FLOP": {name: make() for name, make in MODELS.items()}}
    if args.profile:
        from benchmarks.gpu.profile_blocks import load_measured_models

        args.profile_device, sources["measured"] = load_measured_models(args.profile)
    return sources


def run_configuration(
    trace: str, lengths: list[tuple[int, ...]], model_name: str, stages: int, args: argparse.Namespace,
    costs: str = "FLOP", models: dict[str, CostModel] | None = None,
) -> Row:
    """One (trace, model, stages) row: plan the static partition, run the three policies."""
    limit = args.memory_gib * GIB
    batches = [split_microbatches(batch, args.microbatches_per_stage * stages) for batch in lengths]
    longest = batches[longest_batch(lengths)]
    recompute = False
    model = (models or {name: make() for name, make in MODELS.items()})[model_name]
    try:
        static_plan = plan_partition(model, longest, "1f1b", stages, limit)
    except ValueError:
        recompute = True
        model = model.with_full_recompute()
        static_plan = plan_partition(model, longest, "1f1b", stages, limit)
    evaluate = Evaluator(model, batches, stages)
    config = TriggerConfig(mode="auto", margin=args.margin, horizon_steps=args.horizon)
    return Row(
        trace=trace,
        model=model_name,
        costs=costs,
        stages=stages,
        recompute=recompute,
        tokens=sum(sum(batch) for batch in lengths),
        longest=[max(batch) for batch in lengths],
        elastic=run_elastic(evaluate, limit, config, args.recent, args.migration_bandwidth, args.gap),
        static=run_static(evaluate, static_plan.boundaries, limit),
        uniform=run_static(evaluate, uniform_partition(model.num_blocks, stages), limit),
    )


def render(rows: list[Row], args: argparse.Namespace, wall: float) -> None:
    """Print the table and how the benchmark was run."""
    console = Console(width=160)
    table = Table(title="Simulated throughput, 1F1B, tokens/s (higher is better)")
    for column in (
        "trace",
        "model",
        "costs",
        "stages",
        "recompute",
        "elastic tok/s",
        "static tok/s",
        "uniform tok/s",
        "vs static",
        "vs uniform",
        "migrations",
        "migr. s",
        "plan ms (mean/max)",
        "OOM static/unif.",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        elastic, static, uniform = (row.throughput(p) for p in (row.elastic, row.static, row.uniform))
        planning = row.elastic.planning_seconds
        table.add_row(
            row.trace,
            row.model,
            row.costs,
            str(row.stages),
            "yes" if row.recompute else "no",
            f"{elastic:,.0f}",
            f"{static:,.0f}",
            f"{uniform:,.0f}",
            f"{elastic / static:.3f}x",
            f"{elastic / uniform:.3f}x",
            f"{row.elastic.migrations}/{len(planning)}",
            f"{row.elastic.migration_seconds:.2f}",
            f"{1e3 * sum(planning) / len(planning):.0f}/{1e3 * max(planning):.0f}",
            f"{row.static.out_of_memory_steps}/{row.uniform.out_of_memory_steps}",
        )
    console.print(table)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    for costs in dict.fromkeys(r.costs for r in rows):
        some = [r for r in rows if r.costs == costs]
        console.print(
            f"mean speedup of elastic ({costs} costs): {mean([r.throughput(r.elastic) / r.throughput(r.static) for r in some]):.3f}x "
            f"vs static, {mean([r.throughput(r.elastic) / r.throughput(r.uniform) for r in some]):.3f}x vs uniform"
        )
    console.print(
        f"run: python benchmarks/simulated_repartition.py {' '.join(sys.argv[1:])}  |  {args.batches} batches per "
        f"trace, seed {args.seed}, {args.memory_gib:g} GiB, migration bandwidth {args.migration_bandwidth:.3g} B/s, "
        f"trigger margin {args.margin}, horizon {args.horizon}, recent {args.recent}, gap {args.gap}  |  "
        f"{platform.python_version()}, {platform.machine()}, wall {wall:.1f} s"
    )
    console.print(
        "costs: FLOP = planning.gpt's analytic model (A100-class 312 TFLOP/s at 50%)"
        + (f"; measured = blocks and head measured on {args.profile_device} ({args.profile})" if args.profile else "")
    )


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run every configuration, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=32, help="batches per trace (run time is about linear)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="1.3b,7b")
    parser.add_argument("--stages", default="4,8")
    parser.add_argument("--traces", default="flan,github")
    parser.add_argument("--microbatches-per-stage", type=int, default=2)
    parser.add_argument("--memory-gib", type=float, default=80.0)
    parser.add_argument("--migration-bandwidth", type=float, default=50e9, help="bytes per second")
    parser.add_argument("--margin", type=float, default=0.25)
    parser.add_argument("--horizon", type=int, default=16)
    parser.add_argument("--recent", type=int, default=4)
    parser.add_argument("--gap", type=float, default=0.0, help="planner relative gap (0: exact)")
    parser.add_argument("--quick", action="store_true", help="one small configuration (smoke test)")
    parser.add_argument("--plot", help="PNG of the first configuration's elastic partitions over the batches")
    parser.add_argument(
        "--profile", help="a GPU profile from benchmarks/gpu/profile_blocks.py: adds rows priced by its measured costs"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.models, args.stages, args.traces = 6, "1.3b", "4", "flan"
    started = time.perf_counter()
    workloads = traces(args.batches, args.seed)
    rows = [
        run_configuration(trace, workloads[trace], model, int(stages), args, costs, models)
        for costs, models in cost_sources(args).items()
        for trace in args.traces.split(",")
        for model in args.models.split(",")
        for stages in args.stages.split(",")
    ]
    render(rows, args, time.perf_counter() - started)
    if args.plot:
        row = rows[0]
        plot_partitions(
            range(len(row.longest)), row.elastic.partitions, args.plot, values=row.longest,
            value_label="longest sequence (tokens)", step_label="batch",
            title=f"elastic partitions per batch: {row.trace}-like trace, GPT {row.model}, {row.stages} stages, 1F1B",
        )
        print(f"wrote {args.plot}")
    assert all(math.isfinite(r.elastic.seconds) for r in rows)


if __name__ == "__main__":
    main()
