"""Microbatches sized by work: the balanced split is the exact min-max contiguous split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lightning_pipe.planning import gpt_1_3b
from lightning_pipe.planning.microbatching import (
    balance_microbatch_sizes,
    even_microbatch_sizes,
    microbatch_shapes,
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
