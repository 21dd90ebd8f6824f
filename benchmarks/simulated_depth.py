"""Simulated throughput of elastic pipeline depth (FlexPipe) against fixed depth, and HBSA's cost.

Two parts.

**Throughput** (default). For each length trace (FLANv2-like: 64 sequences per batch; GitHub-like:
batches of 262,144 tokens), GPT model (1.3B, 7B: ``planning.gpt``'s analytic costs, A100-class
312 TFLOP/s at 50%, 50 GB/s links) and device count (8, 16, 80 GiB each), every batch is split into
``2 x devices`` microbatches of similar token counts and its step time is the event simulation of
the layout (``planning.layout_simulation.simulate_layout``: per-replica greedy 1F1B, ring
all-reduce of each stage's gradients among its replicas). Three policies:

- ``static``: the fewest stages dividing the device count whose uniform layout fits the trace's
  worst batch (uniform blocks, equal widths), never changed: a static framework sized for the
  longest batch. Full recomputation of every stage when no such depth fits.
- ``fixed``: the same depth and widths, boundaries re-chosen per batch by local search (one
  boundary by one block while the planner's estimate improves; moving pays its migration,
  amortized over ``--horizon`` steps): per-batch repartitioning at fixed depth.
- ``elastic``: ``planning.hbsa.decide_depth`` per batch (HBSA with tight bounds: the printed
  bounds explode on 16 devices, see ``search_bounds``; at most ``--max-candidates`` layouts
  priced per depth; memory plans = recomputation of
  the stages that do not fit, migration amortized over ``--horizon`` steps; the paper's single
  step is ``--horizon 1``).

A reconfiguration's seconds (``estimate_layout_migration``: parameters and Adam state the busiest
device receives or sends, at 50 GB/s) are added to the step that pays it. Throughput is real tokens
per simulated second over the trace.

**HBSA against brute force** (``--hbsa``). Table 2's rows (``planning.flexpipe_reference``)
replayed in order; for the rows whose brute force (every layout of the searched depths) finishes
in reasonable time, the wall-clock seconds of ``decide_depth(search="hbsa")`` and
``decide_depth(search="brute_force")`` on this machine, and the layouts priced.

All-reduces follow the paper's testbed (``--devices-per-node 4``: NVLink 300 GB/s inside a server,
InfiniBand 50 GB/s across; ``planning.layout_simulation.NodeTopology``). The column "bound vs
static" is static's seconds over ``lower_bound_seconds`` (no bubble, communication or recompute):
the most any depth policy could gain in this model. ``--flan-max-length 8192 --attention-memory
scores`` is the paper's regime (its maximum lengths; the attention-score memory its Fig. 3 implies).

How it was run (numbers in docs/repartitioning.md)::

    python benchmarks/simulated_depth.py --batches 32
    python benchmarks/simulated_depth.py --batches 32 --flan-max-length 8192 --attention-memory scores
    python benchmarks/simulated_depth.py --batches 32 --traces github --models 7b --devices 8 \
        --plot docs/img/depth_over_batches.png
    python benchmarks/simulated_depth.py --hbsa
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from lightning_pipe.planning import CostModel, MicrobatchShape, flan_like_trace, github_like_trace, gpt_1_3b, gpt_7b
from lightning_pipe.planning.depth_estimators import CostModelDepthEstimator
from lightning_pipe.planning.hbsa import decide_depth
from lightning_pipe.planning.layout import Layout, estimate_layout_migration, uniform_layout
from lightning_pipe.planning.layout_simulation import NodeTopology, simulate_layout
from lightning_pipe.planning.traces import split_microbatches
from lightning_pipe.planning.trigger import ResidenceHorizon

GIB = 2**30
MODELS = {"1.3b": gpt_1_3b, "7b": gpt_7b}


@dataclass
class PolicyResult:
    """What one policy did over a trace."""

    seconds: float = 0.0
    migrations: int = 0
    migration_seconds: float = 0.0
    memory_plans: int = 0
    out_of_memory_steps: int = 0
    planning_seconds: list[float] = field(default_factory=list)
    layouts: list[Layout] = field(default_factory=list)
    estimate_errors: list[float] = field(default_factory=list)


@dataclass
class Row:
    """One (trace, model, devices) line of the table."""

    trace: str
    model: str
    devices: int
    static_layout: Layout
    recompute: bool
    tokens: int
    longest: list[int]
    bound_seconds: float
    static: PolicyResult
    fixed: PolicyResult
    elastic: PolicyResult

    def throughput(self, policy: PolicyResult) -> float:
        """Real tokens per simulated second."""
        return self.tokens / policy.seconds


def traces(
    num_batches: int, seed: int, flan_batch_size: int = 64, flan_max_length: int = 65536
) -> dict[str, list[tuple[int, ...]]]:
    """The two workloads, deterministic by seed.

    The paper's own runs are FLANv2 with global batches of 4 (Fig. 8) to 64 (Fig. 9) sequences and
    maximum lengths 512 to 8192 (Fig. 8's x-axis, Table 2's mu); ``flan_batch_size`` and
    ``flan_max_length`` select that regime (the default, 64 sequences up to 65536 tokens, is its
    largest batch with a longer tail).
    """
    return {
        "flan": list(flan_like_trace(num_batches, batch_size=flan_batch_size, seed=seed, max_length=flan_max_length).batches),
        "github": list(github_like_trace(num_batches, tokens_per_batch=262144, seed=seed).batches),
    }


def lower_bound_seconds(model: CostModel, lengths: Sequence[int], devices: int) -> float:
    """Seconds no layout can beat on one batch: the larger of the batch's compute spread evenly over
    the devices and its longest sequence's forward and backward through every unit (a sequence is
    never cut and its units run one after another). No bubble, transfer, all-reduce or recompute:
    ``static / bound`` is the most any depth policy could gain over static in this model."""
    tables = model.tables([MicrobatchShape.from_lengths([length]) for length in lengths])
    per_sequence = tables.forward.sum(axis=0) + tables.backward.sum(axis=0)  # [sequence]
    return max(float(per_sequence.sum()) / devices, float(per_sequence.max()))


def static_layout(
    model: CostModel, batches: list[list[MicrobatchShape]], devices: int, limit: float
) -> tuple[Layout, bool]:
    """The shallowest uniform layout (depth dividing ``devices``) fitting every batch; recompute if none."""
    for recompute in (False, True):
        for depth in (d for d in range(1, min(devices, model.num_blocks) + 1) if devices % d == 0):
            layout = uniform_layout(model.num_blocks, devices, depth)
            flags = (recompute,) * depth
            if all(
                max(CostModelDepthEstimator(model, batch, devices, limit).memory(layout, flags)) <= limit
                for batch in batches
            ):
                return layout, recompute
    raise ValueError("no uniform layout fits the trace even with recomputation")


def run_static(
    model: CostModel, batches, layout: Layout, recompute: bool, limit: float, topology: NodeTopology | None
) -> PolicyResult:
    """One layout for every batch."""
    result = PolicyResult()
    flags = (recompute,) * layout.num_stages
    for batch in batches:
        simulated = simulate_layout(model, batch, layout, recompute=flags, topology=topology)
        result.seconds += simulated.step_seconds
        result.out_of_memory_steps += max(simulated.peak_memory) > limit * (1 + 1e-9)
        result.layouts.append(layout)
    return result


def run_fixed(
    model: CostModel, batches, start: Layout, recompute: bool, limit: float, horizon: int, topology: NodeTopology | None
) -> PolicyResult:
    """Same depth and widths; boundaries re-chosen per batch by local search (move one boundary by
    one block while the estimate, with the migration amortized over ``horizon`` steps, improves)."""
    result = PolicyResult()
    flags = (recompute,) * start.num_stages
    current = start
    residence = ResidenceHorizon(horizon)
    for batch in batches:
        started = time.perf_counter()
        estimator = CostModelDepthEstimator(model, batch, start.num_devices, limit, topology=topology)
        steps = residence.steps()

        def price(layout: Layout, estimator=estimator, current=current, steps=steps) -> float:
            if max(estimator.memory(layout, flags)) > limit:
                return math.inf
            return estimator.step_seconds(layout, flags) + estimator.migration_seconds(current, layout) / steps

        best, value = current, price(current)
        improved = True
        while improved:
            improved = False
            for stage in range(1, best.num_stages):
                for step in (-1, 1):
                    bounds = list(best.boundaries)
                    bounds[stage] += step
                    if not bounds[stage - 1] < bounds[stage] < bounds[stage + 1]:
                        continue
                    layout = Layout(tuple(bounds), best.widths)
                    cost = price(layout)
                    if cost < value * (1 - 1e-9):
                        best, value, improved = layout, cost, True
        result.planning_seconds.append(time.perf_counter() - started)
        residence.record(best != current)
        seconds = 0.0
        if best != current:
            moved = estimate_layout_migration(model, current, best).seconds
            seconds += moved
            result.migrations += 1
            result.migration_seconds += moved
            current = best
        simulated = simulate_layout(model, batch, current, recompute=flags, topology=topology)
        result.seconds += seconds + simulated.step_seconds
        result.out_of_memory_steps += max(simulated.peak_memory) > limit * (1 + 1e-9)
        result.layouts.append(current)
    return result


def run_elastic(
    model: CostModel,
    batches,
    start: Layout,
    limit: float,
    horizon: int,
    max_candidates: int,
    topology: NodeTopology | None,
) -> PolicyResult:
    """FMOP with HBSA per batch."""
    result = PolicyResult()
    current = start
    residence = ResidenceHorizon(horizon)
    for batch in batches:
        estimator = CostModelDepthEstimator(model, batch, start.num_devices, limit, topology=topology)
        started = time.perf_counter()
        decision = decide_depth(
            estimator, current, search="hbsa_tight", deeper=1, migration_horizon=residence.steps(),
            max_candidates=max_candidates,
        )
        result.planning_seconds.append(time.perf_counter() - started)
        residence.record(decision.layout != current)
        seconds = 0.0
        if decision.layout != current:
            moved = estimate_layout_migration(model, current, decision.layout).seconds
            seconds += moved
            result.migrations += 1
            result.migration_seconds += moved
            current = decision.layout
        plan = decision.memory_plan
        flags = tuple(s in plan.recompute_stages for s in range(current.num_stages))
        result.memory_plans += not plan.empty
        simulated = simulate_layout(model, batch, current, recompute=flags, topology=topology)
        predicted = estimator.step_seconds(current, flags if any(flags) else None)
        result.estimate_errors.append(abs(predicted - simulated.step_seconds) / simulated.step_seconds)
        result.seconds += seconds + simulated.step_seconds
        result.out_of_memory_steps += max(simulated.peak_memory) > limit * (1 + 1e-9)
        result.layouts.append(current)
    return result


def run_configuration(trace: str, lengths, model_name: str, devices: int, args: argparse.Namespace) -> Row:
    """One (trace, model, devices) row."""
    limit = args.memory_gib * GIB
    model = MODELS[model_name](flash_attention=args.attention_memory == "flash")
    batches = [split_microbatches(batch, args.microbatches_per_device * devices) for batch in lengths]
    topology = NodeTopology(args.devices_per_node) if args.devices_per_node else None
    layout, recompute = static_layout(model, batches, devices, limit)
    return Row(
        trace=trace,
        model=model_name,
        devices=devices,
        static_layout=layout,
        recompute=recompute,
        tokens=sum(sum(batch) for batch in lengths),
        longest=[max(batch) for batch in lengths],
        bound_seconds=sum(lower_bound_seconds(model, batch, devices) for batch in lengths),
        static=run_static(model, batches, layout, recompute, limit, topology),
        fixed=run_fixed(model, batches, layout, recompute, limit, args.horizon, topology),
        elastic=run_elastic(model, batches, layout, limit, args.horizon, args.max_candidates, topology),
    )


def render(rows: list[Row], args: argparse.Namespace, wall: float) -> None:
    """Print the table and how it was run."""
    console = Console(width=170)
    table = Table(title="Simulated throughput of elastic depth, tokens/s (higher is better)")
    for column in (
        "trace", "model", "devices", "static layout", "elastic tok/s", "fixed tok/s", "static tok/s",
        "vs static", "vs fixed", "bound vs static", "depths used", "reconfig.", "reconfig. s", "mem. plans", "plan ms (mean/max)",
        "estimate err.",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        elastic, fixed, static = (row.throughput(p) for p in (row.elastic, row.fixed, row.static))
        planning = row.elastic.planning_seconds
        depths = sorted({layout.num_stages for layout in row.elastic.layouts})
        errors = row.elastic.estimate_errors
        table.add_row(
            row.trace,
            row.model,
            str(row.devices),
            f"{row.static_layout.num_stages}x{row.static_layout.widths[0]}{' +rc' if row.recompute else ''}",
            f"{elastic:,.0f}",
            f"{fixed:,.0f}",
            f"{static:,.0f}",
            f"{elastic / static:.3f}x",
            f"{elastic / fixed:.3f}x",
            f"{row.static.seconds / row.bound_seconds:.2f}x",
            ",".join(map(str, depths)),
            f"{row.elastic.migrations}/{len(planning)}",
            f"{row.elastic.migration_seconds:.1f}",
            str(row.elastic.memory_plans),
            f"{1e3 * sum(planning) / len(planning):.0f}/{1e3 * max(planning):.0f}",
            f"{100 * sum(errors) / len(errors):.1f}%",
        )
    console.print(table)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    console.print(
        f"mean speed-up of elastic: {mean([r.throughput(r.elastic) / r.throughput(r.static) for r in rows]):.3f}x vs "
        f"static, {mean([r.throughput(r.elastic) / r.throughput(r.fixed) for r in rows]):.3f}x vs fixed-depth "
        f"repartitioning; fixed vs static {mean([r.throughput(r.fixed) / r.throughput(r.static) for r in rows]):.3f}x; "
        f"OOM steps elastic/fixed/static {sum(r.elastic.out_of_memory_steps for r in rows)}/"
        f"{sum(r.fixed.out_of_memory_steps for r in rows)}/{sum(r.static.out_of_memory_steps for r in rows)}"
    )
    console.print(
        f"run: python benchmarks/simulated_depth.py {' '.join(sys.argv[1:])}  |  {args.batches} batches per trace, "
        f"seed {args.seed}, FLAN batch {args.flan_batch_size} up to {args.flan_max_length} tokens, {args.attention_memory} attention memory, {args.devices_per_node or 'no'} devices per node, {args.memory_gib:g} GiB, {args.microbatches_per_device} microbatches per device, horizon "
        f"{args.horizon}, HBSA at most {args.max_candidates} layouts per depth  |  {platform.python_version()}, {platform.machine()}, wall {wall:.1f} s"
    )


def plot_depth(row: Row, path: str) -> None:
    """Depth (stages) and widths over batches for the elastic policy, with the batch's longest sequence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(len(row.elastic.layouts))
    figure, top = plt.subplots(figsize=(10, 4.2), dpi=120)
    top.step(steps, [layout.num_stages for layout in row.elastic.layouts], where="post", color="C0", label="elastic")
    static_label = f"static {row.static_layout.num_stages}x{row.static_layout.widths[0]}"
    static_label += " + recompute" if row.recompute else ""
    top.step(steps, [row.static_layout.num_stages] * len(steps), where="post", color="C3", ls="--", label=static_label)
    for index, layout in enumerate(row.elastic.layouts):
        if index == 0 or layout != row.elastic.layouts[index - 1]:
            top.annotate(
                "(" + ",".join(map(str, layout.widths)) + ")", (index, layout.num_stages), fontsize=7,
                xytext=(2, 4), textcoords="offset points",
            )  # fmt: skip
    top.set_xlabel("batch")
    top.set_ylabel("pipeline stages (depth)")
    top.set_ylim(0, max(layout.num_stages for layout in row.elastic.layouts) + 1.5)
    other = top.twinx()
    other.plot(steps, row.longest, color="0.6", lw=0.8, label="longest sequence")
    other.set_yscale("log")
    other.set_ylabel("longest sequence (tokens)")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(
        f"elastic depth per batch (widths in brackets): {row.trace}-like trace, GPT {row.model}, {row.devices} devices"
    )
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def run_hbsa_timing(args: argparse.Namespace) -> None:
    """Table 2 replayed: HBSA against brute force on the rows where brute force is tractable."""
    from lightning_pipe.planning.flexpipe_reference import TABLE_2, table2_estimator

    console = Console(width=150)
    table = Table(title="HBSA vs brute force (every layout of the searched depths), Table 2 rows, pure Python")
    for column in (
        "model",
        "mu",
        "current",
        "HBSA layout",
        "HBSA ms",
        "layouts",
        "brute ms",
        "layouts ",
        "brute layout",
        "speed-up",
        "T HBSA / T brute",
    ):
        table.add_column(column, justify="right")
    ratios = []
    current = None
    for row in TABLE_2:
        if current is None or current.num_blocks != row.model.num_blocks:
            current = uniform_layout(row.model.num_blocks, row.model.num_devices, 2)
        estimator = table2_estimator(row.model, row.max_length, row.peak_gb)
        repeats = 20
        started = time.perf_counter()
        for _ in range(repeats):
            bounded = decide_depth(estimator, current)
        hbsa_seconds = (time.perf_counter() - started) / repeats
        depths = [bounded.min_stages, bounded.min_stages - 1] if bounded.min_stages != current.num_stages else []
        brute_layouts = sum(
            math.comb(row.model.num_blocks - 1, d - 1) * math.comb(row.model.num_devices - 1, d - 1)
            for d in depths
            if d >= 1
        )
        if brute_layouts > args.brute_force_limit or not depths:
            table.add_row(
                row.model.name,
                str(row.max_length),
                str(current.widths),
                str(bounded.layout.widths),
                f"{1e3 * hbsa_seconds:.2f}",
                str(bounded.num_candidates),
                "-",
                f"{brute_layouts:,}",
                "-",
                "-",
                "-",
            )
            current = bounded.layout
            continue
        started = time.perf_counter()
        full = decide_depth(estimator, current, search="brute_force")
        brute_seconds = time.perf_counter() - started
        ratios.append(brute_seconds / hbsa_seconds)
        table.add_row(
            row.model.name, str(row.max_length), str(current.widths), str(bounded.layout.widths),
            f"{1e3 * hbsa_seconds:.2f}", str(bounded.num_candidates), f"{1e3 * brute_seconds:.0f}",
            f"{full.num_candidates:,}", str(full.layout.widths), f"{brute_seconds / hbsa_seconds:,.0f}x",
            f"{bounded.predicted_seconds / full.predicted_seconds:.3f}",
        )  # fmt: skip
        current = bounded.layout
    console.print(table)
    if ratios:
        console.print(
            f"mean speed-up over the timed rows: {sum(ratios) / len(ratios):,.0f}x (paper: 745 / 15 ms = 50x)"
        )
    console.print(f"run: python benchmarks/simulated_depth.py {' '.join(sys.argv[1:])}  |  {platform.python_version()}")


def main(argv: list[str] | None = None) -> None:
    """Parse the options and run the chosen part."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="1.3b,7b")
    parser.add_argument("--devices", default="8,16")
    parser.add_argument("--traces", default="flan,github")
    parser.add_argument("--flan-batch-size", type=int, default=64, help="sequences per FLAN-like batch (paper: 4-64)")
    parser.add_argument("--flan-max-length", type=int, default=65536, help="longest FLAN-like sequence (paper: 512-8192)")
    parser.add_argument(
        "--attention-memory", choices=("flash", "scores"), default="flash",
        help="flash: activations linear in tokens; scores: attention scores kept (5 a s^2 bytes per layer), "
        "the memory the paper's own numbers imply (Fig. 3: 290 GB for GPT-3.35B at 4k on 4 GPUs)",
    )
    parser.add_argument(
        "--devices-per-node", type=int, default=4,
        help="devices per server: all-reduce at 300 GB/s (NVLink) inside one, 50 GB/s (InfiniBand) across "
        "(the paper's testbed, Sec. 7.1); 0: 50 GB/s everywhere",
    )
    parser.add_argument("--microbatches-per-device", type=int, default=2)
    parser.add_argument("--memory-gib", type=float, default=80.0)
    parser.add_argument("--horizon", type=int, default=16, help="steps a reconfiguration is amortized over")
    parser.add_argument("--max-candidates", type=int, default=1000, help="HBSA layouts priced per depth at most")
    parser.add_argument("--plot", help="PNG of the first configuration's depth over batches")
    parser.add_argument("--quick", action="store_true", help="one small configuration (smoke test)")
    parser.add_argument("--hbsa", action="store_true", help="time HBSA against brute force on Table 2's rows")
    parser.add_argument("--brute-force-limit", type=int, default=300_000, help="skip rows with more layouts")
    args = parser.parse_args(argv)
    if args.hbsa:
        run_hbsa_timing(args)
        return
    if args.quick:
        args.batches, args.models, args.devices, args.traces = 6, "1.3b", "8", "flan"
    started = time.perf_counter()
    workloads = traces(args.batches, args.seed, args.flan_batch_size, args.flan_max_length)
    rows = [
        run_configuration(trace, workloads[trace], model, int(devices), args)
        for trace in args.traces.split(",")
        for model in args.models.split(",")
        for devices in args.devices.split(",")
    ]
    render(rows, args, time.perf_counter() - started)
    if args.plot:
        plot_depth(rows[0], args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
