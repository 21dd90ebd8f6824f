"""Wall seconds of the joint planner per batch on ``simulated_joint``'s configurations, for two checkouts.

For every configuration of ``benchmarks/simulated_joint.py`` (trace x model x stages x budget) it builds
that benchmark's runner (static plans, the budget) and times ``plan_joint`` on each batch of the trace,
with the static 1F1B plan as the plan in use, in a fresh process per (configuration, checkout) with a
time cap. With ``--before DIR`` (an older checkout, e.g. ``git archive <commit> | tar -x -C DIR``) each
configuration runs with both, one after the other, so both see the same machine load.

    python benchmarks/joint_planning_time.py --before /tmp/old --batches 4 --gap 0.02 --cap 300

Prints per configuration the mean and the largest seconds of one batch's plan, the stated gaps, and
whether the cap stopped it ("> cap": the batches it finished, the rest not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def worker(source: str, trace: str, model: str, stages: int, budget: str, batches: int, gap: float) -> None:
    """Time the joint plans of one configuration with the checkout at ``source``; one JSON line per batch."""
    sys.path.insert(0, str(Path(source) / "benchmarks"))
    sys.path.insert(0, source)
    import simulated_joint as sj

    from lightning_pipe.planning import flan_like_trace, github_like_trace

    args = argparse.Namespace(
        batches=batches, seed=0, budget_fraction=0.6, families="1f1b,zb_h1,interleaved_1f1b", microbatches_per_stage=2,
        memory_method="greedy", gap=gap, bandwidth=50e9,
    )
    lengths = (
        flan_like_trace(batches, batch_size=64, seed=0) if trace == "flan"
        else github_like_trace(batches, tokens_per_batch=262144, seed=0)
    ).batches
    runner = sj.Runner(list(lengths), model, stages, budget, args)
    runner.gaps, runner.planning = [], []
    running = runner.static["1f1b"]
    for batch in runner.batches:
        started = time.perf_counter()
        runner.joint(batch, running)
        print(json.dumps({"seconds": time.perf_counter() - started, "gap": runner.gaps[-1]}), flush=True)


def run(source: Path, job: tuple, args: argparse.Namespace) -> tuple[list[float], list[float], bool]:
    trace, model, stages, budget = job
    command = [
        sys.executable, __file__, "--worker", str(source), trace, model, str(stages), budget,
        "--batches", str(args.batches), "--gap", str(args.gap),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(source))
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.cap).stdout
        capped = False
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else (stopped.stdout or "")
        capped = True
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["seconds"] for r in rows], [r["gap"] for r in rows], capped


def cell(seconds: list[float], gaps: list[float], capped: bool, cap: float) -> str:
    if not seconds:
        return f"> {cap:.0f} s for the first batch"
    text = f"{sum(seconds) / len(seconds):.1f} / {max(seconds):.1f} (gap {max(gaps):.3f})"
    return text + (f", {len(seconds)} batches in {cap:.0f} s" if capped else "")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("source")
        parser.add_argument("trace")
        parser.add_argument("model")
        parser.add_argument("stages", type=int)
        parser.add_argument("budget")
        parser.add_argument("--batches", type=int)
        parser.add_argument("--gap", type=float)
        a = parser.parse_args(sys.argv[2:])
        worker(a.source, a.trace, a.model, a.stages, a.budget, a.batches, a.gap)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="an older checkout to time as well")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--cap", type=float, default=300.0, help="seconds one configuration may take per checkout")
    parser.add_argument("--models", default="1.3b,7b")
    parser.add_argument("--stages", default="4,8")
    parser.add_argument("--traces", default="flan,github")
    parser.add_argument("--budgets", default="none,tight")
    args = parser.parse_args()
    jobs = [
        (t, m, int(s), b) for s in args.stages.split(",") for m in args.models.split(",")
        for t in args.traces.split(",") for b in args.budgets.split(",")
    ]
    header = "| trace | model | stages | budget | " + ("before: s per batch mean / max | " if args.before else "")
    print(header + "after: s per batch mean / max |")
    print("|---" * (header.count("|")) + "|")
    for job in jobs:
        line = f"| {job[0]} | {job[1]} | {job[2]} | {job[3]} | "
        if args.before:
            line += cell(*run(args.before.resolve(), job, args), args.cap) + " | "
        line += cell(*run(HERE, job, args), args.cap) + " |"
        print(line, flush=True)
    print(
        f"How: python {' '.join(sys.argv)} on {os.cpu_count()} CPU cores ({platform.machine()}), one process at a time, "
        f"1-minute load at the end {os.getloadavg()[0]:.2f}."
    )


if __name__ == "__main__":
    main()
