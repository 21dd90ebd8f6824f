"""What planning costs on a real run, per planner: its time on the step's critical path and beside it.

A real 2-process CPU run (gloo, 1 thread each) of ``bench_varlen``'s decoder LM on its long-tailed,
right-padded length trace, with the chosen planner callbacks (``--planners``, each with its
defaults and lookahead on). Per batch it reads the strategy's step clock on every rank and reports the largest value of each part
(the slowest rank's): ``plan_s``, the planning the step waited for (planner callbacks' work on the critical
path: ``pipeline/time/plan_s`` of ``PipelineMonitor``), ``apply_s``, merging the proposals and
installing the plan, migrations included (``pipeline/time/apply_s``: what the plan costs to put in
place, which the planners price as migration, not planning), ``sync_s``, waiting at the collective
that hands the planning rank's plan to the others (``pipeline/time/plan_sync_s``: mostly ranks
arriving at different times, which the step's first transfer would otherwise absorb; shown apart
and together with ``plan_s``: each rank's own plan and wait added, the larger of the ranks', since a
rank waiting for the planning rank has that planning inside its wait), ``beside_s``, planning done for this batch on lookahead threads while the batch before trained
(``pipeline/plan_background_s``), and the step from the batch's move to the end of the optimizer
step. Issue 18 asks for planning below 2% of the step and hidden by lookahead.

    python benchmarks/bench_planning.py                                  # every planner set, FLANv2-like
    python benchmarks/bench_planning.py --planners auto --steps 24 --trace github
    python benchmarks/bench_planning.py --planners repartition memory+switch

Planner sets: ``auto`` (``AutoPlanner``: partition, family, microbatches, memory jointly),
``repartition`` (``ElasticRepartition``), ``memory`` (``MemoryPlanner`` under ``--budget``),
``switch`` (``ScheduleSwitch("auto")``), and ``+`` joins them (``repartition+memory+switch``). The
first ``--warmup`` batches (cost probes, first plans, caches) are reported apart from the medians.
``sync`` is no planner: one empty broadcast from rank 0 at every batch start, timed as ``sync_s``. It is
the baseline of ``sync_s``: the ranks' skew that any collective at the batch start waits out (the last
rank of a 1F1B step finishes before the first), which without it the step's first receive waits out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_varlen import build_model, make_batches
from benchmarks.harness import run_ranks


class ClockReader(L.Callback):
    """Every rank keeps, per batch, its step clock's plan part, background plan and step; written at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[tuple[float, float, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        clock = trainer.strategy.step_clock
        step_s = time.perf_counter() - clock.started
        parts = clock.parts
        self.rows.append((parts.get("plan", 0.0), clock.background.get("plan", 0.0), step_s, parts.get("apply", 0.0),
                          parts.get("plan_sync", 0.0)))

    def on_train_end(self, trainer, pl_module) -> None:
        Path(f"{self.path}-rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


class BatchStartBroadcast(L.Callback):
    """No planning: the collective a planner's plan travels in (an empty broadcast from rank 0), timed as plan_sync."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with trainer.strategy.step_clock.measure("plan_sync"):
            trainer.strategy.broadcast(None, src=0)


def planners(spec: str, budget: str) -> list[L.Callback]:
    """The callbacks of one planner set (``repartition+memory``)."""
    from lightning_pipe.callbacks import AutoPlanner, ElasticRepartition, MemoryPlanner, ScheduleSwitch

    made = {
        "auto": lambda: AutoPlanner(budget=budget),
        "repartition": lambda: ElasticRepartition(),
        "memory": lambda: MemoryPlanner(budget=budget),
        "switch": lambda: ScheduleSwitch("auto"),
        "sync": BatchStartBroadcast,
    }
    unknown = set(spec.split("+")) - set(made)
    if unknown:
        raise SystemExit(f"--planners: unknown {sorted(unknown)}; use {sorted(made)} joined by '+'.")
    return [made[name]() for name in spec.split("+")]


def run_worker(args: argparse.Namespace) -> None:
    """Train with one planner set (this process and the one Lightning starts beside it)."""
    from lightning_pipe import ElasticPipelineStrategy

    torch.set_num_threads(1)
    reader = ClockReader(Path(args.out) / args.worker)
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=args.microbatches)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.warmup + args.steps, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[*planners(args.worker, args.budget), reader], use_distributed_sampler=False,
    )
    trainer.fit(build_model(args), torch.utils.data.DataLoader(make_batches(args), batch_size=None))


def summarize(spec: str, ranks: list[list[list[float]]], warmup: int) -> list[str]:
    """One table row: medians over the timed batches of the slowest rank's plan part, and so on."""
    rows = [[max(values) for values in zip(*per_batch)] for per_batch in zip(*ranks)]  # per batch: max over ranks
    first, timed = rows[:warmup], rows[warmup:]
    plan = statistics.median(r[0] for r in timed)
    beside = statistics.median(r[1] for r in timed)
    step = statistics.median(r[2] for r in timed)
    share = statistics.median(r[0] / r[2] for r in timed)
    apply = statistics.median(r[3] for r in timed)
    sync = statistics.median(r[4] for r in timed)
    # one rank's planning and its wait together, the larger of the ranks' (the others' planning is
    # inside a rank's wait: adding the largest of each would count it twice)
    both = [max(rank[0] + rank[4] for rank in per_batch) for per_batch in zip(*ranks)][warmup:]
    with_sync = statistics.median(b / r[2] for b, r in zip(both, timed))
    return [spec, f"{plan:.4f}", f"{share:.2%}", f"{sync:.4f}", f"{with_sync:.2%}", f"{beside:.4f}", f"{beside / step:.1%}",
            f"{apply:.4f}", f"{apply / step:.1%}", f"{step:.3f}", f"{max(r[0] for r in first):.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--planners", nargs="+", default=["sync", "repartition", "memory", "switch", "auto",
                                                          "repartition+memory+switch"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", default="48MiB", help="memory budget per rank for `memory` and `auto`")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--trace", choices=["flan", "github"], default="flan")
    parser.add_argument("--median", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    load_before = os.getloadavg()[0]
    table = Table(title=f"Planning time per batch on a {args.trace}-like trace (rank medians, slowest rank per batch)")
    for column in ("planners", "plan_s (critical path)", "of step", "sync_s", "plan+sync of step", "beside_s (lookahead)",
                   "of step", "apply_s",
                   "of step", "step_s", "first batches' plan_s"):
        table.add_column(column, justify="left" if column == "planners" else "right")
    names = ("steps", "warmup", "budget", "batch", "microbatches", "trace", "median", "max_len", "layers", "width",
             "heads", "seed")
    with tempfile.TemporaryDirectory() as out:
        for spec in args.planners:
            table.add_row(*summarize(spec, run_ranks(__file__, spec, out, args, names), args.warmup))
            print(f"done: {spec}", flush=True)
    console = Console(width=200)
    console.print(table)
    console.print(
        f"Medians over batches {args.warmup}..{args.warmup + args.steps - 1}; 'first batches' plan_s': the longest of "
        f"the first {args.warmup} (cost probes, first plans). How: `python {' '.join(sys.argv)}` on {os.cpu_count()} "
        f"CPU cores ({platform.machine()}), torch {torch.__version__}, gloo, 2 processes x 1 thread; 1-minute load "
        f"before {load_before:.2f}, after {os.getloadavg()[0]:.2f}.",
        markup=False,
    )


if __name__ == "__main__":
    main()
