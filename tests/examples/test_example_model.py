"""Fast, single-process tests of the GPT example's model and data (no pipeline involved)."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from examples.gpt.data import TokenBatches, TokenDataModule, sample_lengths
from examples.gpt.model import GPT


def tiny_gpt(**overrides) -> GPT:
    options = {"vocab_size": 32, "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 16}
    options.update(overrides)
    return GPT(**options)


class RecordLoss(L.Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def fit(model: GPT, data: TokenDataModule, max_steps: int, callbacks=()) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    trainer.fit(model, datamodule=data)
    return trainer


# ----------------------------------------------------------------------------- model


def test_forward_shape_and_blocks():
    model = tiny_gpt()
    idx = torch.randint(32, (3, 10))
    assert model(idx).shape == (3, 10, 32)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert model.blocks[0](torch.randn(3, 10, 16)).shape == (3, 10, 16)


def test_forward_rejects_too_long_sequences():
    with pytest.raises(ValueError, match="block_size"):
        tiny_gpt(block_size=8)(torch.zeros(1, 9, dtype=torch.long))


def test_init_is_deterministic_given_seed():
    torch.manual_seed(0)
    first = tiny_gpt().state_dict()
    torch.manual_seed(0)
    second = tiny_gpt().state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_tie_weights_shares_the_embedding():
    model = tiny_gpt(tie_weights=True)
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # deduplicated
    assert tiny_gpt().lm_head.weight is not tiny_gpt().wte.weight


def test_weight_decay_only_on_matrices():
    optimizer = tiny_gpt(tie_weights=True).configure_optimizers()
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])


def test_loss_decreases_in_a_few_steps():
    torch.manual_seed(0)
    model = tiny_gpt(learning_rate=1e-2)
    data = TokenDataModule(num_batches=20, batch_size=8, min_len=8, max_len=48, vocab_size=32)
    record = RecordLoss()
    fit(model, data, max_steps=20, callbacks=[record])
    assert len(record.losses) == 20
    assert record.losses[0] == pytest.approx(torch.log(torch.tensor(32.0)).item(), abs=0.2)
    assert sum(record.losses[-5:]) / 5 < record.losses[0] - 0.5


def test_training_is_deterministic_given_seed():
    def run() -> dict:
        L.seed_everything(7)
        model = tiny_gpt()
        fit(model, TokenDataModule(num_batches=4, batch_size=4, min_len=8, max_len=32, vocab_size=32), 4)
        return model.state_dict()

    first, second = run(), run()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_cosine_schedule_decays_the_learning_rate():
    model = tiny_gpt(cosine_schedule=True)
    data = TokenDataModule(num_batches=6, batch_size=2, min_len=8, max_len=16, vocab_size=32)
    trainer = fit(model, data, max_steps=6)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(0.1 * model.hparams.learning_rate)


def test_predict_step_returns_token_ids():
    batch = torch.randint(32, (2, 11))
    prediction = tiny_gpt().predict_step(batch, 0)
    assert prediction.shape == (2, 10) and prediction.dtype == torch.long


# ----------------------------------------------------------------------------- data


def test_items_are_whole_batches_with_their_own_length():
    data = TokenBatches(num_batches=50, batch_size=4, min_len=8, max_len=64, vocab_size=32)
    for index in range(len(data)):
        assert data[index].shape == (4, int(data.lengths[index]) + 1)
        assert data[index].dtype == torch.long
    assert len(set(data.lengths.tolist())) > 10


def test_data_is_deterministic_by_seed():
    first = TokenBatches(num_batches=5, batch_size=3, seed=1)
    second = TokenBatches(num_batches=5, batch_size=3, seed=1)
    other = TokenBatches(num_batches=5, batch_size=3, seed=2)
    assert torch.equal(first.lengths, second.lengths)
    assert all(torch.equal(first[i], second[i]) for i in range(5))
    assert not torch.equal(first.rule, other.rule)
    # Reading out of order gives the same items: each item depends only on (seed, index).
    assert torch.equal(TokenBatches(num_batches=5, batch_size=3, seed=1)[4], first[4])


def test_tokens_follow_the_rule_up_to_the_noise():
    data = TokenBatches(num_batches=20, batch_size=8, vocab_size=64, noise=0.1)
    batch = torch.cat([data[i][:, :17] for i in range(20)])
    follows = (batch[:, 1:] == data.rule[batch[:, :-1]]).float().mean().item()
    assert follows == pytest.approx(0.9 + 0.1 / 64, abs=0.02)


def test_lengths_are_long_tailed_and_clipped():
    lengths = sample_lengths(20_000, min_len=16, max_len=256, seed=0).double()
    assert lengths.min() == 16 and lengths.max() == 256
    median = lengths.median()
    assert lengths.mean() > 1.3 * median  # skewed to the right
    assert torch.quantile(lengths, 0.99) > 5 * median  # a long tail
    assert (lengths <= 2 * median).double().mean() > 0.6  # most batches are short


def test_fixed_length_mode():
    data = TokenBatches(num_batches=6, batch_size=2, fixed_len=20)
    assert all(data[i].shape == (2, 21) for i in range(6))


def test_splits_share_the_rule_but_not_the_samples():
    module = TokenDataModule(num_batches=3, batch_size=2, seed=5, val_batches=3)
    train = module.train_dataloader().dataset
    val = module.val_dataloader().dataset
    assert torch.equal(train.rule, val.rule)
    assert not torch.equal(train[0][:, :8], val[0][:, :8])
    assert len(module.test_dataloader().dataset) == len(module.predict_dataloader().dataset) == 3


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="split"):
        TokenBatches(num_batches=1, batch_size=1, split="dev")
    with pytest.raises(ValueError, match="min_len"):
        TokenBatches(num_batches=1, batch_size=1, min_len=32, max_len=16)


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_distributed_sampler_shards_whole_batches(num_replicas):
    module = TokenDataModule(num_batches=12, batch_size=4, min_len=8, max_len=64, seed=3)
    loader = module.train_dataloader()
    dataset = loader.dataset
    seen = []
    for rank in range(num_replicas):
        sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        indices = list(sampler)
        assert indices == list(range(rank, len(dataset), num_replicas))
        sharded = DataLoader(dataset, batch_size=None, sampler=sampler)
        for index, batch in zip(indices, sharded):
            assert torch.equal(batch, dataset[index])  # a whole batch, not one row of it
        seen.extend(indices)
    assert sorted(seen) == list(range(12))


def test_lightning_keeps_whole_batches_when_it_injects_its_sampler():
    # What Lightning does to a train dataloader under a distributed strategy (private API:
    # pinned here because the example relies on `batch_size=None` surviving it).
    from lightning.fabric.utilities.data import _update_dataloader

    loader = TokenDataModule(num_batches=8, batch_size=4, min_len=8, max_len=64).train_dataloader()
    sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    updated = _update_dataloader(loader, sampler)
    assert updated.batch_size is None
    batches = list(updated)
    assert len(batches) == 4
    assert all(torch.equal(b, loader.dataset[i]) for b, i in zip(batches, [1, 3, 5, 7]))
