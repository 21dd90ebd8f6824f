"""Per-batch repartitioning on real processes: elastic against static partitions, tokens/s.

Trains the unchanged `examples/gpt` GPT on 2 CPU processes (one 2-stage 1F1B pipeline, gloo) on
long-tailed variable-length batches (`examples/gpt/data.py`: lognormal lengths, median 2 x
`--min-len`, clipped to `--max-len`), once per configuration, each in its own fresh processes:

  static-balanced   partition="balanced" (blocks split by parameter count), never changed.
  static-auto       partition="auto": the best partition for the data's longest batch under the
                    meta-device cost model (what a static planner gives), never changed.
  elastic-auto      partition="auto" + ElasticRepartition(trigger="auto"): every batch planned,
                    blocks migrate when the predicted gain over 16 steps beats the measured cost.
  elastic-always    ElasticRepartition(trigger="always"): migrate whenever the best partition for
                    the batch differs (an upper bound on migrations).
  elastic-profiled  PipelineProfiler (measured unit costs) + ElasticRepartition(trigger="auto").

Same seed (same initial weights), same batches in the same order, same steps. tokens/s counts the
tokens of the timed steps (after `--warmup`) over the time from the first callback's
`on_train_batch_start` to `on_train_batch_end`, summed over steps, of the slowest rank: migrations
and any planning not hidden behind the previous step are inside it; data loading, validation and
set-up (the meta probe, the profiler, `partition="auto"`'s scan) are not, and are in the separate
"fit s" column (wall time of the whole `trainer.fit`).

Run from the repository root (about 3 minutes on 2 cores with the defaults):

    python benchmarks/bench_elastic.py
    python benchmarks/bench_elastic.py --steps 80 --only static-auto elastic-auto
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

CONFIGS = ("static-balanced", "static-auto", "elastic-auto", "elastic-always", "elastic-profiled")


def _worker(args: argparse.Namespace) -> None:
    """One configuration: a Lightning fit on 2 processes (the launcher re-runs this command)."""
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_pipe
    from examples.gpt.data import TokenDataModule
    from examples.gpt.model import GPT
    from lightning_pipe.callbacks import ElasticRepartition, PipelineProfiler

    torch.set_num_threads(1)

    class Throughput(L.Callback):
        def __init__(self) -> None:
            self.tokens, self.seconds, self.start, self.losses = 0, 0.0, 0.0, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= args.warmup:
                B, T_plus_1 = batch.shape
                self.tokens += B * (T_plus_1 - 1)
                self.seconds += time.perf_counter() - self.start
            self.losses.append(float(trainer.callback_metrics["train_loss"]))

    config = args.worker
    partition = "balanced" if config == "static-balanced" else "auto"
    strategy = lightning_pipe.ElasticPipelineStrategy(
        num_microbatches=args.microbatches, partition=partition, schedule="1f1b"
    )
    throughput = Throughput()
    callbacks = [throughput]
    if config == "elastic-profiled":
        callbacks.append(PipelineProfiler(repeats=3))
    elastic = None
    if config.startswith("elastic"):
        elastic = ElasticRepartition(trigger="always" if config == "elastic-always" else "auto")
        callbacks.append(elastic)
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
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
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
    history = elastic.history if elastic is not None else []
    partitions = Counter(tuple(step.boundaries) for step in history) if history else Counter({tuple(strategy.boundaries): args.steps})
    result = {
        "config": config,
        "tokens_per_s": throughput.tokens / seconds.item(),
        "timed_tokens": throughput.tokens,
        "timed_s": seconds.item(),
        "fit_s": fit_seconds,
        "final_loss": throughput.losses[-1],
        "partitions": {" ".join(map(str, k)): v for k, v in partitions.items()},
        "migrations": sum(step.migrated for step in history),
        "migrated_mb": sum(step.migrated_bytes for step in history) / 2**20,
        "migration_s": sum(step.migration_seconds for step in history),
        "plan_ms_mean": 1e3 * sum(step.planning_seconds for step in history) / max(1, len(history)),
        "looked_ahead": sum(step.looked_ahead for step in history),
    }
    Path(args.out).write_text(json.dumps(result))


def _run(config: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, __file__, "--worker", config, "--out", str(out)] + [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("steps", "warmup", "n_layer", "n_head", "n_embd", "vocab", "batch_size", "microbatches",
                     "min_len", "max_len", "seed")
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if completed.returncode != 0 or not out.exists():
        return {"config": config, "error": completed.stderr[-3000:]}
    return json.loads(out.read_text())


def _table(results: list[dict]) -> str:
    base = next((r["tokens_per_s"] for r in results if r.get("config") == "static-balanced" and "error" not in r), None)
    header = (
        "| config | tokens/s | vs static-balanced | partitions used (steps) | migrations | migrated MiB | "
        "migration s | plan ms (mean) | fit s | final loss |"
    )
    lines = [header, "|" + "---|" * 10]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed | | | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.3f}x" if base else ""
        used = ", ".join(f"[{k}] x{v}" for k, v in sorted(r["partitions"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['config']} | {r['tokens_per_s']:,.0f} | {ratio} | {used} | {r['migrations']} | "
            f"{r['migrated_mb']:.1f} | {r['migration_s']:.3f} | {r['plan_ms_mean']:.1f} | {r['fit_s']:.1f} | "
            f"{r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192, help="a large head makes short batches head-heavy")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1234)
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
        f"sequences, lengths lognormal median {2 * args.min_len} in [{args.min_len}, {args.max_len}]; 2 CPU processes, "
        f"1F1B, {args.microbatches} microbatches; first {args.warmup} steps untimed"
    )
    print(_table(results))
    for r in results:
        if "error" in r:
            print(f"\n{r['config']} failed:\n{r['error']}")


if __name__ == "__main__":
    main()
