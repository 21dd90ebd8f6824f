"""Train a tiny transformers Llama with pipeline parallelism on CPU, without changing it.

The LightningModule below is what a user writes for any Hugging Face causal LM: build the model
from a config (no download), return ``self.model(input_ids=..., attention_mask=..., labels=...).loss``.
Llama's decoder layers (``model.model.layers``) are found as the block stack; the second stage
builds its causal masks and rotary tables for real while the embedding lives on the first stage.
The data is `examples/gpt/data.py`'s synthetic language: whole batches whose length varies from
batch to batch (long-tailed), each sample a full row (so every microbatch counts the same tokens).

Run from the repository root (2 CPU processes, well under a minute; needs `pip install transformers`):

    python examples/hf_llama/train.py                             # strategy="elastic_pipe", 2 stages
    python examples/hf_llama/train.py --schedule zbv
    python examples/hf_llama/train.py --strategy single           # one process, for comparison

At the end, global rank 0 prints the training throughput (tokens/s over all ranks, the first
`--warmup-steps` batches excluded) and the final training loss.
"""

import argparse
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

# Make `examples.*` importable when this file is run as a script.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from examples.gpt.data import TokenBatches
from examples.gpt.train import Throughput


class LlamaModule(L.LightningModule):
    """A config-built ``LlamaForCausalLM`` trained on its own loss, as in any transformers tutorial."""

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, layers: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=4 * hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        self.log("train_loss", out.loss, prog_bar=True)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class LanguageModelBatches(TokenBatches):
    """The synthetic token batches as transformers inputs: ids, a full attention mask, labels."""

    def __getitem__(self, index: int) -> dict:
        ids = super().__getitem__(index)  # [B, T + 1]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class _Throughput(Throughput):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch["input_ids"], batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["elastic_pipe", "single"], default="elastic_pipe")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    L.seed_everything(args.seed, workers=True)
    model = LlamaModule(layers=args.layers)
    data = LanguageModelBatches(
        args.max_steps, args.batch_size, min_len=args.min_len, max_len=args.max_len, vocab_size=256, seed=args.seed
    )
    if args.strategy == "single":
        strategy, devices = "auto", 1
    else:
        import lightning_pipe

        strategy = lightning_pipe.ElasticPipelineStrategy(schedule=args.schedule, num_microbatches=args.microbatches)
        devices = args.devices
    throughput = _Throughput(args.warmup_steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[throughput],
    )
    trainer.fit(model, DataLoader(data, batch_size=None))
    if trainer.is_global_zero:
        print(f"strategy={args.strategy} world_size={trainer.world_size} steps={trainer.global_step}")
        print(f"throughput: {throughput.tokens_per_second:,.0f} tokens/s (after {args.warmup_steps} warmup steps)")
        print(f"final train_loss: {trainer.callback_metrics['train_loss'].item():.4f}")


if __name__ == "__main__":
    main()
