"""A user's script: ``trainer.fit`` then ``trainer.predict`` in the same processes (the popen launcher
re-runs this file for every rank), so a helix module cut and sharded by training predicts through
the pipeline. ``python -m tests.helpers.fit_then_predict OUT [pipe|one]`` saves rank 0's predictions
to ``OUT/predictions.pt`` and each rank's count of parameters it does not hold during prediction to ``OUT/held/rank<N>.txt``."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from examples.gpt.model import GPT
from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.training import SEED, token_batches


class LogitsGPT(GPT):
    """The example GPT whose predict step returns the logits ``[B, T, vocab]`` (exact comparison)."""

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch[:, :-1])


class CountNotHeld(L.Callback):
    """Each rank writes how many parameters it does not hold (meta) while predicting."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        not_held = sum(p.is_meta for p in pl_module.parameters())
        (self.out / "held").mkdir(exist_ok=True)
        (self.out / "held" / f"rank{trainer.global_rank}.txt").write_text(str(not_held))


def main(out: Path, mode: str) -> None:
    L.seed_everything(SEED, verbose=False)
    model = LogitsGPT(vocab_size=32, block_size=32, n_layer=4, n_head=2, n_embd=16, learning_rate=0.01).double()
    train, predict = token_batches(2, 4, [9, 6], seed=1), token_batches(2, 4, [7, 11], seed=2)
    pipelined = mode == "pipe"
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, schedule="helix") if pipelined else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=2 if pipelined else 1, strategy=strategy, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CountNotHeld(out)],
    )
    trainer.fit(model, DataLoader(train, batch_size=None))
    predictions = trainer.predict(model, DataLoader(predict, batch_size=None))
    if trainer.global_rank == 0:
        torch.save(predictions, out / "predictions.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
