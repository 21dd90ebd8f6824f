"""Training throughput on variable-length data: real tokens per second, torch pipelining vs lightning-pipe.

The workload is what a user fine-tuning a decoder on mixed-length text has: every batch holds
``--batch`` sequences of a long-tailed length trace, padded by the collator (right side, an
``attention_mask`` and ``-100`` labels, as transformers' collators make them). The model is a small
decoder LM written as a user writes it (``DecoderLM``: rotary positions, SDPA with a causal and
key-padding mask, token-averaged cross-entropy), the same in every row. Rows:

  torch-max        ``torch.distributed.pipelining.Schedule1F1B``, every batch padded to the trace's
                   maximum length (static shapes: one stage and schedule for the whole run).
  torch-rebuilt    Schedule1F1B, each batch padded to its own longest sequence; the stage and the
                   schedule are rebuilt for every new length and kept per length (what a careful
                   torch user does: torch's stages fix their shapes).
  torch-bucketed   as ``torch-rebuilt`` with each batch padded up to a multiple of ``--bucket``
                   tokens, so that few lengths (and stage rebuilds) occur.
  ddp              ``DistributedDataParallel``, each rank half of every batch, padded to its own longest.
  lp-padded        lightning-pipe 1F1B, ``trim_padding=False``: microbatches at the batch's length.
  lp               lightning-pipe 1F1B, defaults: each microbatch cut to its own real tokens, samples
                   grouped by length (checked exact on the first batch).
  lp-repartition   ``lp`` plus the ``ElasticRepartition`` callback.
  lp-auto          ``lp`` plus the ``AutoPlanner`` callback: partition, family, microbatching and
                   memory plan chosen jointly per batch (the family starts as 1F1B).
  lp-auto-eager    ``lp-auto`` with its lookahead thread at the training thread's CPU priority (an
                   ablation: the library lowers it on Linux, ``callbacks/_lookahead.py``).
  lp-auto-cal      ``lp-auto`` with ``AutoPlanner(calibrate=True)``: each family priced at its
                   measured over predicted steps (an option, off by default; see its docstring).
  lp-auto-1f1b     ``AutoPlanner(families=("1f1b",), microbatching=("even",))``: only the partition
                   lever left (an ablation: what the planner's machinery costs apart from its choices).

Every pipeline row uses 2 processes (gloo, 1 thread each), 2 stages of 3 blocks, ``--microbatches``
microbatches and AdamW; the same seed, batches and number of steps. The rows run one after
the other in fresh processes, in an order rotated every round, ``--rounds`` times; the table shows
each row's median over rounds of its median step. Only real (unpadded) tokens count. "limit"
is the speed-up over ``torch-max`` if every computed position were a real token (the trace's
padded positions over its real tokens): how far each row is from what cutting padding can buy.

    python benchmarks/bench_varlen.py                      # FLANv2-like trace, 3 rounds (~6 min)
    python benchmarks/bench_varlen.py --trace github --rounds 5
    python benchmarks/bench_varlen.py --only torch-rebuilt lp --rounds 3

Traces (``lightning_pipe.planning.traces``): FLANv2-like and GitHub-like lengths, scaled so that
their median is ``--median`` tokens and capped at ``--max-len`` (a CPU-sized version of their shape).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.harness import StepTimer, run_ranks  # noqa: E402

CONFIGS = {
    "torch-max": "torch Schedule1F1B, padded to the trace max",
    "torch-rebuilt": "torch Schedule1F1B, padded per batch, rebuilt per length",
    "torch-bucketed": "torch Schedule1F1B, padded to a multiple of --bucket",
    "ddp": "torch DDP, padded per rank batch",
    "lp-padded": "lightning-pipe 1F1B, trim_padding=False",
    "lp": "lightning-pipe 1F1B (defaults)",
    "lp-repartition": "lightning-pipe 1F1B + ElasticRepartition",
    "lp-auto": "lightning-pipe + AutoPlanner (joint plan)",
    "lp-auto-eager": "lp-auto, lookahead at the step's CPU priority",
    "lp-auto-cal": "lp-auto, AutoPlanner(calibrate=True)",
    "lp-auto-1f1b": "lp-auto, 1F1B and even microbatches only",
}
ABLATIONS = ("lp-auto-eager", "lp-auto-cal", "lp-auto-1f1b")
VOCAB = 256

# ----------------------------------------------------------------------------- model and data


def rotary(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[T, head_dim / 2]`` of rotary position embeddings."""
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inverse[None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-norm decoder block: rotary multi-head attention (SDPA) and a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` boolean: causal, and padded keys masked out."""
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask[:, None, None, :].bool()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over the counted (not -100) targets."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


class DecoderLM(L.LightningModule):
    """A small decoder LM over transformers-style dict batches, written with no pipeline in mind."""

    def __init__(self, layers: int = 6, width: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(torch.arange(input_ids.shape[1], device=input_ids.device), self.embed.embedding_dim // self.heads)
        mask = attention_mask_4d(attention_mask)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(self.norm(x))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = token_loss(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trace_lengths(args: argparse.Namespace) -> list[list[int]]:
    """Real lengths of every batch's sequences (warmup included), deterministic by seed."""
    from lightning_pipe.planning.traces import sample_flan_lengths, sample_github_lengths

    rng = np.random.default_rng(args.seed)
    count = (args.warmup + args.steps) * args.batch
    raw = sample_flan_lengths(count, rng, batch_size=args.batch) if args.trace == "flan" else sample_github_lengths(count, rng)
    lengths = np.clip(np.round(raw * args.median / np.median(raw)), 4, args.max_len).astype(int)
    return [lengths[i * args.batch : (i + 1) * args.batch].tolist() for i in range(args.warmup + args.steps)]


def pad(real: list[int], length: int, generator: torch.Generator) -> dict:
    """A right-padded batch of ``len(real)`` sequences at ``length`` positions."""
    mask = (torch.arange(length)[None, :] < torch.tensor(real)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(real), length), generator=generator).masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_batches(args: argparse.Namespace, to_max: bool = False, bucket: int = 1) -> list[dict]:
    """Every step's batch: each padded to its longest sequence (rounded up to a multiple of
    ``bucket``), or to the trace's maximum."""
    generator = torch.Generator().manual_seed(args.seed)
    lengths = trace_lengths(args)
    return [pad(real, args.max_len if to_max else min(args.max_len, -(-max(real) // bucket) * bucket), generator)
            for real in lengths]


def real_tokens(batch: dict) -> int:
    return int(batch["attention_mask"].sum())


def build_model(args: argparse.Namespace) -> DecoderLM:
    torch.manual_seed(args.seed)
    return DecoderLM(args.layers, args.width, args.heads)


# ----------------------------------------------------------------------------- torch rows


class FirstStage(nn.Module):
    """Embedding and the first half of the blocks; passes the key-padding mask on."""

    def __init__(self, model: DecoderLM, half: int) -> None:
        super().__init__()
        self.embed, self.heads = model.embed, model.heads
        self.blocks = nn.ModuleList(model.blocks[:half])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary(torch.arange(input_ids.shape[1]), self.embed.embedding_dim // self.heads)
        mask = attention_mask_4d(attention_mask)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return x, attention_mask


class LastStage(nn.Module):
    """The second half of the blocks, the final norm and the head."""

    def __init__(self, model: DecoderLM, half: int) -> None:
        super().__init__()
        self.heads, width = model.heads, model.embed.embedding_dim
        self.blocks = nn.ModuleList(model.blocks[half:])
        self.norm, self.head = model.norm, model.head
        self.head_dim = width // model.heads

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(torch.arange(x.shape[1]), self.head_dim)
        mask = attention_mask_4d(attention_mask)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(self.norm(x))


def timed(args: argparse.Namespace, step, barrier) -> list[float]:
    seconds = []
    for i in range(args.warmup + args.steps):
        barrier()
        start = time.perf_counter()
        step(i)
        barrier()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def run_torch_rank(rank: int, args: argparse.Namespace, store: str, out: str, config: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    batches = make_batches(args, to_max=config == "torch-max", bucket=args.bucket if config == "torch-bucketed" else 1)
    model = build_model(args)
    half = args.layers // 2
    module = FirstStage(model, half) if rank == 0 else LastStage(model, half)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    schedules: dict[int, Schedule1F1B] = {}

    def step(i: int) -> None:
        batch = batches[i]
        length = batch["input_ids"].shape[1]
        if length not in schedules:  # torch's stages fix their shapes: one stage and schedule per length
            stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
            schedules[length] = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=token_loss)
        if rank == 0:
            schedules[length].step(batch["input_ids"], batch["attention_mask"])
        else:
            schedules[length].step(target=batch["labels"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed(args, step, dist.barrier)
    write(out, config, rank, seconds, batches, args)
    dist.destroy_process_group()


def run_ddp_rank(rank: int, args: argparse.Namespace, store: str, out: str, config: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(args.seed)
    batches = []
    for real in trace_lengths(args):
        mine = real[rank * len(real) // 2 : (rank + 1) * len(real) // 2]
        batches.append(pad(mine, max(mine), generator))
    model = nn.parallel.DistributedDataParallel(build_model(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        batch = batches[i]
        token_loss(model(batch["input_ids"], batch["attention_mask"]), batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed(args, step, dist.barrier)
    write(out, config, rank, seconds, make_batches(args), args)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- lightning-pipe rows


def run_lightning_pipe(args: argparse.Namespace, out: str, config: str) -> None:
    from lightning_pipe import ElasticPipelineStrategy
    from lightning_pipe.callbacks import AutoPlanner, ElasticRepartition

    torch.set_num_threads(1)
    batches = make_batches(args)

    def save(trainer, seconds: list[float]) -> None:
        write(out, config, trainer.global_rank, seconds, batches, args)

    planners = {
        "lp-repartition": [ElasticRepartition()], "lp-auto": [AutoPlanner()], "lp-auto-eager": [AutoPlanner()],
        "lp-auto-cal": [AutoPlanner(calibrate=True)],
        "lp-auto-1f1b": [AutoPlanner(families=("1f1b",), microbatching=("even",))],
    }
    if config == "lp-auto-eager":
        from lightning_pipe.callbacks import _lookahead

        _lookahead._lowest_priority = lambda: None  # the ablation: the thread keeps the default priority
    callbacks = [StepTimer(args.warmup, save), *planners.get(config, [])]
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=args.microbatches, schedule="1f1b", trim_padding=config != "lp-padded"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.warmup + args.steps, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, use_distributed_sampler=False,
    )
    trainer.fit(build_model(args), torch.utils.data.DataLoader(batches, batch_size=None))


# ----------------------------------------------------------------------------- driver


def write(out: str, config: str, rank: int, seconds: list[float], batches: list[dict], args: argparse.Namespace) -> None:
    tokens = [real_tokens(b) for b in batches[args.warmup :]]
    Path(out, f"{config}-rank{rank}.json").write_text(json.dumps({"seconds": seconds, "tokens": tokens}))


def run_worker(args: argparse.Namespace) -> None:
    store = f"file://{Path(args.out) / (args.worker + '.store')}"
    if args.worker.startswith("torch"):
        mp.spawn(run_torch_rank, args=(args, store, args.out, args.worker), nprocs=2)
    elif args.worker == "ddp":
        mp.spawn(run_ddp_rank, args=(args, store, args.out, args.worker), nprocs=2)
    else:
        run_lightning_pipe(args, args.out, args.worker)


def launch(config: str, args: argparse.Namespace, out: str) -> float:
    """Run ``config`` in fresh processes; its real tokens per second (median step of the slowest rank)."""
    ranks = run_ranks(__file__, config, out, args, (
        "steps", "warmup", "batch", "microbatches", "trace", "median", "max_len", "bucket", "layers", "width", "heads",
        "seed"))
    step = [max(pair) for pair in zip(ranks[0]["seconds"], ranks[1]["seconds"])]
    # real tokens over the steps' median time: the median step scaled to the mean real tokens a step
    return statistics.fmean(ranks[0]["tokens"]) / statistics.median(step)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", choices=list(CONFIGS), default=[c for c in CONFIGS if c not in ABLATIONS],
        help="rows to run (default: all but the ablations lp-auto-eager, lp-auto-cal and lp-auto-1f1b)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="times every row runs, order rotated each round")
    parser.add_argument("--steps", type=int, default=16, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--trace", choices=["flan", "github"], default="flan")
    parser.add_argument("--median", type=int, default=64, help="median sequence length of the scaled trace")
    parser.add_argument("--max-len", type=int, default=512, help="longest sequence (the trace is capped here)")
    parser.add_argument("--bucket", type=int, default=64, help="torch-bucketed pads up to a multiple of this")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    load_before = os.getloadavg()[0]
    results: dict[str, list[float]] = {config: [] for config in args.only}
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(args.rounds):
            shift = round_ % len(args.only)
            for config in args.only[shift:] + args.only[:shift]:
                results[config].append(launch(config, args, out))
                print(f"round {round_}: {config:15s} {results[config][-1]:9,.0f} real tokens/s", flush=True)
    lengths = trace_lengths(args)[args.warmup :]
    real = sum(sum(b) for b in lengths)
    limit = len(lengths) * args.batch * args.max_len / real
    baseline = statistics.median(results["torch-max"]) if "torch-max" in results else None
    rebuilt = statistics.median(results["torch-rebuilt"]) if "torch-rebuilt" in results else None
    table = Table(title=f"Real tokens/s on a {args.trace}-like trace (median {args.median}, max {args.max_len})")
    for column in ("configuration", "real tokens/s", "vs torch-max", "vs torch-rebuilt", "of the limit", "rounds"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for config, values in results.items():
        median = statistics.median(values)
        table.add_row(
            f"{config}: {CONFIGS[config]}", f"{median:,.0f}",
            f"{median / baseline:.2f}x" if baseline else "-", f"{median / rebuilt:.2f}x" if rebuilt else "-",
            f"{median / baseline / limit:.0%}" if baseline else "-", " ".join(f"{v:,.0f}" for v in values),
        )
    console = Console(width=160)
    console.print(table)
    console.print(
        f"limit: {limit:.2f}x torch-max (every computed position a real token). How: `python "
        f"{' '.join(sys.argv)}` on {os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, gloo, "
        f"2 processes x 1 thread; DecoderLM layers={args.layers} width={args.width} heads={args.heads}; "
        f"{args.batch} sequences/step, {args.microbatches} microbatches, {args.steps} timed steps after {args.warmup}; "
        f"{args.rounds} rounds, order rotated; 1-minute load before: {load_before:.2f}.",
        markup=False,
    )


if __name__ == "__main__":
    main()
