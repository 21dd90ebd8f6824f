"""Sequence-length traces drawn to match published distributions, deterministic by seed.

Two workloads, for simulated benchmarks of per-batch repartitioning:

- **FLANv2-like** (FlexPipe, ATC'25, Sec. 2.2: "when random sampling in FLANv2, 95% of iterations
  have a maximum sample length under 4k"; lengths differ by up to 60000 across iterations). Body: a
  log-normal (median ``median_length``) truncated below 4096; tail: with the per-sequence
  probability that makes ``P(batch max < 4096) = 0.95`` for the batch size, a log-uniform length in
  ``[4096, max_length]``. Batches hold ``batch_size`` sequences.
- **GitHub-like** (InfiniPipe, Sec. 2: "91.5% of the sequences have no more than 8K tokens, with only
  0.6% of the sequences whose lengths exceed 64K or more. However, these 0.6% sequences contribute to
  21.6% of the total tokens"). Three segments: a log-normal truncated to ``[16, 8192]`` (91.5%), a
  truncated power law on ``(8192, 65536)`` (7.9%) whose exponent is solved so the long segment's
  token share is 21.6% in expectation, and a log-uniform ``[65536, max_length]`` (0.6%). Batches are
  filled up to a token budget.

The published figures are matched in expectation; tests check them on large draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr, ndtri

from lightning_pipe.planning.cost_model import MicrobatchShape

FLAN_SHORT_LIMIT = 4096  # "maximum sample length under 4k"
FLAN_SHORT_BATCH_FRACTION = 0.95
GITHUB_SHORT_LIMIT = 8192  # "no more than 8K tokens"
GITHUB_LONG_LIMIT = 65536  # "64K or more"
GITHUB_SHORT_FRACTION = 0.915
GITHUB_LONG_FRACTION = 0.006
GITHUB_LONG_TOKEN_SHARE = 0.216


@dataclass(frozen=True)
class LengthTrace:
    """Batches of sequence lengths (tokens), in training order.

    Attributes:
        name: which distribution (``"flan"``, ``"github"``).
        seed: the seed it was drawn with.
        batches: one tuple of sequence lengths per batch.
    """

    name: str
    seed: int
    batches: tuple[tuple[int, ...], ...]

    @property
    def num_batches(self) -> int:
        """Number of batches."""
        return len(self.batches)

    @property
    def tokens(self) -> int:
        """Total tokens over all batches."""
        return sum(sum(batch) for batch in self.batches)

    def lengths(self) -> np.ndarray:
        """All sequence lengths, batch after batch."""
        return np.array([length for batch in self.batches for length in batch], dtype=np.int64)


def _truncated_lognormal(
    rng: np.random.Generator, size: int, median: float, sigma: float, low: float, high: float
) -> np.ndarray:
    mu = math.log(median)
    lower, upper = ndtr((math.log(low) - mu) / sigma), ndtr((math.log(high) - mu) / sigma)
    return np.exp(mu + sigma * ndtri(rng.uniform(lower, upper, size)))


def _truncated_lognormal_mean(median: float, sigma: float, low: float, high: float) -> float:
    mu = math.log(median)
    a, b = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * (ndtr(b - sigma) - ndtr(a - sigma)) / (ndtr(b) - ndtr(a))


def _log_uniform(rng: np.random.Generator, size: int, low: float, high: float) -> np.ndarray:
    return np.exp(rng.uniform(math.log(low), math.log(high), size))


def _power_law_mean(alpha: float, low: float, high: float) -> float:
    """Mean of the density proportional to ``x ** -(alpha + 1)`` on ``[low, high]``."""
    if abs(alpha - 1.0) < 1e-9:
        return (math.log(high) - math.log(low)) / (1 / low - 1 / high)
    ratio = alpha / (alpha - 1.0)
    return ratio * (low ** (1 - alpha) - high ** (1 - alpha)) / (low**-alpha - high**-alpha)


def _power_law(rng: np.random.Generator, size: int, alpha: float, low: float, high: float) -> np.ndarray:
    u = rng.uniform(0.0, 1.0, size)
    return (low**-alpha - u * (low**-alpha - high**-alpha)) ** (-1.0 / alpha)


def _solve_alpha(target_mean: float, low: float, high: float) -> float:
    lo, hi = 1e-3, 50.0  # the mean decreases as alpha grows
    if not _power_law_mean(hi, low, high) <= target_mean <= _power_law_mean(lo, low, high):
        raise ValueError(
            f"No power law on [{low}, {high}] has mean {target_mean:.0f}; change `max_length` or `median_length`."
        )
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if abs(mid - 1.0) < 1e-6:
            mid += 2e-6
        if _power_law_mean(mid, low, high) > target_mean:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def sample_flan_lengths(
    num_sequences: int,
    rng: np.random.Generator,
    *,
    batch_size: int = 32,
    max_length: int = 65536,
    median_length: float = 300.0,
    sigma: float = 1.1,
) -> np.ndarray:
    """FLANv2-like sequence lengths (see the module docstring); ``batch_size`` sets the tail weight."""
    if batch_size < 1 or max_length <= FLAN_SHORT_LIMIT:
        raise ValueError(
            f"`batch_size` must be >= 1 and `max_length` > {FLAN_SHORT_LIMIT}, got {batch_size} and {max_length}."
        )
    tail_probability = 1.0 - FLAN_SHORT_BATCH_FRACTION ** (1.0 / batch_size)
    short = np.floor(_truncated_lognormal(rng, num_sequences, median_length, sigma, 8.0, FLAN_SHORT_LIMIT))
    long = np.floor(_log_uniform(rng, num_sequences, FLAN_SHORT_LIMIT, max_length + 1))
    lengths = np.where(rng.uniform(size=num_sequences) < tail_probability, long, short)
    return np.clip(lengths, 1, max_length).astype(np.int64)


def sample_github_lengths(
    num_sequences: int,
    rng: np.random.Generator,
    *,
    max_length: int = 131072,
    median_length: float = 700.0,
    sigma: float = 1.3,
) -> np.ndarray:
    """GitHub-like sequence lengths (see the module docstring)."""
    if max_length <= GITHUB_LONG_LIMIT:
        raise ValueError(f"`max_length` must be > {GITHUB_LONG_LIMIT}, got {max_length}.")
    short_mean = _truncated_lognormal_mean(median_length, sigma, 16.0, GITHUB_SHORT_LIMIT + 1)
    long_mean = (max_length - GITHUB_LONG_LIMIT) / (math.log(max_length) - math.log(GITHUB_LONG_LIMIT))
    middle_fraction = 1.0 - GITHUB_SHORT_FRACTION - GITHUB_LONG_FRACTION
    other_tokens = GITHUB_LONG_FRACTION * long_mean * (1 - GITHUB_LONG_TOKEN_SHARE) / GITHUB_LONG_TOKEN_SHARE
    alpha = _solve_alpha(
        (other_tokens - GITHUB_SHORT_FRACTION * short_mean) / middle_fraction, GITHUB_SHORT_LIMIT, GITHUB_LONG_LIMIT
    )
    short = np.floor(_truncated_lognormal(rng, num_sequences, median_length, sigma, 16.0, GITHUB_SHORT_LIMIT + 1))
    middle = np.floor(_power_law(rng, num_sequences, alpha, GITHUB_SHORT_LIMIT, GITHUB_LONG_LIMIT))
    long = np.floor(_log_uniform(rng, num_sequences, GITHUB_LONG_LIMIT, max_length + 1))
    segment = rng.uniform(size=num_sequences)
    lengths = np.where(
        segment < GITHUB_SHORT_FRACTION,
        np.clip(short, 16, GITHUB_SHORT_LIMIT),
        np.where(
            segment < GITHUB_SHORT_FRACTION + middle_fraction,
            np.clip(middle, GITHUB_SHORT_LIMIT + 1, GITHUB_LONG_LIMIT - 1),
            np.clip(long, GITHUB_LONG_LIMIT, max_length),
        ),
    )
    return lengths.astype(np.int64)


def flan_like_trace(num_batches: int, batch_size: int = 32, seed: int = 0, max_length: int = 65536) -> LengthTrace:
    """``num_batches`` batches of ``batch_size`` FLANv2-like sequences.

    Raises:
        ValueError: if ``num_batches < 1`` or the sizes are invalid.
    """
    if num_batches < 1:
        raise ValueError(f"`num_batches` must be >= 1, got {num_batches}.")
    rng = np.random.default_rng(seed)
    lengths = sample_flan_lengths(num_batches * batch_size, rng, batch_size=batch_size, max_length=max_length)
    batches = tuple(tuple(int(v) for v in lengths[i * batch_size : (i + 1) * batch_size]) for i in range(num_batches))
    return LengthTrace("flan", seed, batches)


def github_like_trace(
    num_batches: int, tokens_per_batch: int = 262144, seed: int = 0, max_length: int = 131072
) -> LengthTrace:
    """``num_batches`` batches of GitHub-like sequences, each filled up to ``tokens_per_batch`` tokens.

    A batch takes sequences in drawn order while they fit the budget; the first that does not starts
    the next batch (a batch always holds at least one sequence).

    Raises:
        ValueError: if ``num_batches < 1`` or ``tokens_per_batch < max_length``.
    """
    if num_batches < 1:
        raise ValueError(f"`num_batches` must be >= 1, got {num_batches}.")
    if tokens_per_batch < max_length:
        raise ValueError(f"`tokens_per_batch` ({tokens_per_batch}) must be >= `max_length` ({max_length}).")
    rng = np.random.default_rng(seed)
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    used = 0
    while len(batches) < num_batches:
        for length in sample_github_lengths(4096, rng, max_length=max_length).tolist():
            if current and used + length > tokens_per_batch:
                batches.append(tuple(current))
                current, used = [], 0
                if len(batches) == num_batches:
                    break
            current.append(length)
            used += length
    return LengthTrace("github", seed, tuple(batches))


def split_microbatches(lengths: Sequence[int], num_microbatches: int) -> list[MicrobatchShape]:
    """Split a batch's sequences into at most ``num_microbatches`` microbatches of similar token counts.

    Longest sequence first, each to the microbatch with the fewest tokens so far (sequences are never
    cut; a batch with fewer sequences gets fewer microbatches). Microbatch 0 holds the longest.

    Raises:
        ValueError: if ``lengths`` is empty or ``num_microbatches < 1``.
    """
    if num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be >= 1, got {num_microbatches}.")
    if len(lengths) == 0:
        raise ValueError("`lengths` is empty: a batch needs at least one sequence.")
    count = min(num_microbatches, len(lengths))
    groups: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for length in sorted((int(v) for v in lengths), reverse=True):
        index = totals.index(min(totals))
        groups[index].append(length)
        totals[index] += length
    return [MicrobatchShape.from_lengths(group) for group in groups]
