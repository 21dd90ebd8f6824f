"""Simulated throughput of the joint planner against static plans, each lever alone, and the levers in sequence.

For each length trace (FLANv2-like, GitHub-like), GPT model (1.3B, 7B: ``planning.gpt``'s analytic
costs, A100-class), pipeline depth (4 and 8 stages) and memory budget (``none``: no limit; ``tight``:
a budget that binds, 60% of what the trace's longest batch needs without recomputation under the
static plan, raised by 10% steps until the static plan with full recomputation fits that batch), every batch's step time is the
simulated makespan (``schedules.simulate``; recompute and offload stalls from
``planning.memory_planner``; memory from ``planning.memory_model.predict_memory``) under:

- ``static``: 1F1B, ``2 x stages`` even microbatches, the exact best partition for the trace's
  longest batch under the budget (with full recomputation of every block when nothing fits without);
- ``repartition``: per batch the exact best partition (``plan_partition``) under the budget, with
  the static rule for recomputation (none, or full when nothing fits without);
- ``family``: per batch the fastest family among ``--families``, each with its static partition;
- ``memory``: the static partition and family, per batch the fastest memory plan under the budget
  (``plan_memory``: full recompute and offload per stage and microbatch);
- ``microbatch``: the static plan with microbatches sized by work (``balance_microbatch_sizes``)
  when that is faster;
- ``sequential``: the three callbacks one after the other, as a user would chain them:
  repartition (for the running family), then the family (partition kept when its stage count
  fits, else that family's static partition), then the memory plan for the result;
- ``joint``: ``planning.joint.plan_joint`` (partition x family x even/balanced microbatches x memory
  plan) with the plan in use priced too.

Every adaptive policy moves to its new plan only when the gain on the batch exceeds the migration
(bytes of units that change rank on the busiest rank over the 50 GB/s link), and pays the
migration in that step. Throughput is tokens per simulated second over the trace. A ``static`` step
that exceeds the budget counts as OOM (its time still counted).

How it was run (numbers in docs/joint-planning.md and the README)::

    python benchmarks/simulated_joint.py --batches 4 --gap 0.02 --workers 1 --markdown --plot docs/img/joint_planner.png

on 2 CPU cores shared with other jobs; it prints its wall time and, per row, the joint planner's
wall seconds per batch (mean / max). ``--quick`` runs one small configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pickle
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from lightning_pipe.planning import (  # noqa: E402
    CostModel,
    MemoryPlan,
    flan_like_trace,
    github_like_trace,
    gpt_1_3b,
    gpt_7b,
    plan_partition,
)
from lightning_pipe.planning.joint import (  # noqa: E402
    JointConfig,
    evaluate_plan,
    memory_profile_from_cost_model,
    plan_joint,
    plan_migration_seconds,
)
from lightning_pipe.planning.memory_model import predict_memory  # noqa: E402
from lightning_pipe.planning.microbatching import (  # noqa: E402
    balance_microbatch_sizes,
    even_microbatch_sizes,
    microbatch_shapes,
    sample_costs,
)
from lightning_pipe.planning.plan import PipelinePlan  # noqa: E402
from lightning_pipe.schedules import resolve_schedule  # noqa: E402

GIB = 2**30
MODELS = {"1.3b": gpt_1_3b, "7b": gpt_7b}
POLICIES = ("static", "repartition", "family", "memory", "microbatch", "sequential", "joint")
SINGLE = ("repartition", "family", "memory", "microbatch")
LIMIT = 5.0  # seconds a partition search under the budget may take (as the joint planner's default)


@dataclass
class Policy:
    """What one policy did over a trace."""

    seconds: float = 0.0
    migrations: int = 0
    out_of_memory: int = 0
    plans: list = field(default_factory=list)


@dataclass
class Row:
    """One configuration's results."""

    trace: str
    model: str
    stages: int
    budget: str
    budget_gib: float
    tokens: int
    policies: dict
    gaps: list
    planning_seconds: list

    def throughput(self, name: str) -> float:
        """Tokens per simulated second."""
        return self.tokens / self.policies[name].seconds


def migration_seconds(model: CostModel, old: PipelinePlan | None, new: PipelinePlan, ranks: int, bandwidth: float) -> float:
    """Seconds of moving between plans (``planning.joint.plan_migration_seconds``)."""
    return plan_migration_seconds(model, old, new, ranks, bandwidth)


class Runner:
    """One configuration: the static plans, the budget, and each policy over the batches."""

    def __init__(self, trace: list[tuple[int, ...]], model_name: str, stages: int, budget: str, args: argparse.Namespace):
        self.batches, self.stages, self.args = trace, stages, args
        self.model = MODELS[model_name]()
        self.recompute_model = self.model.with_full_recompute()
        self.profile = memory_profile_from_cost_model(self.model)
        self.count = args.microbatches_per_stage * stages
        self.families = tuple(args.families.split(","))
        self.config = JointConfig(
            families=self.families, microbatch_counts=(self.count,), memory_method=args.memory_method,
            relative_gap=args.gap,
        )
        longest = max(range(len(trace)), key=lambda i: (max(trace[i]), sum(trace[i])))
        self.longest = trace[longest]
        self.limit = None if budget == "none" else self._tight_budget()
        static = {f: self._static_plan(f) for f in self.families}
        self.static = {f: plan for f, plan in static.items() if plan is not None}  # families that fit at all
        self.families = tuple(self.static)
        self.config = dataclasses.replace(self.config, families=self.families)

    def shapes(self, lengths, sizes=None):
        return microbatch_shapes(lengths, sizes or even_microbatch_sizes(len(lengths), self.count))

    def _tight_budget(self) -> float:
        shapes = self.shapes(self.longest)
        free = plan_partition(self.model, shapes, "1f1b", self.stages)
        program = resolve_schedule("1f1b").build(self.stages, len(shapes))
        need = max(predict_memory(program, free.boundaries, shapes, MemoryPlan(), self.profile).peak_bytes)
        fraction = self.args.budget_fraction
        while True:  # until the static rule (1F1B, full recompute if needed) fits the longest batch
            self.limit = fraction * need
            static = self._static_plan("1f1b")
            if static is not None and math.isfinite(self.price(self.longest, static)[0]):
                return self.limit
            fraction += 0.1

    def _static_plan(self, family: str) -> PipelinePlan | None:
        """The best plan of ``family`` for the longest batch, full recompute when nothing fits without
        (None when nothing is found)."""
        shapes = self.shapes(self.longest)
        for model, memory in ((self.model, None), (self.recompute_model, MemoryPlan.from_options("full"))):
            try:
                boundaries = plan_partition(model, shapes, family, self.stages, self.limit, time_limit=LIMIT).boundaries
            except ValueError:  # nothing fits with this memory plan: try the next
                continue
            return PipelinePlan(boundaries, family, len(shapes), memory)
        return None

    def price(self, lengths, plan: PipelinePlan, plan_memory: bool = False) -> tuple[float, PipelinePlan]:
        """Step seconds of ``plan`` on a batch (inf if it does not fit); with ``plan_memory`` the best
        memory plan for its partition replaces its own."""
        count = min(self.count, len(lengths))
        if plan.num_microbatches != count and plan.microbatch_sizes is None:
            plan = PipelinePlan(plan.boundaries, plan.schedule, count, plan.memory)
        return evaluate_plan(
            self.model, lengths, plan, self.stages, self.limit, profile=self.profile, config=self.config,
            plan_memory_too=plan_memory,
        )

    def static_rule(self, lengths, boundaries, family) -> tuple[float, PipelinePlan]:
        """No recompute if it fits, else full recompute (the static memory rule)."""
        plan = PipelinePlan(boundaries, family, self.count)
        seconds, plan = self.price(lengths, plan)
        if math.isfinite(seconds):
            return seconds, plan
        return self.price(lengths, PipelinePlan(boundaries, family, self.count, MemoryPlan.from_options("full")))

    # --- policies: each returns (seconds, plan) for one batch given the running plan ---

    def repartition(self, lengths, running: PipelinePlan, family: str | None = None) -> tuple[float, PipelinePlan]:
        family = family or running.schedule.name
        shapes = self.shapes(lengths)
        for model in (self.model, self.recompute_model):
            try:
                boundaries = plan_partition(
                    model, shapes, family, self.stages, self.limit, relative_gap=self.args.gap, time_limit=LIMIT
                ).boundaries
            except ValueError:
                continue
            seconds, plan = self.static_rule(lengths, boundaries, family)
            if math.isfinite(seconds):
                return seconds, plan
        return math.inf, running

    def family(self, lengths, running: PipelinePlan) -> tuple[float, PipelinePlan]:
        return min((self.price(lengths, self.static[f]) for f in self.families), key=lambda r: r[0])

    def memory(self, lengths, running: PipelinePlan) -> tuple[float, PipelinePlan]:
        base = self.static["1f1b"]
        return self.price(lengths, PipelinePlan(base.boundaries, base.schedule, self.count), plan_memory=True)

    def microbatch(self, lengths, running: PipelinePlan) -> tuple[float, PipelinePlan]:
        base = self.static["1f1b"]
        sizes = balance_microbatch_sizes(sample_costs(lengths, self.model), self.count)
        balanced = PipelinePlan(base.boundaries, base.schedule, len(sizes), base.memory, sizes)
        return min(self.price(lengths, base), self.price(lengths, balanced), key=lambda r: r[0])

    def sequential(self, lengths, running: PipelinePlan) -> tuple[float, PipelinePlan]:
        seconds, plan = self.repartition(lengths, running)  # ElasticRepartition, for the running family
        options = []
        for f in self.families:  # ScheduleSwitch("auto"): the partition kept when its stage count fits
            same = resolve_schedule(f).stages_per_rank == plan.schedule.stages_per_rank
            candidate = PipelinePlan(plan.boundaries if same else self.static[f].boundaries, f, self.count, plan.memory)
            options.append(self.price(lengths, candidate))
        _, chosen = min(options, key=lambda r: r[0])
        return self.price(lengths, PipelinePlan(chosen.boundaries, chosen.schedule, self.count), plan_memory=True)  # MemoryPlanner

    def joint(self, lengths, running: PipelinePlan) -> tuple[float, PipelinePlan]:
        result = plan_joint(
            self.model, lengths, self.stages, self.limit, profile=self.profile, config=self.config, current=running,
            partitions=[p.boundaries for p in self.static.values()],
            migration=lambda plan: migration_seconds(self.model, running, plan, self.stages, self.args.bandwidth),
        )
        self.gaps.append(result.gap)
        self.planning.append(result.planning_seconds)
        return result.step_seconds, result.plan

    def run(self, name: str) -> Policy:
        policy = Policy()
        running = self.static["1f1b"]
        self.gaps, self.planning = [], []
        for lengths in self.batches:
            if name == "static":
                seconds, plan = self.price(lengths, running)
                if not math.isfinite(seconds):
                    policy.out_of_memory += 1
                    seconds, _ = evaluate_plan(self.model, lengths, running, self.stages, None, profile=self.profile,
                                               config=self.config, plan_memory_too=False)
            else:
                seconds, plan = getattr(self, name)(lengths, running)
                keep, kept_plan = self.price(lengths, running, plan_memory=name in ("memory", "sequential", "joint"))
                move = migration_seconds(self.model, running, plan, self.stages, self.args.bandwidth)
                if plan.boundaries == running.boundaries and plan.schedule.stages_per_rank == running.schedule.stages_per_rank:
                    move = 0.0
                if math.isfinite(keep) and keep <= seconds + move:
                    seconds, plan = keep, kept_plan
                else:
                    seconds += move
                    policy.migrations += move > 0
            policy.seconds += seconds
            policy.plans.append(plan)
            running = PipelinePlan(plan.boundaries, plan.schedule, self.count, plan.memory)
        return policy


def run_configuration(job: tuple) -> Row:
    """One (trace, model, stages, budget) row."""
    trace_name, lengths, model_name, stages, budget, args = job
    runner = Runner(lengths, model_name, stages, budget, args)
    policies = {name: runner.run(name) for name in POLICIES}
    return Row(
        trace_name, model_name, stages, budget, 0.0 if runner.limit is None else runner.limit / GIB,
        sum(sum(b) for b in lengths), policies, list(runner.gaps), list(runner.planning),
    )


def render(rows: list[Row], args: argparse.Namespace, wall: float) -> None:
    """Print the table, the goal check and how it was run."""
    console = Console(width=200)
    table = Table(title="Simulated throughput, tokens/s (higher is better); speedups of joint")
    for column in ("trace", "model", "stages", "budget", *POLICIES, "joint / best single", "joint / best other", "gap max", "plan s mean / max"):
        table.add_column(column, justify="right")
    met = True
    markdown = ["| " + " | ".join(column.header for column in table.columns) + " |", "|" + "---|" * len(table.columns)]
    for row in rows:
        values = {name: row.throughput(name) for name in POLICIES}
        valid = {name: v for name, v in values.items() if _fits(row, name)}  # policies that met the budget
        single = max((valid[name] for name in SINGLE if name in valid), default=0.0)
        other = max((v for name, v in valid.items() if name != "joint"), default=0.0)
        binds = row.budget != "none"
        joint = valid.get("joint", 0.0)
        goal = joint > 0 and joint >= other * (1 - 1e-9) and (not binds or joint >= 1.1 * single)
        met &= goal
        cells = [_cell(row, name, values[name]) for name in POLICIES]
        line = [
            row.trace, row.model, str(row.stages), "none" if not binds else f"{row.budget_gib:.1f} GiB", *cells,
            _ratio(joint, single), _ratio(joint, other) + ("" if goal else " *"),
            f"{max(row.gaps):.3f}",
            f"{sum(row.planning_seconds) / len(row.planning_seconds):.1f} / {max(row.planning_seconds):.1f}",
        ]
        table.add_row(*line)
        markdown.append("| " + " | ".join(line) + " |")
    console.print(table)
    if args.markdown:
        print("\n".join(markdown))
    console.print(
        "OOM: a step no plan of that policy fit in the budget (static: time counted as if memory were larger; "
        "others: no time, the policy cannot run the trace). Speedups compare policies that fit every step."
    )
    console.print(
        "goal (joint never slower than any other policy, and >= 1.1x the best single lever where the budget binds): "
        + ("met in every row" if met else "NOT met in the rows marked *")
    )
    console.print(
        f"run: python benchmarks/simulated_joint.py {' '.join(sys.argv[1:])}  |  {args.batches} batches per trace, seed "
        f"{args.seed}, {args.microbatches_per_stage} microbatches per stage, families {args.families}, memory "
        f"{args.memory_method}, partition gap {args.gap}  |  {platform.python_version()}, {platform.machine()}, wall {wall:.0f} s"
    )


def _fits(row: Row, name: str) -> bool:
    policy = row.policies[name]
    return policy.out_of_memory == 0 and math.isfinite(policy.seconds)


def _cell(row: Row, name: str, value: float) -> str:
    policy = row.policies[name]
    if not math.isfinite(policy.seconds):
        return "OOM"
    return f"{value:,.0f}" + (f" ({policy.out_of_memory} OOM)" if policy.out_of_memory else "")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if a > 0 and b > 0 else "-"


def plot(rows: list[Row], path: Path) -> None:
    """Bars of each policy's throughput relative to static, one group per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4.5))
    width = 0.8 / len(POLICIES)
    for k, name in enumerate(POLICIES):
        values = [row.throughput(name) / row.throughput("static") if _fits(row, name) else 0.0 for row in rows]
        ax.bar([i + k * width for i in range(len(rows))], values, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    labels = [f"{r.trace}\n{r.model} S={r.stages}\n{'no limit' if r.budget == 'none' else f'{r.budget_gib:.0f} GiB'}" for r in rows]
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("throughput / static (0: does not fit)")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.legend(fontsize=7, ncol=len(POLICIES))
    ax.set_title("Joint planner vs static, single levers and their sequence (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _read_rows(path: Path) -> list[Row]:
    rows = []
    with open(path, "rb") as f:
        while True:
            try:
                rows.append(pickle.load(f))
            except EOFError:
                return rows


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run every configuration (in ``--workers`` processes), print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=6, help="batches per trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="1.3b,7b")
    parser.add_argument("--stages", default="4,8")
    parser.add_argument("--traces", default="flan,github")
    parser.add_argument("--budgets", default="none,tight")
    parser.add_argument("--budget-fraction", type=float, default=0.6)
    parser.add_argument("--families", default="1f1b,zb_h1,interleaved_1f1b")
    parser.add_argument("--microbatches-per-stage", type=int, default=2)
    parser.add_argument("--memory-method", default="greedy", choices=("greedy", "milp"))
    parser.add_argument("--gap", type=float, default=0.01, help="partition planner relative gap")
    parser.add_argument("--bandwidth", type=float, default=50e9, help="migration bytes per second")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one small configuration (smoke test)")
    parser.add_argument("--plot", type=Path, help="PNG of throughput relative to static")
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    parser.add_argument("--save", type=Path, help="append every finished row to this file (pickle lines)")
    parser.add_argument(
        "--load", type=Path, nargs="*", help="render and plot saved rows instead of running (later files replace rows)"
    )
    args = parser.parse_args(argv)
    if args.load:
        latest = {}  # a row saved again later (a re-run of one configuration) replaces the earlier one
        for path in args.load:
            for row in _read_rows(path):
                latest[(row.trace, row.model, row.stages, row.budget)] = row
        rows = list(latest.values())
        render(rows, args, 0.0)
        if args.plot:
            plot(rows, args.plot)
            print(f"wrote {args.plot}")
        return
    if args.quick:
        args.batches, args.models, args.stages, args.traces, args.workers = 2, "1.3b", "4", "flan", 1
    started = time.perf_counter()
    traces = {
        "flan": list(flan_like_trace(args.batches, batch_size=64, seed=args.seed).batches),
        "github": list(github_like_trace(args.batches, tokens_per_batch=262144, seed=args.seed).batches),
    }
    jobs = [
        (trace, traces[trace], model, int(stages), budget, args)
        for trace in args.traces.split(",")
        for model in args.models.split(",")
        for stages in args.stages.split(",")
        for budget in args.budgets.split(",")
    ]
    jobs.sort(key=lambda job: (job[3], job[2]))  # cheap configurations first
    rows = []
    with ProcessPoolExecutor(args.workers) if args.workers > 1 else nullcontext() as pool:
        for row in pool.map(run_configuration, jobs) if pool is not None else map(run_configuration, jobs):
            rows.append(row)
            if args.save:
                with open(args.save, "ab") as f:
                    pickle.dump(row, f)
            values = ", ".join(f"{name} {row.throughput(name):,.0f}" for name in POLICIES)
            print(f"done {row.trace} {row.model} S={row.stages} {row.budget}: {values} tok/s", flush=True)
    render(rows, args, time.perf_counter() - started)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
