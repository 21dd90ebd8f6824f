"""Activation offload and optimizer offload on a GPU: step time against no offload, and whether the
copies really overlap the kernels.

The example GPT (8 blocks of width 2048, 16 heads, vocabulary 8192), 4 microbatches of 4096 tokens,
bf16 autocast, AdamW, one rank (``pipeline_parallel_size=1``), so every difference is the
mechanism's. Three measurements:

1. **Activation offload** of the first ``k`` blocks of the stage (``offload=k``; pinned host buffers
   written on a side stream, the previous block's tensors prefetched during each block's backward)
   for ``k`` in ``--offload-blocks``, against no offload, alternating over ``--pairs`` pairs: median
   step ratio, bytes moved per step and the transfer seconds they need at the host link's bandwidth
   (measured here with pinned copies), so a row says whether the transfer could fit behind compute.
2. **The profiler's view**: one step with ``offload=--trace-blocks`` under ``torch.profiler``,
   exported as a Chrome trace (``offload_trace.json.gz``, open in Perfetto); the script reads it
   back and reports the streams of copies and kernels and the fraction of copy time that overlaps
   kernels running on another stream.
3. **Optimizer offload** (SPipe): ``optimizer_offload=True`` with the interleaved schedule (two
   stages on the rank, so the later stage's host step can run while the earlier stage is still in
   backward) against the same schedule with the device optimizer, alternating; the host steps'
   seconds per step, and how much of them ran before the rank's last backward action ended.

Run: ``python benchmarks/gpu/bench_offload.py --out DIR`` (needs CUDA; ``--device cpu --tiny``
checks the script on a CPU: the overlap measurements need CUDA and are skipped there).
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.bench_overhead import Repeat, StepTimer, make_batch, make_model, model_arguments, parse_model_arguments
from lightning_pipe import ElasticPipelineStrategy


class Measure(StepTimer):
    """Step seconds, offloaded bytes and optimizer-offload timings of every training batch."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.offloaded_bytes: list[int] = []
        self.host_step_seconds: list[float] = []
        self.host_step_hidden: list[float] = []
        self._offloaded_so_far = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        memory = trainer.strategy.memory
        so_far = memory.runtime.offloader.offloaded_bytes if memory.runtime is not None else 0
        self.offloaded_bytes.append(so_far - self._offloaded_so_far)
        self._offloaded_so_far = so_far
        steps = memory.last_stage_steps
        if steps:
            records = trainer.strategy.last_outcome.records
            last_backward = max(r.end for r in records if r.action.type.name.startswith("BACKWARD"))
            total = sum(s.finished - s.started for s in steps.values())
            hidden = sum(max(0.0, min(s.finished, last_backward) - s.started) for s in steps.values())
            self.host_step_seconds.append(total)
            self.host_step_hidden.append(hidden / total if total else 0.0)


def run(args, device: torch.device, schedule: str = "1f1b", profile_to: Path | None = None, **options) -> Measure:
    """Train ``--warmup + --steps`` steps with the strategy ``options``; the measurements."""
    model = make_model(args)
    steps = args.warmup + args.steps
    measure = Measure(device)
    callbacks = [measure]
    if profile_to is not None:
        callbacks.append(TraceOneStep(profile_to, steps - 1))
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision="bf16-mixed", max_steps=steps,
        strategy=ElasticPipelineStrategy(
            pipeline_parallel_size=1, num_microbatches=args.microbatches, schedule=schedule, **options
        ),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(Repeat(make_batch(args), steps), batch_size=None))
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measure


class TraceOneStep(L.Callback):
    """Record batch ``index`` under torch.profiler and export a gzipped Chrome trace to ``path``."""

    def __init__(self, path: Path, index: int) -> None:
        self.path, self.index, self._profiler = path, index, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.index:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._profiler is not None:
            torch.cuda.synchronize()
            self._profiler.__exit__(None, None, None)
            self._profiler.export_chrome_trace(str(self.path))
            self._profiler = None


def copy_overlap(trace_path: Path) -> dict:
    """Streams of memory copies and kernels in a Chrome trace, and the fraction of copy time that
    overlaps kernels on another stream."""
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels, copies = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        stream = e.get("args", {}).get("stream")
        if e.get("cat") == "kernel":
            kernels.append((e["ts"], e["ts"] + e["dur"], stream))
        elif e.get("cat") == "gpu_memcpy" and ("DtoH" in e["name"] or "HtoD" in e["name"]):
            copies.append((e["ts"], e["ts"] + e["dur"], stream, "DtoH" if "DtoH" in e["name"] else "HtoD"))
    total = overlapped = 0.0
    for start, end, stream, _ in copies:
        total += end - start
        spans = sorted((max(s, start), min(t, end)) for s, t, k in kernels if k != stream and s < end and t > start)
        covered, reach = 0.0, start
        for s, t in spans:
            if t > reach:
                covered += t - max(s, reach)
                reach = t
        overlapped += covered
    return {
        "kernel_streams": sorted({k for _, _, k in kernels}, key=str),
        "copy_streams": {direction: sorted({s for _, _, s, d in copies if d == direction}, key=str) for direction in ("DtoH", "HtoD")},
        "copies": len(copies),
        "copy_ms": total / 1e3,
        "overlap_fraction": overlapped / total if total else float("nan"),
    }


def host_bandwidth(device: torch.device, megabytes: int = 256) -> float:
    """Bytes per second of a pinned host <-> device copy (mean of both directions)."""
    if device.type != "cuda":
        return float("nan")
    data = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True)
    seconds = []
    for _ in range(4):
        for src, dst in ((data, host), (host, data)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    return data.numel() / statistics.median(seconds)


def main(argv: list[str] | None = None) -> None:
    parser = model_arguments(__doc__.splitlines()[0], warmup=2, steps=5)
    parser.add_argument("--offload-blocks", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--trace-blocks", type=int, default=2)
    parser.add_argument("--out", default=".")
    args = parse_model_arguments(parser, argv)
    if args.tiny:
        args.offload_blocks = [1, 2]
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = host_bandwidth(device)
    print(f"Offload on {name}, torch {torch.__version__}: GPT {args.layers} blocks h={args.hidden}, "
          f"{args.microbatches} microbatches x {args.tokens} tokens, bf16-mixed, one rank; "
          f"pinned host link {bandwidth / 1e9:.1f} GB/s\n")

    results: dict = {"device": name, "torch": torch.__version__, "args": vars(args), "host_bandwidth": bandwidth}
    rows = []
    for k in args.offload_blocks:
        ratios, plain_s, offload_s, moved = [], [], [], 0
        for _ in range(args.pairs):
            plain = statistics.median(run(args, device).seconds[args.warmup :])
            measured = run(args, device, offload=k)
            offloaded = statistics.median(measured.seconds[args.warmup :])
            moved = measured.offloaded_bytes[-1]
            ratios.append(offloaded / plain)
            plain_s.append(plain)
            offload_s.append(offloaded)
        rows.append({"blocks": k, "plain_s": statistics.median(plain_s), "offload_s": statistics.median(offload_s),
                     "ratio": statistics.median(ratios), "ratios": ratios, "bytes_per_step": moved,
                     "transfer_s_each_way": moved / bandwidth})
    results["activation_offload"] = rows
    print("| offloaded blocks (of the stage) | no offload ms | offload ms | median ratio (pairs) | GiB moved per step | transfer ms each way |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        pairs = ", ".join(f"{x:.3f}" for x in r["ratios"])
        print(f"| {r['blocks']} | {r['plain_s'] * 1e3:.1f} | {r['offload_s'] * 1e3:.1f} | {r['ratio']:.3f} ({pairs}) | "
              f"{r['bytes_per_step'] / 2**30:.2f} | {r['transfer_s_each_way'] * 1e3:.1f} |")

    if device.type == "cuda":
        trace = out / "offload_trace.json.gz"
        run(args, device, profile_to=trace, offload=args.trace_blocks)
        overlap = copy_overlap(trace)
        results["trace"] = overlap
        print(f"\nprofiler trace ({trace}), offload={args.trace_blocks}: kernels on streams {overlap['kernel_streams']}, "
              f"copies device->host on {overlap['copy_streams']['DtoH']}, host->device on {overlap['copy_streams']['HtoD']}; "
              f"{overlap['copies']} copies, {overlap['copy_ms']:.1f} ms, {overlap['overlap_fraction']:.1%} of copy time "
              "overlaps kernels on another stream")

    ratios, host, hidden = [], [], []
    for _ in range(args.pairs):
        device_opt = statistics.median(run(args, device, schedule="interleaved_1f1b").seconds[args.warmup :])
        measured = run(args, device, schedule="interleaved_1f1b", optimizer_offload=True)
        ratios.append(statistics.median(measured.seconds[args.warmup :]) / device_opt)
        host.append(statistics.median(measured.host_step_seconds[args.warmup :]))
        hidden.append(statistics.median(measured.host_step_hidden[args.warmup :]))
    results["optimizer_offload"] = {"ratios": ratios, "host_step_s": host, "hidden_fraction": hidden}
    print(f"\noptimizer offload (interleaved_1f1b, 2 stages on the rank): step time / device optimizer = "
          f"{statistics.median(ratios):.3f} (pairs {', '.join(f'{r:.3f}' for r in ratios)}); host steps "
          f"{statistics.median(host) * 1e3:.1f} ms per step, {statistics.median(hidden):.0%} of it before the last backward ended")
    (out / "offload.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
