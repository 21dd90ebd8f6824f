"""Training throughput and memory of one GPT under four ways of running it on CPU.

Configurations, each run in its own fresh subprocess(es) started by this script, side by side:

  (a)  single          one process, 1 thread: the whole global batch per step.
  (a2) single-2t       one process, 2 threads (same cores as the 2-process runs).
  (b)  ddp             2 processes, plain `torch.nn.parallel.DistributedDataParallel`; each
                       rank takes half of every global batch.
  (c)  torch-1f1b      2 processes, `torch.distributed.pipelining.Schedule1F1B`; the GPT's
                       blocks are split in half by hand (rank 0: embeddings + first half,
                       rank 1: second half + final norm + head + loss).
  (d)  lightning-pipe  2 processes, `L.Trainer(strategy=ElasticPipelineStrategy(schedule="1f1b",
                       num_microbatches=M))` on the unchanged `examples/gpt/model.py` module;
                       reported as "not available" until `lightning_pipe` provides the strategy.

All of them train the same `examples/gpt` GPT (same seed, so the same initial weights) with
AdamW on the same FIXED-length token batches (`examples/gpt/data.py`, `fixed_len`), made
before the run in every row (making one costs about 1 ms of CPU, which a row that made them per
step would pay inside its steps and the others not), the same global batch, the same number of microbatches for the pipelines, and the same number of steps.
The first `--warmup` steps are not timed. Distributed runs use gloo, rendezvous through a
`file://` store, and `torch.set_num_threads(1)` in every rank (`OMP_NUM_THREADS=1`).

Measured per rank: the wall time of every timed step, between barriers (a step lasts as long as
its slowest rank), reported as tokens/s = global batch x sequence length / median step time (the
median resists other load on a shared machine; the mean is shown beside it), peak resident memory (`ru_maxrss`), its growth over the
process's resident memory just before the model is built (what the model, its gradients,
optimizer state and activations added), and the bytes of parameters the rank holds. The final
loss column is a sanity check: every configuration computes the same mathematical step.

Run from the repository root (about one and a half minutes on 2 cores):

    python benchmarks/bench_throughput.py
    python benchmarks/bench_throughput.py --steps 40 --n-layer 12 --only ddp torch-1f1b
    python benchmarks/bench_throughput.py --pairs 5 --breakdown     # torch-1f1b vs lightning-pipe
    python benchmarks/bench_throughput.py --pairs 5 --schedules 1f1b zb_h1 zbv
    python benchmarks/bench_throughput.py --pairs 7 --schedules 1f1b zbv --interleave
    python benchmarks/bench_throughput.py --pairs 7 --schedules zbv zbv@auto --interleave

``--pairs N`` runs torch's Schedule1F1B and lightning-pipe (under each family of ``--schedules``,
default 1f1b) N rounds, rotating the order every round, and prints each round's throughput ratios
and their medians, and the CPU time per step of every rank. A row may name its partition:
``zbv@auto`` runs ``partition="auto"`` (the partition whose simulated step is fastest for the
longest batch, under the meta-device cost model), ``zbv@2-1-3-2`` blocks per stage; without ``@``
the strategy's default ``"balanced"``; ``~measured`` at the end decides zero-bubble merges again on
the first steps' measured times (``merge_split_backward="measured"``). ``--breakdown`` adds the
``PipelineMonitor`` to the lightning-pipe runs and prints where rank 0's step went (compute,
receive waits, sends, the executor between actions, everything outside the program) and the compute
of each kind of action on both ranks (``F``, ``B``; ``I`` and ``W`` for zero-bubble families: what the
split backward costs against ``B``); the monitor gathers per-rank timings every step, which costs a
little of the throughput it reports.

``--interleave`` (with ``--pairs``) runs every round in one pair of processes: one Lightning fit per
family, and beside every one of its steps one step of torch's Schedule1F1B on the same batch (after
it in even rounds, before it in odd ones), each timed between barriers; a family's ratio is to the
torch steps beside it. On this shared machine a process's speed drifts 10-15% over tens of seconds
and 5-8% from one launch to the next; rows run one after the other carry both (rounds of 0.92-1.09),
rows alternated step by step neither (rounds within about 2%). It is the mode to quote.
"""

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from examples.gpt.data import TokenBatches
from examples.gpt.model import GPT

CONFIGS = {
    "single": "(a) single, 1 thread",
    "single-2t": "(a2) single, 2 threads",
    "ddp": "(b) torch DDP",
    "torch-1f1b": "(c) torch pipelining 1F1B",
    "lightning-pipe": "(d) lightning_pipe 1F1B",
}


@dataclass
class RankResult:
    """What one rank measured."""

    config: str
    rank: int
    world_size: int
    tokens_per_step: int
    step_seconds: list[float]
    peak_rss_bytes: int
    rss_growth_bytes: int
    param_bytes: int
    final_loss: float
    breakdown: dict = field(default_factory=dict)
    cpu_seconds: list[float] = field(default_factory=list)
    kind_compute: dict = field(default_factory=dict)  # --breakdown: compute per action kind, all ranks


def peak_rss_bytes() -> int:
    """Returns this process's peak resident set size in bytes (`ru_maxrss` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_model(args: argparse.Namespace) -> GPT:
    """Returns the GPT every configuration trains, initialised from `args.seed`."""
    torch.manual_seed(args.seed)
    return GPT(
        vocab_size=256,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        learning_rate=3e-3,
        weight_decay=0.1,
    )


def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """AdamW exactly as `GPT.configure_optimizers` builds it, over `module`'s parameters."""
    params = list(module.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
    )


def make_batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """Returns the `[global_batch, seq_len + 1]` batches of every step, warmup included."""
    data = TokenBatches(args.warmup + args.steps, args.global_batch, fixed_len=args.seq_len, seed=args.seed)
    return [data[i] for i in range(len(data))]


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters that hold real storage (meta parameters are free)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits `[B, T, V]` against targets `[B, T]`."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def timed_steps(args, step_fn, barrier=lambda: None) -> tuple[list[float], list[float], float]:
    """Runs warmup steps, then times `args.steps` steps, each between barriers.

    Returns:
        The wall time of each timed step in seconds, the CPU time the process (all its threads)
        spent in it, and the loss of the last step.
    """
    loss = float("nan")
    for i in range(args.warmup):
        loss = step_fn(i)
    step_seconds, cpu_seconds = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = step_fn(i)
        barrier()
        step_seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    return step_seconds, cpu_seconds, loss


# ----------------------------------------------------------------------------- (a) one process


def run_single(args: argparse.Namespace, config: str, threads: int) -> list[RankResult]:
    torch.set_num_threads(threads)
    batches = make_batches(args)
    rss_before = peak_rss_bytes()
    model = build_model(args)
    optimizer = make_optimizer(model)

    def step(i: int) -> float:
        x, y = batches[i][:, :-1], batches[i][:, 1:]
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    *seconds, loss = timed_steps(args, step)
    return [result(args, config, 0, 1, seconds, rss_before, param_bytes(model), loss)]


def result(args, config, rank, world_size, seconds, rss_before, held, loss) -> RankResult:
    """One rank's measurement; `seconds` is (wall seconds per step, CPU seconds per step)."""
    peak = peak_rss_bytes()
    tokens = args.global_batch * args.seq_len
    step_seconds, cpu_seconds = seconds
    return RankResult(
        config, rank, world_size, tokens, step_seconds, peak, peak - rss_before, held, loss, cpu_seconds=cpu_seconds
    )


# ----------------------------------------------------------------------------- (b) DDP


def run_ddp_rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    batches = make_batches(args)
    rss_before = peak_rss_bytes()
    model = nn.parallel.DistributedDataParallel(build_model(args))
    optimizer = make_optimizer(model)
    rows = slice(rank * args.global_batch // 2, (rank + 1) * args.global_batch // 2)

    def step(i: int) -> float:
        batch = batches[i][rows]
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()  # DDP averages the gradients of the two halves
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        return mean_loss.item() / 2

    *seconds, loss = timed_steps(args, step, dist.barrier)
    write(out, result(args, "ddp", rank, 2, seconds, rss_before, param_bytes(model), loss))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- (c) torch 1F1B


class FirstStage(nn.Module):
    """Embeddings and the first half of the blocks: `[B, T]` token ids -> `[B, T, C]`."""

    def __init__(self, gpt: GPT, num_blocks: int) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[:num_blocks])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)  # idx: [B, T]
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The second half of the blocks, final norm and head: `[B, T, C]` -> logits `[B, T, V]`."""

    def __init__(self, gpt: GPT, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[num_blocks:])
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def run_torch_1f1b_rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    write(out, torch_1f1b_result(rank, args))
    dist.destroy_process_group()


def torch_1f1b_result(rank: int, args: argparse.Namespace) -> RankResult:
    """This rank's measurement of torch's Schedule1F1B, in the process group already initialised."""
    batches = make_batches(args)
    rss_before = peak_rss_bytes()
    step, module = torch_1f1b_step(rank, args, batches)
    *seconds, loss = timed_steps(args, step, dist.barrier)
    return result(args, "torch-1f1b", rank, 2, seconds, rss_before, param_bytes(module), loss)


def torch_1f1b_step(rank: int, args: argparse.Namespace, batches: list[torch.Tensor]):
    """This rank's half of the GPT under torch's Schedule1F1B: a function that runs step ``i`` on
    ``batches[i]`` (schedule, optimizer step, the loss broadcast) and returns the loss; and the module."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    gpt = build_model(args)  # the full model briefly, so both halves get the same init as (a)
    half = args.n_layer // 2
    module = FirstStage(gpt, half) if rank == 0 else LastStage(gpt, half)
    del gpt
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=lm_loss)
    optimizer = make_optimizer(module)

    def step(i: int) -> float:
        x, y = batches[i][:, :-1], batches[i][:, 1:]
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(mean_loss, src=1)
        return mean_loss.item()

    return step, module


# ----------------------------------------------------------------------------- (d) lightning_pipe


def lightning_pipe_strategy_class():
    """Returns `lightning_pipe.ElasticPipelineStrategy`, or None while it does not exist."""
    try:
        import lightning_pipe
    except ImportError:
        return None
    return getattr(lightning_pipe, "ElasticPipelineStrategy", None)


def run_lightning_pipe(args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    outcome, _ = lightning_pipe_result(args)
    write(out, outcome)


def lightning_pipe_result(args: argparse.Namespace, callbacks: list = (), first: bool = False) -> tuple[RankResult, object]:
    """This rank's measurement of `L.Trainer(strategy=ElasticPipelineStrategy(...))` under
    `args.schedule`, and the trainer (whose strategy holds the process groups it made). ``callbacks``
    run after the timer's hooks, or before them with ``first`` (either way outside its time)."""
    import lightning as L

    strategy_class = lightning_pipe_strategy_class()
    rss_before = peak_rss_bytes()
    measured = []

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.start = self.cpu_start = 0.0
            self.step_seconds, self.cpu_seconds = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx >= args.warmup:
                dist.barrier()
                self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= args.warmup:
                dist.barrier()
                self.step_seconds.append(time.perf_counter() - self.start)
                self.cpu_seconds.append(time.process_time() - self.cpu_start)

        def on_train_end(self, trainer, pl_module) -> None:
            seconds = self.step_seconds, self.cpu_seconds
            loss = trainer.callback_metrics.get("train_loss", torch.tensor(float("nan"))).item()
            held = param_bytes(pl_module)
            rank = trainer.global_rank
            outcome = result(args, "lightning-pipe", rank, 2, seconds, rss_before, held, loss)
            if monitor is not None and monitor.history:
                timed = monitor.history[args.warmup :]
                outcome.breakdown = {k: statistics.median(r.time_s[k] for r in timed) for k in timed[0].time_s}
                outcome.kind_compute = {
                    k: statistics.median(r.kind_compute_s.get(k, 0.0) for r in timed) for k in timed[0].kind_compute_s
                }
            measured.append(outcome)

    monitor = None
    if args.breakdown:
        from lightning_pipe.callbacks import PipelineMonitor

        monitor = PipelineMonitor(log_every_n_steps=1, timeline_every_n_steps=0)

    # the batches made before the run, as the torch rows have them (generating one costs about 1 ms)
    data = make_batches(args)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_class(num_microbatches=args.microbatches, **strategy_options(args.schedule)),
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*(callbacks if first else ()), Timer(), *([monitor] if monitor else ()), *(() if first else callbacks)],
        # One pipeline replica (pp=2, dp=1) needs no sharding; without this Lightning would
        # shuffle the batches and the final loss could not be compared with the other rows.
        use_distributed_sampler=False,
    )
    trainer.fit(build_model(args), torch.utils.data.DataLoader(data, batch_size=None))
    return measured[0], trainer


def strategy_options(row: str) -> dict:
    """The strategy's arguments for a lightning-pipe row ``FAMILY[@PARTITION][~measured]``: ``zbv``, ``zbv@auto``
    (``partition="auto"``: the simulated-fastest partition for the longest batch, strategies/costs.py),
    ``zbv@2-1-3-2`` (blocks per stage); without ``@``, the strategy's default ``"balanced"``. ``~measured``:
    ``merge_split_backward="measured"`` (zero-bubble merges decided again on measured times)."""
    error = ValueError(
        f"`{row}`: a row is FAMILY[@PARTITION][~measured], PARTITION auto, balanced or blocks per stage (2-1-3-2)"
    )
    head, _, merge = row.partition("~")
    if merge not in ("", "measured"):
        raise error
    schedule, _, partition = head.partition("@")
    options = {"schedule": schedule, **({"merge_split_backward": merge} if merge else {})}
    if not partition:
        return options
    if partition in ("auto", "balanced"):
        return {**options, "partition": partition}
    try:
        return {**options, "partition": [int(blocks) for blocks in partition.split("-")]}
    except ValueError:
        raise error from None


# ----------------------------------------------------------------------------- steps interleaved


def run_interleaved_rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    """``--pairs`` rounds with ``--interleave``: in these two processes, one `L.Trainer` fit per family of
    ``--schedules`` (order rotated every round), and beside every lightning-pipe step one step of torch's
    Schedule1F1B on the same batch index, timed the same way (between barriers): after it in even
    rounds, before it in odd ones. Each fit's ranks write
    the lightning-pipe row to ``out/<round>-<family>/`` and the torch row to ``out/<round>-torch-<family>/``.

    This machine's speed drifts by 10-15% over tens of seconds (other tenants), and a process's speed
    by 5-8% from one launch to the next: rows run one after the other carry both, rows alternated step
    by step in the same processes neither. Lightning finds the processes made (``LOCAL_RANK`` set) and
    the default group initialised, so each trainer runs in place; the groups a strategy made are
    destroyed after its fit, so that later fits do not carry earlier ones' gloo threads.
    """
    import lightning as L

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    batches = make_batches(args)

    class TorchStepBeside(L.Callback):
        """Beside every lightning-pipe step (after it, or ``before`` it), torch's step on the same batch,
        timed as `timed_steps` does."""

        def __init__(self, before: bool) -> None:
            self.before = before
            self.step_seconds, self.cpu_seconds, self.loss = [], [], float("nan")

        def on_train_start(self, trainer, pl_module) -> None:
            self.rss_before = peak_rss_bytes()
            self.step, self.module = torch_1f1b_step(rank, args, batches)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.before:
                self.run(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if not self.before:
                self.run(batch_idx)

        def run(self, batch_idx: int) -> None:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            self.loss = self.step(batch_idx)
            dist.barrier()
            if batch_idx >= args.warmup:
                self.step_seconds.append(time.perf_counter() - start)
                self.cpu_seconds.append(time.process_time() - cpu_start)

        def result(self) -> RankResult:
            seconds = self.step_seconds, self.cpu_seconds
            return result(args, "torch-1f1b", rank, 2, seconds, self.rss_before, param_bytes(self.module), self.loss)

    for round_, order in enumerate(round_orders(args)):
        for schedule in (s for s in order if s is not None):
            torch_row = TorchStepBeside(before=round_ % 2 == 1)  # which of the two runs first alternates
            row_args = argparse.Namespace(**{**vars(args), "schedule": schedule})
            outcome, trainer = lightning_pipe_result(row_args, callbacks=[torch_row], first=torch_row.before)
            destroy_strategy_groups(trainer.strategy)
            for name, rank_result in ((schedule, outcome), (f"torch-{schedule}", torch_row.result())):
                directory = Path(out, f"{round_}-{name}")
                directory.mkdir(exist_ok=True)
                write(str(directory), rank_result)
            del trainer, torch_row
            gc.collect()
    dist.destroy_process_group()


def destroy_strategy_groups(strategy) -> None:
    """Destroy the process groups an `ElasticPipelineStrategy` made at setup (this rank's)."""
    groups = strategy.groups
    found = [groups.pipeline, groups.data_parallel, groups.ends, groups.outcome, strategy.sharded_checkpoints.group]
    unique = {id(g): g for g in found if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER}
    for group in unique.values():
        dist.destroy_process_group(group)


# ----------------------------------------------------------------------------- driver


def write(out: str, rank_result: RankResult) -> None:
    path = Path(out) / f"{rank_result.config}-rank{rank_result.rank}.json"
    path.write_text(json.dumps(asdict(rank_result)))


def run_worker(args: argparse.Namespace) -> None:
    """Runs one configuration inside this (sub)process; ranks write JSON files to `args.out`."""
    store = f"file://{Path(args.out) / (args.worker + '.store')}"
    if args.worker in ("single", "single-2t"):
        threads = 1 if args.worker == "single" else 2
        for rank_result in run_single(args, args.worker, threads):
            write(args.out, rank_result)
    elif args.worker == "ddp":
        mp.spawn(run_ddp_rank, args=(args, store, args.out), nprocs=2)
    elif args.worker == "torch-1f1b":
        mp.spawn(run_torch_1f1b_rank, args=(args, store, args.out), nprocs=2)
    elif args.worker == "lightning-pipe":
        run_lightning_pipe(args, args.out)
    elif args.worker == "interleaved":
        mp.spawn(run_interleaved_rank, args=(args, store, args.out), nprocs=2)


def launch(config: str, args: argparse.Namespace, out: str) -> tuple[list[RankResult], str]:
    """Runs `config` in a fresh subprocess; returns its rank results and an error text."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", config, "--out", out]
    command += forwarded_flags(args)
    if config == "interleaved":
        command += ["--pairs", str(args.pairs), "--schedules", *args.schedules, "--interleave"]
    env = dict(os.environ, OMP_NUM_THREADS="1" if config != "single-2t" else "2")
    env["PYTHONWARNINGS"] = "ignore"
    completed = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    results = [RankResult(**json.loads(path.read_text())) for path in sorted(Path(out).glob(f"{config}-rank*.json"))]
    error = "" if completed.returncode == 0 else completed.stderr.strip().splitlines()[-1]
    return results, error


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    names = ["steps", "warmup", "global_batch", "microbatches", "seq_len", "n_layer", "n_head", "n_embd", "seed"]
    flags = [item for name in names for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    return flags + ["--schedule", args.schedule or "1f1b"] + (["--breakdown"] if args.breakdown else [])


def print_table(args, rows: dict[str, tuple[list[RankResult], str]], load_before: float) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1024**2
    reference = None
    table = Table(title="Training throughput on CPU (fixed-length batches)")
    for column in (
        "configuration",
        "ranks",
        "tokens/s (median step)",
        "tokens/s (mean)",
        "vs first row",
        "peak RSS MiB / rank",
        "RSS growth MiB / rank",
        "param MiB / rank",
        "final loss",
    ):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for config, (results, error) in rows.items():
        if not results:
            table.add_row(CONFIGS[config], "-", "failed" if error else "not available", *["-"] * 6)
            continue
        # A step lasts as long as its slowest rank.
        step_seconds = [max(times) for times in zip(*(r.step_seconds for r in results))]
        median = statistics.median(step_seconds)
        mean = statistics.fmean(step_seconds)
        reference = reference or results[0].tokens_per_step / median
        table.add_row(
            CONFIGS[config],
            str(len(results)),
            f"{results[0].tokens_per_step / median:,.0f}",
            f"{results[0].tokens_per_step / mean:,.0f}",
            f"{results[0].tokens_per_step / median / reference:.2f}x",
            " / ".join(f"{r.peak_rss_bytes / mib:.0f}" for r in results),
            " / ".join(f"{r.rss_growth_bytes / mib:.1f}" for r in results),
            " / ".join(f"{r.param_bytes / mib:.2f}" for r in results),
            f"{results[-1].final_loss:.4f}",
        )
    console = Console() if sys.stdout.isatty() else Console(width=140)
    console.print(table)
    for config, (results, error) in rows.items():
        if error:
            console.print(f"{CONFIGS[config]} failed: {error}", markup=False)
    console.print(
        f"How: `{' '.join([Path(sys.executable).name] + sys.argv)}` on {os.cpu_count()} CPU cores "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}, gloo. "
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} vocab=256; "
        f"global batch {args.global_batch} x {args.seq_len} tokens (fixed length); "
        f"{args.microbatches} microbatches for the pipelines; {args.steps} timed steps after "
        f"{args.warmup} warmup steps; 1 thread per rank except (a2). Each configuration ran in "
        "its own fresh processes, one after the other. tokens/s = global batch x sequence length "
        "/ step time (median or mean over timed steps). RSS growth = peak RSS minus RSS before "
        "the model was built."
    )
    console.print(f"1-minute load average before the run: {load_before:.2f}.", markup=False)
    if load_before > 0.5:
        console.print(
            "Other processes were using the CPU: numbers can be skewed; rerun on a quiet machine.",
            style="bold yellow",
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--microbatches", type=int, default=4, help="per step (pipelines)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=0, help="rotate torch-1f1b and lightning-pipe N rounds")
    parser.add_argument(
        "--schedules", nargs="+", default=["1f1b"],
        help="lightning-pipe rows in --pairs: FAMILY[@PARTITION] (zbv, zbv@auto, zbv@2-1-3-2)",
    )
    parser.add_argument("--schedule", default="1f1b", help="the lightning-pipe run's family (one run)")
    parser.add_argument("--breakdown", action="store_true", help="where lightning-pipe's step goes (monitor)")
    parser.add_argument(
        "--interleave", action="store_true",
        help="with --pairs: one pair of processes, a torch step beside every lightning-pipe step",
    )
    parser.add_argument("--worker", choices=[*CONFIGS, "interleaved"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.global_batch % 2 or args.global_batch % args.microbatches or args.n_layer < 2:
        parser.error(
            f"Need an even `--global-batch` divisible by `--microbatches` and `--n-layer` >= 2; "
            f"got {args.global_batch}, {args.microbatches}, {args.n_layer}."
        )
    for row in {args.schedule, *args.schedules}:
        try:
            strategy_options(row)
        except ValueError as error:
            parser.error(str(error))
    if args.interleave and not args.pairs:
        parser.error("`--interleave` alternates the rows of `--pairs` rounds: give `--pairs N` too.")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    load_before = os.getloadavg()[0]
    if args.pairs:
        run_pairs(args, load_before)
        return
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for config in args.only:
            if config == "lightning-pipe" and lightning_pipe_strategy_class() is None:
                rows[config] = ([], "")
                continue
            print(f"running {CONFIGS[config]} ...", flush=True)
            rows[config] = launch(config, args, out)
    print_table(args, rows, load_before)


def round_orders(args: argparse.Namespace) -> list[list[str | None]]:
    """The rows of each ``--pairs`` round (None: torch's Schedule1F1B), the order rotated every round.
    With ``--interleave`` torch runs beside every row instead of as one, so only the families rotate
    (rotating a None that is then skipped ran the first family first in two rounds of three)."""
    entries = list(args.schedules) if args.interleave else [None, *args.schedules]
    return [entries[r % len(entries) :] + entries[: r % len(entries)] for r in range(args.pairs)]


def read_results(directory: Path) -> list[RankResult]:
    """The rank results one row's ranks wrote into ``directory``."""
    return [RankResult(**json.loads(path.read_text())) for path in sorted(directory.glob("*-rank*.json"))]


def run_pairs(args: argparse.Namespace, load_before: float) -> None:
    """torch's Schedule1F1B and lightning-pipe under each of ``--schedules``, in an order that
    rotates every round, ``--pairs`` rounds: each round's ratio to torch, and the median per schedule.
    Each row runs in fresh processes; with ``--interleave`` each family's steps alternate with torch's
    in one pair of processes (`run_interleaved_rank`), and its ratio is to those torch steps."""
    ratios: dict[str, list[float]] = {schedule: [] for schedule in args.schedules}
    breakdowns: dict[str, list[dict]] = {schedule: [] for schedule in args.schedules}
    kinds: dict[str, list[dict]] = {schedule: [] for schedule in args.schedules}
    cpu: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as out:
        if args.interleave:
            print(f"running {args.pairs} rounds in one pair of processes, steps interleaved ...", flush=True)
            _, error = launch("interleaved", args, out)
            if error:
                raise SystemExit(f"the interleaved rounds failed: {error}")
        for round_, order in enumerate(round_orders(args)):
            throughput = {}
            for schedule in order:
                if args.interleave and schedule is None:
                    continue
                config = "torch-1f1b" if schedule is None else "lightning-pipe"
                directory = Path(out, f"{round_}-{schedule or 'torch'}")
                if not args.interleave:
                    directory.mkdir()
                    row_args = argparse.Namespace(**{**vars(args), "schedule": schedule})
                    _, error = launch(config, row_args, str(directory))
                    if error:
                        raise SystemExit(f"{CONFIGS[config]} {schedule or ''} failed: {error}")
                rows = [(schedule, directory)]
                if args.interleave:
                    rows.append((f"torch@{schedule}", Path(out, f"{round_}-torch-{schedule}")))
                for name, directory in rows:
                    results = read_results(directory)
                    step_seconds = [max(times) for times in zip(*(r.step_seconds for r in results))]
                    throughput[name] = results[0].tokens_per_step / statistics.median(step_seconds)
                    for r in results:
                        cpu.setdefault((name or "torch-1f1b", r.rank), []).append(statistics.median(r.cpu_seconds))
                        if name == schedule and r.rank == 0 and r.breakdown:
                            breakdowns[schedule].append(r.breakdown)
                            kinds[schedule].append(r.kind_compute)
            for schedule in args.schedules:
                reference = throughput[f"torch@{schedule}" if args.interleave else None]
                ratios[schedule].append(throughput[schedule] / reference)
            line = ", ".join(f"{name or 'torch-1f1b'} {value:,.0f}" for name, value in throughput.items())
            print(f"round {round_}: tokens/s {line}; ratios " + ", ".join(
                f"{s} {ratios[s][-1]:.3f}" for s in args.schedules), flush=True)
    how = "each family's steps alternated with torch's in one pair of processes" if args.interleave else (
        "each row in fresh processes")
    print(f"({how}; order rotated every round)")
    for schedule in args.schedules:
        print(f"median ratio lightning-pipe {schedule} / torch Schedule1F1B over {args.pairs} rotated rounds: "
              f"{statistics.median(ratios[schedule]):.3f}")
    print(f"(1-minute load before: {load_before:.2f})")
    print("\nCPU seconds per step (process time of all threads, median of the rounds' medians; it varies")
    print("less with other load than wall time, so it separates work done from time spent waiting):")
    for (name, rank), values in sorted(cpu.items()):
        print(f"  {name:16s} rank {rank}  {statistics.median(values) * 1e3:8.2f} ms")
    for schedule, found in breakdowns.items():
        if found:
            print(f"\nlightning-pipe {schedule}, rank 0, median seconds per step (of the rounds' medians):")
            for part in found[0]:
                print(f"  {part:16s} {statistics.median(b[part] for b in found) * 1e3:8.2f} ms")
    for schedule, found in kinds.items():
        if found:  # a split backward's I + W against a full backward's B
            parts = ", ".join(f"{k} {statistics.median(f.get(k, 0.0) for f in found) * 1e3:.1f}" for k in sorted(found[0]))
            print(f"lightning-pipe {schedule}, compute per action kind, both ranks, ms per step: {parts}")


if __name__ == "__main__":
    main()
