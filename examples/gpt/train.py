"""Train a small GPT with pipeline parallelism on CPU, without changing the model.

`model.py` is a plain LightningModule and `data.py` yields whole batches whose sequence length
varies from batch to batch (long-tailed, 16..256 tokens by default). The only pipeline-specific
line is the Trainer's `strategy`.

Run from the repository root (2 CPU processes, well under a minute):

    python examples/gpt/train.py                                  # strategy="elastic_pipe", 2 stages
    python examples/gpt/train.py --schedule gpipe --microbatches 8
    python examples/gpt/train.py --strategy ddp                   # 2 data-parallel replicas
    python examples/gpt/train.py --strategy single                # one process, for comparison

Add `--fixed-len 128` for constant-length batches. Metrics go to `lightning_logs/gpt/` (CSV).
The same run from a LightningCLI config: `python -m lightning_pipe fit --config
examples/gpt/configs/cpu_2stage.yaml` (or `cpu_zbv.yaml` for the zero-bubble V schedule).
At the end, global rank 0 prints the training throughput (tokens/s over all ranks, the first
`--warmup-steps` batches excluded) and the final training loss.
"""

import argparse
import os
import sys
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

# Make `examples.gpt` importable when this file is run as a script.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from examples.gpt.data import TokenDataModule
from examples.gpt.model import GPT


class Throughput(L.Callback):
    """Counts the tokens and wall time of training batches, after `warmup_steps` batches.

    The time of a batch runs from `on_train_batch_start` to `on_train_batch_end` (forward,
    backward and optimizer step), so data loading and validation are left out. Every rank counts
    the batches it was given. At the end of training the token counts of all ranks are summed and
    divided by the number of ranks that see the same batches (the pipeline stages of one
    data-parallel replica), so `tokens_per_second` is the throughput of the whole job.
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.tokens = 0
        self.seconds = 0.0
        self.batch_start = 0.0
        self.tokens_per_second = float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup_steps:
            B, T_plus_1 = batch.size()
            self.tokens += B * (T_plus_1 - 1)
            self.seconds += time.perf_counter() - self.batch_start

    def on_train_end(self, trainer, pl_module) -> None:
        tokens = torch.tensor(float(self.tokens), dtype=torch.float64)
        seconds = torch.tensor(self.seconds, dtype=torch.float64)
        ranks_per_replica = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(tokens, op=dist.ReduceOp.SUM)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank
            replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"]
            ranks_per_replica = dist.get_world_size() // replicas
        self.tokens_per_second = tokens.item() / ranks_per_replica / seconds.item()


def make_strategy(args: argparse.Namespace):
    """Returns the Trainer's `(strategy, devices)` for the `--strategy` flag."""
    if args.strategy == "single":
        return "auto", 1
    if args.strategy == "ddp":
        return "ddp", args.devices
    import lightning_pipe  # registers "elastic_pipe"

    if args.schedule is None and args.microbatches is None:
        return "elastic_pipe", args.devices
    options = {"schedule": args.schedule, "num_microbatches": args.microbatches}
    options = {key: value for key, value in options.items() if value is not None}
    return lightning_pipe.ElasticPipelineStrategy(**options), args.devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["elastic_pipe", "ddp", "single"], default="elastic_pipe")
    parser.add_argument("--devices", type=int, default=2, help="processes (ignored by single)")
    parser.add_argument("--schedule", default=None, help='e.g. "1f1b", "gpipe" (elastic_pipe)')
    parser.add_argument("--microbatches", type=int, default=None, help="per step (elastic_pipe)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--fixed-len", type=int, default=None, help="constant batch length")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=3, help="left out of tokens/s")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--cosine", action="store_true", help="cosine learning-rate decay")
    parser.add_argument("--val-every", type=int, default=10, help="validate every N steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-dir", default="lightning_logs")
    args = parser.parse_args()

    L.seed_everything(args.seed, workers=True)
    model = GPT(
        vocab_size=256,
        block_size=max(args.max_len, args.fixed_len or 0),
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        learning_rate=args.lr,
        cosine_schedule=args.cosine,
    )
    data = TokenDataModule(
        num_batches=args.max_steps * args.devices,  # enough for every data-parallel replica
        batch_size=args.batch_size,
        min_len=args.min_len,
        max_len=args.max_len,
        fixed_len=args.fixed_len,
        vocab_size=256,
        seed=args.seed,
    )

    strategy, devices = make_strategy(args)
    throughput = Throughput(args.warmup_steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        logger=CSVLogger(args.log_dir, name="gpt"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        callbacks=[throughput],
    )
    trainer.fit(model, datamodule=data)

    if trainer.is_global_zero:
        print(f"strategy={args.strategy} world_size={trainer.world_size} steps={trainer.global_step}")
        print(f"throughput: {throughput.tokens_per_second:,.0f} tokens/s (after {args.warmup_steps} warmup steps)")
        metrics = trainer.callback_metrics
        print(f"final train_loss: {metrics['train_loss'].item():.4f}")
        if "val_loss" in metrics:  # validation runs every `--val-every` steps
            print(f"last val_loss: {metrics['val_loss'].item():.4f}")


if __name__ == "__main__":
    main()
