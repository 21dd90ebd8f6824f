"""Elastic depth on real processes: stages and widths chosen per batch (FlexPipe's FMOP), tokens/s.

Trains the unchanged `examples/gpt` GPT on 4 CPU processes (gloo) with
`ElasticPipelineStrategy(elastic_depth=True)` on long-tailed variable-length batches
(`examples/gpt/data.py`: lognormal lengths, median 2 x `--min-len`, clipped to `--max-len`), once
per configuration, each in its own fresh processes:

  static-4x1      4 stages x 1 replica (1F1B), never changed.
  static-2x2      2 stages x 2 replicas, never changed.
  static-1x4      1 stage x 4 replicas (data parallel), never changed; it ignores the memory cap
                  below (it would not fit the long batches under it).
  elastic-depth   `ElasticDepth`: before every batch, HBSA + FMOP choose stages and widths for it
                  (decided while the previous batch trains), ranks regroup when it pays.

CPU processes have no memory limit that would force depth, so `ElasticDepth` gets a cap standing
in for device memory: the bytes the 1 x 4 layout needs (meta-device cost model) for a batch of
`--cap-length` tokens per sequence (at least what 4 x 1 needs for the longest batch). Shorter
batches may run data parallel, longer ones must run deeper. Same seed, same batches in the same order, same steps. tokens/s: tokens of the timed steps
(after `--warmup`) over the time from `on_train_batch_start` to `on_train_batch_end`, summed, of the
slowest rank (regrouping and planning not hidden behind the previous step are inside it).

Run from the repository root (about 6 minutes on 2 cores with the defaults):

    python benchmarks/bench_elastic_depth.py
    python benchmarks/bench_elastic_depth.py --steps 20 --only static-4x1 elastic-depth
    python benchmarks/bench_elastic_depth.py --json benchmarks/results/bench_elastic_depth.json \
        --plot docs/img/elastic_depth_real.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

CONFIGS = ("static-4x1", "static-2x2", "static-1x4", "elastic-depth")
FIXED = {"static-4x1": (1, 1, 1, 1), "static-2x2": (2, 2), "static-1x4": (4,)}
DEVICES = 4


def _worker(args: argparse.Namespace) -> None:
    """One configuration: a Lightning fit on 4 processes (the launcher re-runs this command)."""
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_pipe
    from examples.gpt.data import TokenDataModule
    from examples.gpt.model import GPT
    from lightning_pipe.callbacks import ElasticDepth
    from lightning_pipe.planning.boundaries import uniform_partition
    from lightning_pipe.planning.cost_model import MicrobatchShape
    from lightning_pipe.planning.depth_estimators import CostModelDepthEstimator
    from lightning_pipe.planning.layout import Layout
    from lightning_pipe.planning.proposals import PlanProposal

    torch.set_num_threads(1)

    class Throughput(L.Callback):
        def __init__(self) -> None:
            self.tokens, self.seconds, self.start, self.losses, self.widths = 0, 0.0, 0.0, [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= args.warmup:
                B, T_plus_1 = batch.shape
                self.tokens += B * (T_plus_1 - 1)
                self.seconds += time.perf_counter() - self.start
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
            plan = trainer.strategy.plan
            widths = tuple(plan.widths or (1,) * plan.num_stages)
            self.widths.append((widths, int(batch.shape[1] - 1), tuple(plan.boundaries)))

    class FixedLayout(L.Callback):
        """Propose one layout (uniform boundaries) before every batch."""

        def __init__(self, widths: tuple[int, ...]) -> None:
            self.widths = widths

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            strategy = trainer.strategy
            boundaries = uniform_partition(strategy.unit_layout.num_blocks, len(self.widths))
            strategy.propose(PlanProposal("FixedLayout", boundaries=boundaries, widths=self.widths))

    class MemoryCap(L.Callback):
        """Before the first batch: ElasticDepth's device memory = what 1 x 4 needs at `--cap-length`."""

        def __init__(self, depth: ElasticDepth) -> None:
            self.depth, self.done = depth, False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.done:
                return
            costs = trainer.strategy.costs
            costs.use(costs.meta_estimate(batch, args.max_len + 1, args.batch_size))
            model = costs.estimate.cost_model
            per_mb = args.batch_size // args.microbatches
            shapes = [MicrobatchShape.from_lengths([args.cap_length] * per_mb)] * args.microbatches
            estimator = CostModelDepthEstimator(model, shapes, DEVICES, float("inf"), allow_recompute=False)
            cap = max(estimator.memory(Layout((0, model.num_blocks), (DEVICES,))))
            longest = [MicrobatchShape.from_lengths([args.max_len + 1] * per_mb)] * args.microbatches
            deepest = CostModelDepthEstimator(model, longest, DEVICES, float("inf"), allow_recompute=False)
            four = Layout(uniform_partition(model.num_blocks, DEVICES), (1,) * DEVICES)
            self.depth.device_memory = max(cap, max(deepest.memory(four)))  # the longest batch fits 4 x 1
            self.done = True

    config = args.worker
    strategy = lightning_pipe.ElasticPipelineStrategy(num_microbatches=args.microbatches, elastic_depth=True)
    throughput = Throughput()
    callbacks: list = [throughput]
    depth = None
    if config in FIXED:
        callbacks.insert(0, FixedLayout(FIXED[config]))
    else:
        depth = ElasticDepth(migration_horizon=args.horizon)
        callbacks[:0] = [MemoryCap(depth), depth]
    L.seed_everything(args.seed, verbose=False)
    model = GPT(
        vocab_size=args.vocab, block_size=args.max_len, n_layer=args.n_layer, n_head=args.n_head,
        n_embd=args.n_embd, learning_rate=3e-3,
    )
    data = TokenDataModule(
        num_batches=args.steps, batch_size=args.batch_size, min_len=args.min_len, max_len=args.max_len,
        vocab_size=args.vocab, seed=args.seed,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=DEVICES, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=callbacks,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_seconds = time.perf_counter() - started
    seconds = torch.tensor(throughput.seconds, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if trainer.global_rank != 0:
        return
    layouts = Counter(",".join(map(str, w)) for w, _, _ in throughput.widths)
    changes = sum(a[0] != b[0] for a, b in zip(throughput.widths, throughput.widths[1:]))
    result = {
        "config": config,
        "tokens_per_s": throughput.tokens / seconds.item(),
        "timed_s": seconds.item(),
        "fit_s": fit_seconds,
        "final_loss": throughput.losses[-1],
        "layouts": dict(layouts),
        "layout_changes": changes,
        "cap_bytes": None if depth is None else depth.device_memory,
        "plan_ms_mean": None if depth is None else 1e3 * sum(s.planning_seconds for s in depth.history) / len(depth.history),
        "looked_ahead": None if depth is None else sum(s.looked_ahead for s in depth.history),
        "per_step": throughput.widths,
    }
    Path(args.out).write_text(json.dumps(result))


def _run(config: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, __file__, "--worker", config, "--out", str(out)] + [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("steps", "warmup", "n_layer", "n_head", "n_embd", "vocab", "batch_size", "microbatches",
                     "min_len", "max_len", "seed", "cap_length", "horizon")
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    completed = subprocess.run(command, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if completed.returncode != 0 or not out.exists():
        return {"config": config, "error": completed.stderr[-3000:]}
    return json.loads(out.read_text())


def _table(results: list[dict]) -> str:
    base = next((r["tokens_per_s"] for r in results if r.get("config") == "static-4x1" and "error" not in r), None)
    lines = [
        "| config | tokens/s | vs 4x1 | layouts used (steps) | layout changes | plan ms (mean) | fit s | final loss |",
        "|" + "---|" * 8,
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.3f}x" if base else ""
        used = ", ".join(f"({k}) x{v}" for k, v in sorted(r["layouts"].items(), key=lambda kv: -kv[1]))
        plan = "-" if r["plan_ms_mean"] is None else f"{r['plan_ms_mean']:.1f}"
        lines.append(
            f"| {r['config']} | {r['tokens_per_s']:,.0f} | {ratio} | {used} | {r['layout_changes']} | {plan} | "
            f"{r['fit_s']:.1f} | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--cap-length", type=int, default=64, help="longest length 1 x 4 may run under the cap")
    parser.add_argument("--horizon", type=int, default=4, help="ElasticDepth(migration_horizon=...)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--plot", default=None, help="PNG of elastic-depth's stages and widths per batch")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.only:
            print(f"running {config} ...", file=sys.stderr, flush=True)
            results.append(_run(config, args, Path(tmp) / f"{config}.json"))
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} vocab={args.vocab}; {args.steps} steps of {args.batch_size} "
        f"sequences, lengths lognormal median {2 * args.min_len} in [{args.min_len}, {args.max_len}]; {DEVICES} CPU "
        f"processes, {args.microbatches} microbatches; memory cap = 1x4 at length {args.cap_length}; first "
        f"{args.warmup} steps untimed"
    )
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results) + "\n")
    elastic = next((r for r in results if r.get("config") == "elastic-depth" and "error" not in r), None)
    if args.plot and elastic is not None:
        from lightning_pipe.planning.render import plot_layouts

        steps = elastic["per_step"]
        plot_layouts(
            list(range(len(steps))), [b for _, _, b in steps], [w for w, _, _ in steps], args.plot,
            step_label="batch", title="ElasticDepth on 4 CPU processes: stages (blocks) and widths (ranks) per batch",
        )
        lengths = " ".join(str(n) for _, n, _ in steps)
        print(f"\nwrote {args.plot}; batch lengths in order: {lengths}")
    for r in results:
        if "error" in r:
            print(f"\n{r['config']} failed:\n{r['error']}")


if __name__ == "__main__":
    main()
