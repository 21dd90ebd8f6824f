"""Checkpoint memory and time: sharded (``save_distributed_checkpoint=True``) vs gathered on rank 0.

Run (CPU, gloo, processes forked from this script)::

    python benchmarks/bench_checkpoint.py                 # pp 2 and 4, 8 blocks of 1024x1024, Adam, float32
    python benchmarks/bench_checkpoint.py --stages 2 --blocks 4 --dim 512 --repeats 1   # quick

A real Lightning run of ``ElasticPipelineStrategy``: one training step (so Adam has its moments; the
state is 3 x the parameters, 96 MiB for 8 blocks of 1024x1024), then ``trainer.save_checkpoint`` in
each format, alternated ``--repeats`` times, on every rank. Per rank it reports the peak extra resident
memory while saving (the kernel's peak RSS, reset right before the save through
``/proc/self/clear_refs``, minus the RSS before), as a multiple of the rank's own shard (its parameters
and optimizer state), and the save's wall time. Then the step-time cost of an asynchronous save
(``async_save=True``): how long the save call blocks, and how much longer the next step takes while the
shards are written in the background, against the median step without a save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import ElasticPipelineStrategy

MiB = 2**20


class Blocks(L.LightningModule):
    """``num_blocks`` bias-free square linear layers, a squared-output loss, Adam."""

    def __init__(self, num_blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(num_blocks)])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch  # [B, dim]
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _shard_bytes(trainer: L.Trainer) -> int:
    module = trainer.lightning_module
    total = sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


class Measure(L.Callback):
    """After training: save in both formats on every rank, write what this rank measured as JSON."""

    def __init__(self, directory: Path, repeats: int) -> None:
        self.directory, self.repeats = directory, repeats

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        results: dict[str, list] = {"sharded": [], "gathered": []}
        for repeat in range(self.repeats):
            for name, sharded in (("sharded", True), ("gathered", False)):
                strategy._save_distributed_checkpoint = sharded
                path = self.directory / f"{name}-{repeat}.ckpt"
                strategy.barrier()
                before = _rss()
                _reset_peak()
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                seconds = time.perf_counter() - start
                results[name].append({"extra": _peak_rss() - before, "seconds": seconds})
                strategy.barrier()
                strategy.remove_checkpoint(path)
        record = {"rank": trainer.global_rank, "shard": _shard_bytes(trainer), **results}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class StepTimes(L.Callback):
    """Times every step; saves at ``save_at`` (async or not) and times the save call."""

    def __init__(self, directory: Path, save_at: int) -> None:
        self.directory, self.save_at = directory, save_at
        self.steps: list[float] = []
        self.save_seconds = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(time.perf_counter() - self.start)
        if trainer.global_step == self.save_at:
            start = time.perf_counter()
            trainer.save_checkpoint(self.directory / "async.ckpt")
            self.save_seconds = time.perf_counter() - start

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.strategy.wait_for_checkpoint()
        record = {"steps": self.steps, "save": self.save_seconds}
        (self.directory / f"steps{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(stages: int, args: argparse.Namespace, directory: Path, callback: L.Callback, steps: int, **options) -> None:
    torch.manual_seed(0)
    model = Blocks(args.blocks, args.dim)
    data = [torch.randn(args.batch, args.dim) for _ in range(steps)]
    trainer = L.Trainer(
        accelerator="cpu", devices=stages, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        strategy=ElasticPipelineStrategy(num_microbatches=stages, start_method="fork", **options),
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))


def measure_memory(stages: int, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _fit(stages, args, directory, Measure(directory, args.repeats), steps=1)
        return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(stages)]


def measure_async(stages: int, args: argparse.Namespace, asynchronous: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        save_at = args.steps // 2
        _fit(stages, args, directory, StepTimes(directory, save_at), steps=args.steps, async_save=asynchronous)
        records = [json.loads((directory / f"steps{r}.json").read_text()) for r in range(stages)]
    steps = [max(r["steps"][i] for r in records) for i in range(args.steps)]  # the slowest rank's step
    baseline = statistics.median(steps[1:save_at - 1] + steps[save_at + 1 :])
    return {
        "save_call": max(r["save"] for r in records),
        "next_step_extra": steps[save_at] - baseline,  # the step after the save (index = global_step)
        "baseline": baseline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks are forked from this process
    state = 3 * args.blocks * args.dim * args.dim * 4
    print(
        f"# bench_checkpoint: {args.blocks} blocks of {args.dim}x{args.dim}, Adam, float32: "
        f"{state / MiB:.0f} MiB of parameters and optimizer state; CPU, gloo, {os.cpu_count()} cores; "
        f"max over {args.repeats} saves of each format, alternated"
    )
    print()
    print("| pp | rank | shard MiB | sharded: extra MiB | x shard | s | gathered: extra MiB | x shard | s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for stages in args.stages:
        for record in measure_memory(stages, args):
            shard = record["shard"]
            cells = [str(stages), str(record["rank"]), f"{shard / MiB:.0f}"]
            for name in ("sharded", "gathered"):
                extra = max(r["extra"] for r in record[name])
                seconds = statistics.median(r["seconds"] for r in record[name])
                cells += [f"{extra / MiB:.0f}", f"{extra / shard:.2f}", f"{seconds:.2f}"]
            print("| " + " | ".join(cells) + " |")
    print()
    print(f"# step-time cost of one save ({args.steps} steps, save after step {args.steps // 2}; slowest rank)")
    print()
    print("| pp | save | step without save s | save call blocks s | next step longer by s |")
    print("|---:|---|---:|---:|---:|")
    for stages in args.stages:
        for asynchronous in (False, True):
            result = measure_async(stages, args, asynchronous)
            print(
                f"| {stages} | {'async' if asynchronous else 'sync'} sharded | {result['baseline']:.3f} | "
                f"{result['save_call']:.3f} | {result['next_step_extra']:+.3f} |"
            )


if __name__ == "__main__":
    main()
