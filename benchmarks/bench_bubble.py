"""Measured pipeline bubble per schedule family on real runs, against the simulator's prediction.

The example GPT (8 blocks, h=256, vocabulary 256) on fixed-length batches (16 x 128 tokens),
2 pipeline ranks on this machine's CPU cores (gloo), 8 microbatches, ``--steps`` steps per run
(the first two not counted). For every family the ``PipelineMonitor`` logs, each step,

* ``pipeline/bubble_ratio``: measured idle share of the step (1 - busy / (ranks x makespan), time
  blocked in a receive counted idle),
* ``pipeline/simulated_bubble_ratio``: what ``schedules.simulate`` predicts for the same program
  with that same step's measured compute times (communication at the step's measured message latency),

so the difference is what the schedule does not explain (transfers, waiting, framework time between
actions). Families are rotated over ``--rounds`` rounds in one invocation; the table gives medians.
Zero-bubble families run a real split backward (I: input gradients only; W: weight gradients only).

Run: ``python benchmarks/bench_bubble.py`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt.model import GPT  # noqa: E402
from lightning_pipe import ElasticPipelineStrategy  # noqa: E402
from lightning_pipe.callbacks import PipelineMonitor  # noqa: E402
from tests.helpers.training import BatchDataset  # noqa: E402

FAMILIES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")


def run(family: str, args: argparse.Namespace, directory: Path) -> dict[str, list[float]]:
    """Train one family; the monitor's per-step metrics (after the first two steps)."""
    L.seed_everything(0, verbose=False)
    model = GPT(vocab_size=256, block_size=args.tokens + 1, n_layer=args.layers, n_head=4, n_embd=args.hidden)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (args.batch, args.tokens + 1), generator=generator) for _ in range(args.steps)]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=args.steps,
        strategy=ElasticPipelineStrategy(
            pipeline_parallel_size=2, num_microbatches=args.microbatches, schedule=family, start_method="fork"
        ),
        logger=CSVLogger(directory, name="", version=""), callbacks=[PipelineMonitor(log_every_n_steps=1, timeline_every_n_steps=0)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )
    trainer.fit(model, DataLoader(BatchDataset(batches), batch_size=None))
    with open(directory / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("pipeline/bubble_ratio")]
    keys = ("pipeline/bubble_ratio", "pipeline/simulated_bubble_ratio", "pipeline/tokens_per_s")
    return {k: [float(r[k]) for r in rows[2:]] for k in keys}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {f: {} for f in args.families}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = args.families[round_index % len(args.families):] + args.families[: round_index % len(args.families)]
            for family in order:
                measured = run(family, args, Path(tmp) / f"{family}-{round_index}")
                for key, values in measured.items():
                    results[family].setdefault(key, []).extend(values)
    print(f"\nMeasured vs simulated bubble: GPT {args.layers} blocks h={args.hidden}, {args.batch} x {args.tokens} tokens, "
          f"{args.microbatches} microbatches, 2 ranks (gloo, CPU), {args.rounds} rounds x {args.steps - 2} counted steps\n")
    print("| family | measured bubble | simulated bubble (same step's compute and latency) | difference (points) | tokens/s |")
    print("|---|---|---|---|---|")
    for family, values in results.items():
        measured = statistics.median(values["pipeline/bubble_ratio"])
        simulated = statistics.median(values["pipeline/simulated_bubble_ratio"])
        tokens = statistics.median(values["pipeline/tokens_per_s"])
        print(f"| {family} | {measured:.3f} | {simulated:.3f} | {100 * (measured - simulated):+.1f} | {tokens:,.0f} |")
    print(f"\nrun: python benchmarks/bench_bubble.py {' '.join(sys.argv[1:])} | python {platform.python_version()}, "
          f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads in the main process")


if __name__ == "__main__":
    main()
