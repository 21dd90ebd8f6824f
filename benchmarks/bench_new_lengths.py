"""What a new length costs: steps whose microbatches each have a new length vs one fixed length.

lightning-pipe (2 processes, 1F1B, the ``DecoderLM`` of ``bench_varlen.py``) trains on batches of
``--batch`` sequences in ``--microbatches`` microbatches. In every row a step computes the same
number of positions:

  fixed         every sequence ``--length`` tokens: one shape for the whole run.
  new-lengths   the sequences of microbatch ``i`` have ``--length + d_i`` real tokens, right-padded
                to the batch's longest, with offsets ``d_i`` that sum to zero and change every step,
                so almost every microbatch has a length not seen before; each microbatch is cut to its
                own length (``trim_padding``), activations carry their shapes, and later stages
                predict the shapes of the blocks before them (``model/shape_rules.py``).
  probe-always  as ``new-lengths`` with shape prediction switched off in the worker (the behaviour
                before shape rules: a meta-device probe of every earlier block per new length).

The rows alternate, order flipping every pair, ``--pairs`` times; the table gives the median step
time of each row and the median over pairs of each row's time relative to ``fixed``, and the same for
the CPU seconds of a step (both ranks' processes): rows run one after the other carry the shared
machine's drift in wall time (rounds of one row apart by 10-40% under other tenants' load), far less
in CPU time.

    python benchmarks/bench_new_lengths.py --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.bench_varlen import DecoderLM, pad  # noqa: E402
from benchmarks.harness import StepTimer, run_ranks  # noqa: E402

CONFIGS = ("fixed", "new-lengths", "probe-always")


def make_batches(args: argparse.Namespace, varying: bool) -> list[dict]:
    generator = torch.Generator().manual_seed(args.seed)
    per_mb = args.batch // args.microbatches
    batches = []
    for step in range(args.warmup + args.steps):
        offsets = [0] * args.microbatches
        if varying:  # distinct offsets summing to zero, new every step
            base = [(step * 7 + 3 * i) % (2 * args.spread + 1) - args.spread for i in range(args.microbatches)]
            mean = sum(base) / len(base)
            offsets = [round(b - mean) for b in base]
            offsets[-1] -= sum(offsets)
        real = [args.length + offsets[i // per_mb] for i in range(args.batch)]
        batches.append(pad(real, max(real), generator))
    return batches


def run_worker(args: argparse.Namespace) -> None:
    from lightning_pipe import ElasticPipelineStrategy

    if args.worker == "probe-always":
        from lightning_pipe.model.shape_rules import ShapeRules

        ShapeRules.predict = lambda self, block, arguments: None  # the behaviour before shape rules
    torch.set_num_threads(1)
    batches = make_batches(args, varying=args.worker != "fixed")

    def save(trainer, seconds: list[float]) -> None:
        measured = {"seconds": seconds, "cpu_seconds": timer.cpu_seconds}
        Path(args.out, f"{args.worker}-rank{trainer.global_rank}.json").write_text(json.dumps(measured))

    timer = StepTimer(args.warmup, save)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=args.warmup + args.steps, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=args.microbatches),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer], use_distributed_sampler=False,
    )
    torch.manual_seed(args.seed)
    trainer.fit(DecoderLM(args.layers, args.width, args.heads), torch.utils.data.DataLoader(batches, batch_size=None))


def launch(config: str, args: argparse.Namespace, out: str) -> tuple[float, float]:
    """Median step seconds of ``config`` (slowest rank per step) and median CPU seconds per step (both
    ranks' processes together), run in fresh processes."""
    ranks = run_ranks(__file__, config, out, args, (
        "steps", "warmup", "batch", "microbatches", "length", "spread", "layers", "width", "heads", "seed"))
    wall = statistics.median(max(pair) for pair in zip(*(r["seconds"] for r in ranks)))
    return wall, statistics.median(sum(pair) for pair in zip(*(r["cpu_seconds"] for r in ranks)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--length", type=int, default=96, help="mean real length of a sequence")
    parser.add_argument("--spread", type=int, default=24, help="largest offset of a microbatch's length")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as out:
        for pair in range(args.pairs):
            for config in CONFIGS if pair % 2 == 0 else CONFIGS[::-1]:
                wall, cpu_seconds = launch(config, args, out)
                times[config].append(wall)
                cpu[config].append(cpu_seconds)
                print(f"pair {pair}: {config:13s} {wall * 1e3:8.1f} ms/step, CPU {cpu_seconds * 1e3:8.1f} ms/step", flush=True)
    table = Table(title="What a new length per microbatch costs (lightning-pipe, pp=2, 1F1B)")
    for column in (
        "rows", "median ms/step", "vs fixed (median over pairs)", "per pair", "CPU ms/step (2 ranks)", "CPU vs fixed",
    ):
        table.add_column(column, justify="left" if column == "rows" else "right")
    for config in CONFIGS:
        ratios = [t / f for t, f in zip(times[config], times["fixed"])]
        cpu_ratios = [c / f for c, f in zip(cpu[config], cpu["fixed"])]
        table.add_row(config, f"{statistics.median(times[config]) * 1e3:.1f}", f"{statistics.median(ratios):.3f}",
                      " ".join(f"{r:.3f}" for r in ratios), f"{statistics.median(cpu[config]) * 1e3:.1f}",
                      f"{statistics.median(cpu_ratios):.3f}")
    Console(width=140).print(table)
    print(f"How: `python {' '.join(sys.argv)}` on {os.cpu_count()} CPU cores ({platform.machine()}), torch "
          f"{torch.__version__}, gloo, 2 processes x 1 thread; DecoderLM layers={args.layers} width={args.width}; "
          f"{args.batch} sequences of {args.length}+-{args.spread} tokens, {args.microbatches} microbatches, "
          f"{args.steps} timed steps after {args.warmup}; 1-minute load before: {load_before:.2f}.")


if __name__ == "__main__":
    main()
