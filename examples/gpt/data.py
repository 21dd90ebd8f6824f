"""Synthetic token data with learnable structure and long-tailed sequence lengths.

Every item of `TokenBatches` is a WHOLE batch, a `LongTensor[batch_size, T_k + 1]`, so it is used
with `DataLoader(batch_size=None)`. Lightning's distributed sampler then hands whole batches to
data-parallel ranks, and each batch keeps its own length `T_k` (no padding). The lengths are drawn
from a lognormal distribution clipped to `[min_len, max_len]`: most batches are short, a few are
long, which is what makes per-batch pipeline planning worthwhile.

Tokens follow a fixed random permutation ("after token a comes token rule[a]") with probability
`1 - noise`, and are uniform otherwise. A model can learn the rule in a few dozen steps; the best
achievable loss is about the entropy of the noise (~0.88 nats for `noise=0.1`, `vocab_size=256`).

Everything is a pure function of `seed` and the item index, so two processes (or two runs) see
identical data without sharing state.
"""

import math

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

# Salts that keep the splits' random streams apart while sharing one token rule.
_SPLIT_SALT = {"train": 0, "val": 1, "test": 2, "predict": 3}


def make_rule(vocab_size: int, seed: int) -> torch.Tensor:
    """Returns the fixed successor table `[vocab_size]` of the synthetic language."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=generator)


def sample_lengths(num_batches: int, min_len: int, max_len: int, seed: int, sigma: float = 0.9) -> torch.Tensor:
    """Draws one sequence length per batch from a clipped lognormal distribution.

    The median is `2 * min_len`; with `sigma=0.9` about 1% of the batches exceed `16 * min_len`.

    Args:
        num_batches: Number of lengths to draw.
        min_len: Shortest length (inclusive).
        max_len: Longest length (inclusive).
        seed: Seed of the draw.
        sigma: Standard deviation of the underlying normal; larger means a longer tail.

    Returns:
        A `LongTensor[num_batches]` of lengths in `[min_len, max_len]`.
    """
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(num_batches, generator=generator, dtype=torch.float64)
    lengths = torch.exp(math.log(2 * min_len) + sigma * normal)
    return lengths.round().clamp(min_len, max_len).long()


class TokenBatches(Dataset):
    """A map-style dataset whose items are whole batches of token sequences.

    Args:
        num_batches: Number of items (batches).
        batch_size: Sequences per batch.
        min_len: Shortest sequence length `T` (tokens the model reads; items carry `T + 1`).
        max_len: Longest sequence length `T`.
        fixed_len: If given, every batch has this length and `min_len`/`max_len` are ignored.
        vocab_size: Number of distinct tokens.
        seed: Seed of the token rule and of all sampling.
        split: One of `"train"`, `"val"`, `"test"`, `"predict"`; splits share the rule but not
            the samples.
        noise: Probability that a token ignores the rule and is drawn uniformly.
    """

    def __init__(
        self,
        num_batches: int,
        batch_size: int,
        min_len: int = 16,
        max_len: int = 256,
        fixed_len: int | None = None,
        vocab_size: int = 256,
        seed: int = 0,
        split: str = "train",
        noise: float = 0.1,
    ) -> None:
        if split not in _SPLIT_SALT:
            raise ValueError(f"`split` must be one of {sorted(_SPLIT_SALT)}, got {split!r}.")
        if fixed_len is None and not 1 <= min_len <= max_len:
            raise ValueError(f"Need 1 <= `min_len` <= `max_len`, got {min_len} and {max_len}.")
        self.num_batches = num_batches
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.noise = noise
        self.seed = 1_000_003 * seed + 7919 * _SPLIT_SALT[split]
        self.rule = make_rule(vocab_size, seed)
        if fixed_len is not None:
            self.lengths = torch.full((num_batches,), fixed_len, dtype=torch.long)
        else:
            self.lengths = sample_lengths(num_batches, min_len, max_len, self.seed)

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> torch.Tensor:
        """Returns batch `index` as a `LongTensor[batch_size, T_index + 1]`."""
        generator = torch.Generator().manual_seed(self.seed + 104_729 * (index + 1))
        B, T = self.batch_size, int(self.lengths[index]) + 1
        random_tokens = torch.randint(self.vocab_size, (B, T), generator=generator)
        follow_rule = torch.rand(B, T, generator=generator) >= self.noise
        tokens = random_tokens.clone()
        for t in range(1, T):
            tokens[:, t] = torch.where(follow_rule[:, t], self.rule[tokens[:, t - 1]], random_tokens[:, t])
        return tokens


class TokenDataModule(L.LightningDataModule):
    """Train, validation, test and predict splits of `TokenBatches`.

    Args:
        num_batches: Training batches per epoch.
        batch_size: Sequences per batch (the global batch of one data-parallel replica).
        min_len: Shortest sequence length.
        max_len: Longest sequence length.
        fixed_len: If given, every batch has this length.
        vocab_size: Number of distinct tokens; must match the model's.
        seed: Seed of all data.
        val_batches: Batches in each of the validation, test and predict splits.
        noise: Probability that a token ignores the rule.
    """

    def __init__(
        self,
        num_batches: int = 64,
        batch_size: int = 8,
        min_len: int = 16,
        max_len: int = 256,
        fixed_len: int | None = None,
        vocab_size: int = 256,
        seed: int = 0,
        val_batches: int = 4,
        noise: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _dataset(self, split: str, num_batches: int) -> TokenBatches:
        hp = self.hparams
        return TokenBatches(
            num_batches,
            hp.batch_size,
            min_len=hp.min_len,
            max_len=hp.max_len,
            fixed_len=hp.fixed_len,
            vocab_size=hp.vocab_size,
            seed=hp.seed,
            split=split,
            noise=hp.noise,
        )

    # Items are already batches: `batch_size=None` turns off automatic batching. Under any
    # distributed strategy Lightning replaces the sampler of the TRAINING loader with
    # `DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)` (whatever `shuffle` says here), so a
    # one-device run and a multi-process run see the batches in different orders.
    def train_dataloader(self) -> DataLoader:
        """Returns whole training batches, one per item, in a seeded random order."""
        dataset = self._dataset("train", self.hparams.num_batches)
        return DataLoader(dataset, batch_size=None, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Returns whole validation batches, one per item."""
        return DataLoader(self._dataset("val", self.hparams.val_batches), batch_size=None)

    def test_dataloader(self) -> DataLoader:
        """Returns whole test batches, one per item."""
        return DataLoader(self._dataset("test", self.hparams.val_batches), batch_size=None)

    def predict_dataloader(self) -> DataLoader:
        """Returns whole predict batches, one per item."""
        return DataLoader(self._dataset("predict", self.hparams.val_batches), batch_size=None)
