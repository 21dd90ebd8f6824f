"""The unchanged GPT example under `strategy=ElasticPipelineStrategy`, against one process.

Two processes on CPU (gloo), spawned from the test. Skipped while `lightning_pipe` does not
export the strategy.
"""

import lightning as L
import pytest
import torch

from examples.gpt.data import TokenDataModule
from examples.gpt.model import GPT

lightning_pipe = pytest.importorskip("lightning_pipe")
if not hasattr(lightning_pipe, "ElasticPipelineStrategy"):
    pytest.skip("lightning_pipe does not export ElasticPipelineStrategy yet", allow_module_level=True)


def train(strategy, devices: int, schedule_steps: int = 4) -> tuple[GPT, dict]:
    L.seed_everything(0, verbose=False)
    model = GPT(vocab_size=64, block_size=64, n_layer=4, n_head=2, n_embd=32)
    data = TokenDataModule(num_batches=schedule_steps, batch_size=4, min_len=8, max_len=48, vocab_size=64)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=schedule_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # One replica reads every batch; keep the one-process order so steps compare one to one.
        use_distributed_sampler=False,
    )
    trainer.fit(model, data.train_dataloader())
    return model, dict(trainer.callback_metrics)


@pytest.mark.timeout(300)
def test_example_trains_like_one_process():
    reference, reference_metrics = train("auto", devices=1)
    strategy = lightning_pipe.ElasticPipelineStrategy(schedule="1f1b", num_microbatches=2, start_method="spawn")
    pipelined, metrics = train(strategy, devices=2)
    # The last step's loss is float64 in both runs: equal to 1e-10.
    torch.testing.assert_close(metrics["train_loss"], reference_metrics["train_loss"], rtol=0, atol=1e-10)
    # As with Lightning's own spawn launcher, the module in this process keeps its float32
    # parameters and receives the trained float64 values rounded to float32.
    expected = reference.state_dict()
    for name, value in pipelined.state_dict().items():
        torch.testing.assert_close(value, expected[name].to(value.dtype), msg=lambda m, name=name: f"{name}: {m}")
