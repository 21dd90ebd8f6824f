"""Framework overhead on a GPU: lightning-pipe against a hand-written loop running the same kernels.

The same GPT (the example's, 8 blocks of width 2048, 16 heads, vocabulary 8192), the same batch of
4 microbatches of 4096 tokens, bf16 autocast, AdamW. Configurations, each timed over ``--steps``
optimizer steps after ``--warmup`` (CUDA synchronised at both ends of each step):

* ``hand loop``: plain PyTorch, ``for mb in microbatches: (loss(mb) / 4).backward()``, then
  ``optimizer.step()``, ``zero_grad``. The floor for this model on this GPU.
* ``lightning-pipe pp=1``: ``Trainer(strategy=ElasticPipelineStrategy(pipeline_parallel_size=1,
  num_microbatches=4))`` on the unchanged LightningModule: Lightning's loop, the strategy's split,
  program executor, log replay, stage runner.

The two alternate over ``--pairs`` pairs in this one process; the table gives each pair's ratio
and the median. A ``torch.profiler`` capture of one step of each says how busy the GPU was (kernel
time / wall time), which separates launch/Python overhead from kernel time.

Run: ``python benchmarks/gpu/bench_overhead.py`` (needs CUDA; ``--device cpu --tiny`` checks the
script on a CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.gpt.model import GPT
from lightning_pipe import ElasticPipelineStrategy


class Repeat(Dataset):
    """The same whole batch ``length`` times (``DataLoader(batch_size=None)``)."""

    def __init__(self, batch: torch.Tensor, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.batch


class StepTimer(L.Callback):
    """Wall seconds of each training batch, the device synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self._start = device, [], 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync()
        self.seconds.append(time.perf_counter() - self._start)


def make_model(args) -> GPT:
    L.seed_everything(0, verbose=False)
    return GPT(vocab_size=args.vocab, block_size=args.tokens + 1, n_layer=args.layers, n_head=args.heads, n_embd=args.hidden)


def make_batch(args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, args.vocab, (args.microbatches, args.tokens + 1), generator=generator)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_loop(args, device: torch.device, profile: bool = False) -> tuple[list[float], float]:
    """Step seconds of the plain-PyTorch loop (and, with ``profile``, the GPU busy fraction of one step)."""
    model = make_model(args).to(device)
    optimizer = model.configure_optimizers()
    batch = make_batch(args).to(device)
    dtype = torch.bfloat16
    seconds = []

    def step() -> None:
        for mb in batch.split(1):
            with torch.autocast(device.type, dtype=dtype):
                loss = model._loss(mb) / args.microbatches
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
    busy = busy_fraction(step, device) if profile else float("nan")
    return seconds, busy


def union_seconds(events) -> float:
    """Seconds covered by the union of the CUDA kernel intervals among profiler ``events``."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for s, e in intervals:  # microseconds
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / 1e6


def busy_fraction(step, device: torch.device) -> float:
    """Kernel time / wall time of one call of ``step`` under torch.profiler."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - start
    return union_seconds(prof.events()) / wall


class ProfileLastBatch(StepTimer):
    """:class:`StepTimer` that also runs torch.profiler over the last batch (GPU busy fraction)."""

    def __init__(self, device: torch.device, last: int) -> None:
        super().__init__(device)
        self.last, self.busy, self._profiler = last, float("nan"), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.last and self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.__enter__()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.busy = union_seconds(self._profiler.events()) / self.seconds[-1]
            self._profiler = None


def lightning_pipe(args, device: torch.device, profile: bool = False) -> tuple[list[float], float]:
    """Step seconds of the unchanged module under ``ElasticPipelineStrategy`` with one stage (and,
    with ``profile``, the GPU busy fraction of one more step)."""
    model = make_model(args)
    steps = args.warmup + args.steps
    timer = ProfileLastBatch(device, steps if profile else -1)
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision="bf16-mixed", max_steps=steps + int(profile),
        strategy=ElasticPipelineStrategy(pipeline_parallel_size=1, num_microbatches=args.microbatches),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, DataLoader(Repeat(make_batch(args), steps + 1), batch_size=None))
    result = timer.seconds[args.warmup : steps]
    del trainer, model
    return result, timer.busy


def model_arguments(description: str, warmup: int, steps: int) -> argparse.ArgumentParser:
    """The options every GPU benchmark shares: device, model size, microbatches, steps, pairs."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small model (to check the script on a CPU)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per microbatch (one sequence)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--pairs", type=int, default=3)
    return parser


def parse_model_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; ``--tiny`` shrinks the model to check a script on a CPU."""
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.vocab, args.tokens = 2, 64, 4, 256, 64
    return args


def main(argv: list[str] | None = None) -> None:
    parser = model_arguments(__doc__.splitlines()[0], warmup=3, steps=8)
    parser.add_argument("--json", help="write the results here")
    args = parse_model_arguments(parser, argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for pair in range(args.pairs):
        profile = pair == args.pairs - 1
        for name, run in (("hand loop", hand_loop), ("lightning-pipe pp=1", lightning_pipe)):
            seconds, busy = run(args, device, profile)
            rows.append({"pair": pair, "name": name, "median_s": statistics.median(seconds), "busy": busy})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ratios = []
    for pair in range(args.pairs):
        hand, pipe = (r for r in rows if r["pair"] == pair)
        ratios.append(pipe["median_s"] / hand["median_s"])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tokens = args.microbatches * args.tokens
    print(f"\nFramework overhead on {device_name}, torch {torch.__version__}: GPT {args.layers} blocks h={args.hidden}, "
          f"{args.microbatches} microbatches x {args.tokens} tokens, bf16-mixed, AdamW; "
          f"median of {args.steps} steps after {args.warmup}, {args.pairs} alternating pairs\n")
    print("| pair | hand loop ms | lightning-pipe ms | ratio | hand tokens/s | GPU busy hand / lp |")
    print("|---|---|---|---|---|---|")
    for pair in range(args.pairs):
        hand, pipe = (r for r in rows if r["pair"] == pair)
        print(f"| {pair} | {hand['median_s'] * 1e3:.1f} | {pipe['median_s'] * 1e3:.1f} | {ratios[pair]:.3f} | "
              f"{tokens / hand['median_s']:,.0f} | {hand['busy']:.1%} / {pipe['busy']:.1%} |")
    median = statistics.median(ratios)
    print(f"\nmedian ratio lightning-pipe / hand loop: {median:.3f} (overhead {100 * (median - 1):+.1f}% of step time)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "torch": torch.__version__, "args": vars(args),
                                               "rows": rows, "median_ratio": median}, indent=1))


if __name__ == "__main__":
    main()
