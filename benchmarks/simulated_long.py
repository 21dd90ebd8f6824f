"""Simulated throughput on long, skewed sequences: padded 1F1B, per-batch repartition, InfiniPipe chunking.

GPT 7B (32 layers, h=4096; analytic costs of ``planning/gpt.py`` on an A100-class device, flash
attention), 4 pipeline stages, GitHub-like length traces (91.5% of sequences up to 8K tokens, 0.6%
of 64K or more holding 21.6% of the tokens; ``planning/traces.py``) truncated to a context length
of 32K, 64K or 128K, 256K tokens per batch. Every batch's step time is the simulated makespan
(``lightning_pipe.schedules.simulate``); throughput is real tokens per simulated second over the trace.
The token budget of one microbatch is the context length (the memory one longest sequence needs).
Every unit costs 1 ms more per microbatch (forward; 2 ms backward), so that cutting into more,
smaller microbatches has a price, as on real devices (InfiniPipe Fig. 13).

- ``padded 1f1b``: what static-shape pipelines run (``torch.distributed.pipelining``): sequences in
  loader order, as many per microbatch as fit the budget when padded to the batch's longest, every
  microbatch padded to it; uniform partition; 1F1B.
- ``repartition``: no padding (sequences whole, microbatches of near-equal tokens within the
  budget, ``split_microbatches``, the best of 1, 2, 4 and 8 per stage) and the best partition for
  each batch (``plan_partition`` within 1%, FlexPipe-style per-batch repartitioning); 1F1B.
- ``infinipipe``: workload-balanced chunks (Algorithm 1, ``planning/chunking.py``: long sequences
  cut into slices of equal time, short ones packed with the tails, token limit ``T_m``) scheduled
  with sliced 1F1B (backward last slice first, ``schedules/families/sliced_1f1b.py``), the slice
  number ``N`` tuned per batch (the fastest of 1..16 whose ``T_m`` fits the budget); uniform partition.

Not modelled here: memory (K/V context of slices, the dK/dV buffers of Eq. 5, adaptive checkpointing
under a budget: ``benchmarks/simulated_chunk_memory.py``), grouping into several pipelines (the
dynamic programming of §3.3.2), sequence parallelism. Also printed: Table 2's relative standard
deviations of chunk time and length, balancing time only vs time and length, for this cost model and
with its attention term scaled down (why the paper's numbers do not reproduce: docs/long_sequences.md).

    python benchmarks/simulated_long.py                  # the table (about a minute on 2 cores)
    python benchmarks/simulated_long.py --quick          # smoke test
    python benchmarks/simulated_long.py --quick --plot-chunks docs/img/long_chunks.png \
        --plot-timeline docs/img/long_sliced_timeline.png   # the pictures of docs/long_sequences.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from lightning_pipe.planning.chunking import ChunkPlan, chunk_batch, chunk_time_model, relative_std
from lightning_pipe.planning.cost_model import CostModel, LinearCost, MicrobatchShape
from lightning_pipe.planning.gpt import gpt_7b
from lightning_pipe.planning.partition import plan_partition
from lightning_pipe.planning.traces import github_like_trace, split_microbatches
from lightning_pipe.schedules import simulate
from lightning_pipe.schedules.families import one_f_one_b
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b

NUM_STAGES = 4
TOKENS_PER_BATCH = 262144
# seconds per unit and microbatch (forward; backward twice): what makes small microbatches and
# over-sliced sequences slower (launches, lower GEMM efficiency; InfiniPipe Fig. 13)
UNIT_OVERHEAD = 1e-3


def uniform_boundaries(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Equal block counts per stage."""
    return tuple(round(i * num_blocks / num_stages) for i in range(num_stages + 1))


def padded_1f1b(cost: CostModel, lengths: list[int], budget: int) -> float:
    """Seconds of one batch padded to its longest sequence, as many sequences per microbatch as fit."""
    longest = max(lengths)
    per_microbatch = max(1, budget // longest)
    shapes = []
    for start in range(0, len(lengths), per_microbatch):
        count = len(lengths[start : start + per_microbatch])
        shapes.append(MicrobatchShape(count, count * longest, float(count * longest * longest)))
    program = one_f_one_b(NUM_STAGES, len(shapes))
    return simulate(program, cost.stage_costs(uniform_boundaries(cost.num_blocks, NUM_STAGES), shapes), record_events=False).makespan


def repartition(cost: CostModel, lengths: list[int], budget: int) -> tuple[float, int]:
    """Seconds of one batch without padding under its best partition (1F1B), with the best number of
    microbatches of 1, 2, 4 and 8 per stage whose largest fits the budget; and that number."""
    best = None
    for count in (NUM_STAGES, 2 * NUM_STAGES, 4 * NUM_STAGES, 8 * NUM_STAGES):
        shapes = split_microbatches(lengths, count)
        if max(s.tokens for s in shapes) > budget and max(lengths) <= budget:
            continue
        seconds = plan_partition(cost, shapes, "1f1b", NUM_STAGES, relative_gap=0.01).step_seconds
        if best is None or seconds < best[0]:
            best = (seconds, len(shapes))
    assert best is not None, "no microbatch count fits the budget"
    return best


def chunked(cost: CostModel, lengths: list[int], budget: int, max_slices: int = 16) -> tuple[float, ChunkPlan]:
    """Seconds of one batch as workload-balanced chunks under sliced 1F1B, with the best slice number."""
    time_model = chunk_time_model(cost)
    boundaries = uniform_boundaries(cost.num_blocks, NUM_STAGES)
    best: tuple[float, ChunkPlan] | None = None
    for num_slices in range(1, max_slices + 1):
        plan = chunk_batch(lengths, num_slices, time_model)
        if plan.token_limit > budget:
            continue
        program = sliced_1f1b(NUM_STAGES, len(plan.chunks), plan.slices)
        seconds = simulate(program, cost.stage_costs(boundaries, plan.shapes), record_events=False).makespan
        if best is None or seconds < best[0]:
            best = (seconds, plan)
    assert best is not None, "no slice number fits the budget"
    return best


def table_2(
    cost: CostModel, batches: list[list[int]], num_slices: int, attention_scale: float = 1.0
) -> dict[str, tuple[float, float]]:
    """Mean RSD of chunk time and chunk length, balancing time only vs time and length; with
    ``attention_scale``, the cost model's quadratic (attention) term scaled (the sweep that shows
    where the RSDs come from, docs/long_sequences.md)."""
    base = chunk_time_model(cost)
    time_model = LinearCost(base.constant, base.per_token, base.per_squared_length * attention_scale)
    out = {}
    for name, balance_length in (("balance time", False), ("balance time & length", True)):
        times, lengths = [], []
        for batch in batches:
            plan = chunk_batch(batch, num_slices, time_model, balance_length=balance_length)
            times.append(relative_std([time_model.evaluate(c.shape) for c in plan.chunks]))
            lengths.append(relative_std([c.tokens for c in plan.chunks]))
        out[name] = (100 * statistics.mean(times), 100 * statistics.mean(lengths))
    return out


def run(num_batches: int, contexts: list[int], plot: tuple[Path | None, Path | None]) -> None:
    from rich.console import Console
    from rich.table import Table

    started = time.perf_counter()
    cost = gpt_7b(unit_overhead_seconds=UNIT_OVERHEAD)
    trace = github_like_trace(num_batches, tokens_per_batch=TOKENS_PER_BATCH, max_length=131072, seed=0)
    table = Table(title=f"GPT 7B, {NUM_STAGES} stages, GitHub-like batches of {TOKENS_PER_BATCH} tokens (simulated)")
    for column in ("context", "policy", "tokens/s", "vs padded", "microbatches", "slices N"):
        table.add_column(column, justify="right")
    example = None
    for context in contexts:
        batches = [[min(n, context) for n in batch] for batch in trace.batches]
        tokens = sum(sum(b) for b in batches)
        padded = sum(padded_1f1b(cost, b, context) for b in batches)
        flexible = [repartition(cost, b, context) for b in batches]
        flex = sum(r[0] for r in flexible)
        results = [chunked(cost, b, context) for b in batches]
        chunk_seconds = sum(r[0] for r in results)
        rows = [
            ("padded 1f1b", padded, statistics.mean(len(range(0, len(b), max(1, context // max(b)))) for b in batches), "-"),
            ("repartition", flex, statistics.mean(r[1] for r in flexible), "-"),
            ("infinipipe", chunk_seconds, statistics.mean(len(r[1].chunks) for r in results),
             f"{statistics.mean(len(r[1].mesh) for r in results):.1f}"),
        ]
        for name, seconds, count, slices in rows:
            table.add_row(f"{context // 1024}K", name, f"{tokens / seconds:,.0f}", f"{padded / seconds:.2f}x", f"{count:.1f}", slices)
        if context == 65536:
            example = (batches, results)
    console = Console()
    console.print(table)
    rsd = Table(title="Table 2: relative standard deviation of chunks (%), 64K context, N = 4 (paper: 5.9/35.2, 6.2/5.5)")
    for column in ("attention term", "chunking", "execution time", "chunk length"):
        rsd.add_column(column, justify="right")
    for scale in (1.0, 0.5, 0.25, 0.1, 0.0):
        for name, (t, n) in table_2(cost, [[min(v, 65536) for v in b] for b in trace.batches], 4, scale).items():
            rsd.add_row("7B model" if scale == 1.0 else f"x {scale}", name, f"{t:.1f}", f"{n:.1f}")
    console.print(rsd)
    console.print(f"python {sys.version.split()[0]}, {time.perf_counter() - started:.1f} s wall")
    if example is not None and any(plot):
        draw(plot, example[0], example[1], cost)


def draw(
    paths: tuple[Path | None, Path | None], batches: list[list[int]], results: list[tuple[float, ChunkPlan]], cost: CostModel
) -> None:
    """The batch with the longest sequence turned into chunks, and its sliced 1F1B step (simulated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_pipe.schedules.render import render_png

    chunks_path, timeline_path = paths
    index = max(range(len(batches)), key=lambda i: max(batches[i]))
    lengths, plan = batches[index], results[index][1]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(plan.chunks) + 1.2))
    colors = plt.get_cmap("tab20")
    for row, chunk in enumerate(plan.chunks):
        left = 0
        for piece in chunk.pieces:
            sliced = piece.length < lengths[piece.sequence]
            ax.barh(row, piece.length, left=left, color=colors(piece.sequence % 20),
                    edgecolor="black" if sliced else "white", hatch="//" if sliced and piece.start > 0 else None)
            if piece.start > 0:
                ax.barh(row, -piece.start / 20, left=0, color="lightgray")
            left += piece.length
    ax.invert_yaxis()
    ax.set_xlabel("tokens in the chunk (gray, left: context of earlier slices, 1/20 scale; hatched: slice with context)")
    ax.set_ylabel("chunk (schedule order)")
    ax.set_title(f"A batch of {len(lengths)} sequences (longest {max(lengths)}) as {len(plan.chunks)} chunks, N = {len(plan.mesh)}")
    fig.tight_layout()
    if chunks_path is not None:
        chunks_path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(chunks_path, dpi=110)
    plt.close(fig)
    if timeline_path is not None:
        program = sliced_1f1b(NUM_STAGES, len(plan.chunks), plan.slices)
        result = simulate(program, cost.stage_costs(uniform_boundaries(cost.num_blocks, NUM_STAGES), plan.shapes))
        render_png(result, timeline_path, title="Sliced 1F1B of those chunks (simulated, 7B, 4 stages)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="one context, two batches")
    parser.add_argument("--plot-chunks", type=Path, default=None, help="PNG: a batch turned into chunks")
    parser.add_argument("--plot-timeline", type=Path, default=None, help="PNG: that batch's sliced 1F1B step")
    args = parser.parse_args()
    plot = (args.plot_chunks, args.plot_timeline)
    if args.quick:
        run(2, [65536], plot)
    else:
        run(args.batches, [32768, 65536, 131072], plot)


if __name__ == "__main__":
    main()
