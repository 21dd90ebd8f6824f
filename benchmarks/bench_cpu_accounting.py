"""Where lightning-pipe's CPU goes beside torch's Schedule1F1B, per call, inside the ranks.

The wall-time ratios of ``bench_throughput.py --interleave`` spread 5-10% from round to round on this
shared 2-core machine, more than the 1-2% a change to the stage runner moves. The CPU a rank's thread
spends in one call (``time.thread_time``) spreads far less: this script runs one interleaved round of
``bench_throughput.py`` (every lightning-pipe step beside one step of torch's Schedule1F1B on the same
batch, in one pair of processes) with the calls below timed in both, and prints CPU milliseconds per
step for each, per rank, over the timed steps (warm-up steps not counted):

  blocks, forward           the GPT's ``Block.forward`` (the same modules in both)
  backward                  ``torch.autograd.backward`` calls (a full backward, B)
  zero-bubble I, W          lightning-pipe's split backward (``runtime/split_backward.py``): the input
                            gradients' pass and the weight gradients' pass; B + I + W compare with B
  optimizer                 ``torch.optim.adam.adam`` (AdamW's update)
  stage forward, rest       lightning-pipe: ``StageRunner.run`` less its blocks and its receive (the
                            step's code outside the blocks under the placeholder mode, the head and
                            the loss on the last stage); torch: ``forward_one_chunk`` less its blocks,
                            plus its loss function (torch computes the loss outside the stage)
  receive in stage run      lightning-pipe only: the activation's receive inside a later stage's run
  last stage: before/after  lightning-pipe only: the last stage's run split at its first and last block
  step (process CPU)        the benchmark's own per-step CPU (median), all threads

Run: ``python benchmarks/bench_cpu_accounting.py`` (about one minute), ``--schedule zbv@auto`` for a
zero-bubble row (``bench_throughput.py``'s row syntax). Wrappers add a little to every timed call in
both rows alike; compare the rows, not these numbers with ``bench_throughput.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ROWS = [
    "blocks, forward", "backward", "zero-bubble I", "zero-bubble W", "optimizer", "stage forward, rest",
    "receive in stage run",
    "last stage: before blocks", "last stage: after blocks",
]


class Accounting:
    """Thread CPU per (row, region) in one rank process; region is "lp" or "torch" (inside torch's step)."""

    def __init__(self) -> None:
        self.region = "lp"
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)
        self.nested = 0.0  # CPU of blocks and receives inside the current stage forward
        self.marks: dict[str, float] = {}  # the last stage's run: its first block's start, last block's end

    def timed(self, row: str, function, nested: bool = False, mark: str | None = None):
        """``function`` with its thread CPU added to ``row``; ``nested``: also counted in the enclosing stage
        forward's; ``mark``: also kept as the current stage forward's ``marks[mark]``."""

        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                self.cpu[(row, self.region)] += spent
                if nested:
                    self.nested += spent
                if mark is not None:
                    self.marks[mark] = spent

        return wrapper

    def stage_forward(self, function, extra=None):
        """A stage forward: its CPU less the blocks and receives inside it goes to "stage forward, rest"."""

        def wrapper(*args, **kwargs):
            outer, self.nested, self.marks = self.nested, 0.0, {}
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                end = time.thread_time()
                self.cpu[("stage forward, rest", self.region)] += end - start - self.nested
                if extra is not None:
                    extra(start, end, args)
                self.nested = outer

        return wrapper


def install(accounting: Accounting) -> None:
    """Wrap the calls of the table in this (rank) process."""
    import torch
    import torch.distributed as dist
    import torch.optim.adam as adam
    from torch.distributed.pipelining import stage as torch_stage

    import bench_throughput as bt
    from examples.gpt import model as gpt
    from lightning_pipe.model import stage_runner
    from lightning_pipe.runtime import executor, split_backward

    block_forward = accounting.timed("blocks, forward", gpt.Block.forward, nested=True)

    def marked_block(self, *args, **kwargs):
        accounting.marks.setdefault("first", time.thread_time())
        try:
            return block_forward(self, *args, **kwargs)
        finally:
            accounting.marks["last"] = time.thread_time()

    gpt.Block.forward = marked_block
    torch.autograd.backward = accounting.timed("backward", torch.autograd.backward)
    adam.adam = accounting.timed("optimizer", adam.adam)
    executor.backward_input = accounting.timed("zero-bubble I", executor.backward_input)
    split_backward.WeightPass.run = accounting.timed("zero-bubble W", split_backward.WeightPass.run)
    bt.lm_loss = accounting.timed("stage forward, rest", bt.lm_loss)
    torch_stage._PipelineStageBase.forward_one_chunk = accounting.stage_forward(
        torch_stage._PipelineStageBase.forward_one_chunk
    )
    stage_runner.StageRunner._inject = accounting.timed(
        "receive in stage run", stage_runner.StageRunner._inject, nested=True, mark="receive"
    )

    def last_stage_phases(start: float, end: float, args: tuple) -> None:
        span = args[3]  # (runner, step_name, step_args, span)
        if span.is_last and span.first_block > 0 and "first" in accounting.marks:
            before = accounting.marks["first"] - start - accounting.marks.get("receive", 0.0)
            accounting.cpu[("last stage: before blocks", "lp")] += before
            accounting.cpu[("last stage: after blocks", "lp")] += end - accounting.marks["last"]

    stage_runner.StageRunner.run = accounting.stage_forward(stage_runner.StageRunner.run, last_stage_phases)

    make_torch_step = bt.torch_1f1b_step

    def torch_step(rank, args, batches):
        step, module = make_torch_step(rank, args, batches)

        def in_torch_region(i: int) -> float:
            accounting.region = "torch"
            try:
                return step(i)
            finally:
                accounting.region = "lp"

        return in_torch_region, module

    bt.torch_1f1b_step = torch_step

    from lightning_pipe.strategies.elastic_pipeline import ElasticPipelineStrategy

    training_step = ElasticPipelineStrategy.training_step
    warmup = int(sys.argv[sys.argv.index("--warmup") + 1])

    def counted_training_step(self, *args, **kwargs):
        if args[1] == warmup:  # the timed steps start: forget the warm-up's
            accounting.cpu.clear()
        return training_step(self, *args, **kwargs)

    ElasticPipelineStrategy.training_step = counted_training_step
    destroy = dist.destroy_process_group
    out = Path(sys.argv[sys.argv.index("--out") + 1])

    def write_then_destroy(group=None):
        if group is None:  # the end of the round: the default group goes last
            table = {f"{row}|{region}": seconds for (row, region), seconds in accounting.cpu.items()}
            (out / f"accounting-rank{dist.get_rank()}.json").write_text(json.dumps(table))
            return destroy()
        return destroy(group)

    dist.destroy_process_group = write_then_destroy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help="the lightning-pipe row (bench_throughput.py's syntax)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, __file__, "--worker", "interleaved", "--out", out, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--pairs", "1", "--schedules", args.schedule, "--interleave",
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        completed = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, check=False)
        if completed.returncode != 0:
            raise SystemExit(f"the round failed: {completed.stderr.strip().splitlines()[-1]}")
        tables = [json.loads(Path(out, f"accounting-rank{rank}.json").read_text()) for rank in (0, 1)]
        steps = {}
        for name, key in ((args.schedule, "lp"), (f"torch-{args.schedule}", "torch")):
            for path in sorted(Path(out, f"0-{name}").glob("*-rank*.json")):
                result = json.loads(path.read_text())
                steps[(result["rank"], key)] = statistics.median(result["cpu_seconds"])
    title = f"CPU ms per step by rank (0:, 1:), {args.steps} steps, lightning-pipe {args.schedule} beside torch Schedule1F1B"
    table = Table(title=title)
    table.add_column("call")
    for rank in (0, 1):
        for label in ("lightning-pipe", "torch", "+"):
            table.add_column(f"{rank}: {label}", justify="right")
    for row in [*ROWS, "step (process CPU)"]:
        cells = []
        for rank in (0, 1):
            if row == "step (process CPU)":
                values = [steps.get((rank, key), 0.0) * 1e3 for key in ("lp", "torch")]
            else:
                values = [tables[rank].get(f"{row}|{key}", 0.0) * 1e3 / args.steps for key in ("lp", "torch")]
            cells += [f"{values[0]:.2f}", f"{values[1]:.2f}", f"{values[0] - values[1]:+.2f}"]
        table.add_row(row, *cells)
    Console(width=max(Console().width, 110)).print(table)
    print(
        f"How: `python benchmarks/bench_cpu_accounting.py --schedule {args.schedule} --steps {args.steps}`; "
        "thread CPU of each call (time.thread_time), summed over the timed steps and divided by their number."
    )


if __name__ == "__mp_main__":  # a rank process, spawned by the worker below (its main module is this file)
    install(Accounting())
elif __name__ == "__main__":
    if "--worker" in sys.argv:  # the worker: bench_throughput's, whose ranks import this file first
        import bench_throughput

        bench_throughput.main()
    else:
        main()
