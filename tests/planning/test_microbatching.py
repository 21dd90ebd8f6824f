"""Microbatches sized by work: the balanced split is the exact min-max contiguous split; the padded
split of length-ordered samples is the best contiguous one for the pipeline's step estimate."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from lightning_pipe.planning import gpt_1_3b, microbatching
from lightning_pipe.planning.microbatching import (
    balance_microbatch_sizes,
    even_microbatch_sizes,
    microbatch_shapes,
    padded_microbatch_sizes,
    sample_costs,
)


def _brute_force(costs, count):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), count - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_is_optimal(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    count = int(rng.integers(1, 6))
    costs = [float(v) for v in rng.integers(1, 50, n)]
    sizes = balance_microbatch_sizes(costs, count)
    assert len(sizes) == min(n, count) and sum(sizes) == n and min(sizes) >= 1
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(_brute_force(costs, min(n, count)))


def test_balanced_beats_even_on_a_long_tail():
    lengths = [4000, 100, 120, 90, 3000, 80, 60, 50]
    costs = sample_costs(lengths, gpt_1_3b())
    even = even_microbatch_sizes(len(lengths), 4)
    balanced = balance_microbatch_sizes(costs, 4)
    heaviest = lambda sizes: max(s.tokens for s in microbatch_shapes(lengths, sizes))  # noqa: E731
    assert even == (2, 2, 2, 2) and balanced != even
    assert heaviest(balanced) < heaviest(even)


def test_checks():
    with pytest.raises(ValueError, match="at least one sample"):
        balance_microbatch_sizes([], 2)
    with pytest.raises(ValueError, match="finite and >= 0"):
        balance_microbatch_sizes([1.0, -1.0], 2)
    with pytest.raises(ValueError, match="sum to 3"):
        microbatch_shapes([1, 2], [1, 2])


def _padded_objective(lengths, sizes, stages):
    costs, start = [], 0
    for n in sizes:
        costs.append(n * lengths[start])
        start += n
    return sum(costs) + (stages - 1) * max(costs)


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("method", ["enumerated", "dynamic program"])
@pytest.mark.parametrize("seed", range(6))
def test_padded_sizes_are_the_best_contiguous_split(seed, method, monkeypatch):
    if method == "dynamic program":  # what batches with too many splits to try each use
        monkeypatch.setattr(microbatching, "_splits_of", lambda places, count: None)
    rng = random.Random(seed)
    size, count, stages = rng.randint(2, 10), rng.randint(1, 4), rng.randint(1, 4)
    lengths = sorted((rng.choice([2, 3, 5, 8, 13, 40, 200]) for _ in range(size)), reverse=True)
    sizes = padded_microbatch_sizes(lengths, count, stages)
    best = min(_padded_objective(lengths, c, stages) for c in _compositions(size, min(count, size)))
    assert sum(sizes) == size and len(sizes) == min(count, size)
    assert _padded_objective(lengths, sizes, stages) == best


def test_padded_sizes_keep_even_counts_for_equal_lengths_and_isolate_a_long_tail():
    assert padded_microbatch_sizes([64] * 16, 4, 2) == (4, 4, 4, 4)
    assert padded_microbatch_sizes([512] + [16] * 15, 4, 2)[0] == 1  # the long sequence runs alone


def test_padded_sizes_of_a_large_batch_beat_even_counts():
    rng = random.Random(0)
    lengths = sorted((int(rng.lognormvariate(4, 1)) + 4 for _ in range(300)), reverse=True)
    sizes = padded_microbatch_sizes(lengths, 8, 4)
    assert sum(sizes) == 300 and len(sizes) == 8
    even = even_microbatch_sizes(300, 8)
    assert _padded_objective(lengths, sizes, 4) < 0.8 * _padded_objective(lengths, even, 4)


def test_padded_sizes_need_lengths_longest_first():
    with pytest.raises(ValueError, match="longest first"):
        padded_microbatch_sizes([3, 5], 2, 2)
