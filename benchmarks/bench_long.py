"""Real CPU throughput on skewed sequence lengths: padding vs packing vs packing with slicing.

The GPT of ``examples/gpt/model.py`` (4 layers, width 128, 4 heads) trained on batches of 16
sequences whose lengths follow a log-normal law (median 48 tokens) with one sequence of 768 tokens
in every batch (16x the median), as transformers-style dicts (``input_ids``, ``attention_mask``,
``labels``). Two processes (one pipeline of 2 stages), gloo, one thread each, 1F1B, 4 microbatches:

- ``torch 1f1b, padded``: ``torch.distributed.pipelining.Schedule1F1B`` with static shapes: every
  batch padded to the context length (768), as its stages require;
- ``lightning-pipe, padded``: ``ElasticPipelineStrategy(trim_padding=False)`` on the batch padded to
  its longest;
- ``lightning-pipe, cut``: the default ``trim_padding=True``: each microbatch of whole samples cut
  to its own longest sequence, samples grouped by length (no packing);
- ``lightning-pipe, packing``: ``packing=True`` (4 microbatches of near-equal tokens, no padding);
- ``lightning-pipe, packing + slicing``: ``Packer(max_tokens=256, slicing=True)`` (the long
  sequence in 3 slices under sliced 1F1B, the others packed in rows of at most 256 tokens).

tokens/s counts real tokens (padding excluded) over the median step: each configuration runs once per
round (in fresh processes, the order rotated from round to round so that no configuration always
runs first or last), each run's median timed step is taken, and the table gives the median over the
rounds with their range. The load average of the machine is printed: on a shared machine the
spread says how far to trust a row.

    python benchmarks/bench_long.py                       # 3 rounds, about 8 minutes on 2 cores
    python benchmarks/bench_long.py --rounds 5 --steps 8  # tighter
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt.model import GPT  # noqa: E402

BATCH, LONGEST, MEDIAN, VOCAB = 16, 768, 48, 256


def make_batches(num: int, seed: int = 0) -> list[dict]:
    """Right-padded dict batches: log-normal lengths (median 48), one sequence of 768 per batch."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        lengths = torch.exp(torch.randn(BATCH, generator=generator) * 0.8 + torch.log(torch.tensor(float(MEDIAN))))
        lengths = lengths.round().clamp(8, LONGEST // 2).long()
        lengths[0] = LONGEST
        T = int(lengths.max())
        ids = torch.randint(1, VOCAB, (BATCH, T), generator=generator)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=1024, n_layer=4, n_head=4, n_embd=128)


def run_lightning(name: str, packing, args: argparse.Namespace, out: Path) -> None:
    import lightning as L

    from benchmarks.harness import StepTimer
    from lightning_pipe import ElasticPipelineStrategy
    from tests.helpers.training import BatchDataset

    def save(trainer, seconds: list[float]) -> None:
        if trainer.global_rank == 0:
            out.write_text(json.dumps(seconds))

    torch.set_num_threads(1)
    trim = packing == "trim"
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule="1f1b", start_method="fork",
        packing=False if packing in ("trim", "padded") else packing, trim_padding=trim,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.warmup + args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[StepTimer(args.warmup, save)],
    )
    batches = make_batches(args.warmup + args.steps)
    trainer.fit(build(), torch.utils.data.DataLoader(BatchDataset(batches), batch_size=None))


class FirstHalf(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.blocks = gpt.wte, gpt.wpe, nn.ModuleList(gpt.blocks[:2])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        return x


class SecondHalf(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = nn.ModuleList(gpt.blocks[2:]), gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def run_torch_rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    gpt = build()
    module = FirstHalf(gpt) if rank == 0 else SecondHalf(gpt)
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=_loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    seconds = []
    for i, batch in enumerate(make_batches(args.warmup + args.steps)):
        pad = LONGEST - batch["input_ids"].shape[1]  # static shapes: the context length every time
        ids = F.pad(batch["input_ids"], (0, pad))
        labels = F.pad(batch["labels"], (0, pad), value=-100)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=labels)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def run_config(name: str, packing, args: argparse.Namespace, folder: str, index: int) -> list[float]:
    """Timed step seconds of one configuration (``packing`` None: torch's padded 1F1B), in fresh processes."""
    out = Path(folder) / f"{index}.json"
    if packing is None:
        mp.spawn(run_torch_rank, args=(args, f"file://{folder}/store{index}", str(out)), nprocs=2, join=True)
    else:
        run_lightning(name, packing, args, out)
    seconds = json.loads(out.read_text())
    out.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all configurations, order rotated each round")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rich.console import Console
    from rich.table import Table

    from lightning_pipe import Packer

    configs = [
        ("torch 1f1b, padded to 768", None),
        ("lightning-pipe, padded to the longest", "padded"),
        ("lightning-pipe, microbatches cut to their longest", "trim"),
        ("lightning-pipe, packing", True),
        ("lightning-pipe, packing + slicing (256)", Packer(max_tokens=256, slicing=True)),
    ]
    tokens = statistics.mean(int(b["attention_mask"].sum()) for b in make_batches(args.warmup + args.steps)[args.warmup :])
    medians: dict[str, list[float]] = {name: [] for name, _ in configs}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as folder:
        index = 0
        for round_ in range(args.rounds):
            for name, packing in configs[round_ % len(configs) :] + configs[: round_ % len(configs)]:
                medians[name].append(statistics.median(run_config(name, packing, args, folder, index)))
                index += 1
            loads.append(os.getloadavg()[0])
    table = Table(
        title=f"GPT (4 layers, width 128) on batches of {BATCH} sequences, median {MEDIAN}, longest {LONGEST} tokens; "
        f"2 processes; median over {args.rounds} rounds of each round's median step"
    )
    for column in ("configuration", "median step (s)", "range over rounds (s)", "tokens/s", "vs torch padded"):
        table.add_column(column, justify="right")
    base = statistics.median(medians[configs[0][0]])
    for name, _ in configs:
        median = statistics.median(medians[name])
        spread = f"{min(medians[name]):.3f} - {max(medians[name]):.3f}"
        table.add_row(name, f"{median:.3f}", spread, f"{tokens / median:,.0f}", f"{base / median:.2f}x")
    Console().print(table)
    print(
        f"{tokens:.0f} real tokens per batch, {args.steps} timed steps after {args.warmup} warm-up per run, "
        f"{args.rounds} rounds (configurations alternate, order rotated per round); 1-minute load average "
        f"{min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores; torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
