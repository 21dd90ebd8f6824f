import itertools

import numpy as np
import pytest

from lightning_pipe.planning import (
    balanced_partition,
    check_boundaries,
    random_partition,
    uniform_partition,
    unit_ranges,
)


def test_uniform_partition_spreads_the_remainder():
    assert uniform_partition(24, 4) == (0, 6, 12, 18, 24)
    assert uniform_partition(10, 4) == (0, 2, 5, 7, 10)
    assert uniform_partition(3, 3) == (0, 1, 2, 3)


@pytest.mark.parametrize(("blocks", "stages", "match"), [(3, 4, "num_blocks`=3 < `num_stages`=4"), (3, 0, ">= 1")])
def test_partitions_reject_impossible_counts(blocks, stages, match):
    with pytest.raises(ValueError, match=match):
        uniform_partition(blocks, stages)
    with pytest.raises(ValueError, match=match):
        random_partition(blocks, stages, 0)


def heaviest(bounds, weights, first, last):
    """Largest stage weight of a partition, with ``first``/``last`` charged to the end stages."""
    loads = [weights[bounds[s] : bounds[s + 1]].sum() for s in range(len(bounds) - 1)]
    loads[0] += first
    loads[-1] += last
    return max(loads)


def test_balanced_partition_is_the_min_max_by_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        weights = rng.uniform(0, 10, int(rng.integers(3, 9)))
        stages = int(rng.integers(1, min(4, len(weights)) + 1))
        first, last = rng.uniform(0, 10, 2)
        bounds = balanced_partition(weights, stages, first_weight=first, last_weight=last)
        every = [(0, *c, len(weights)) for c in itertools.combinations(range(1, len(weights)), stages - 1)]
        loads = [heaviest(b, weights, first, last) for b in every]
        assert heaviest(bounds, weights, first, last) == pytest.approx(min(loads))


def test_balanced_partition_charges_pre_and_post():
    # A heavy head (post) pushes blocks to the earlier stages.
    assert balanced_partition([1.0] * 6, 2, last_weight=2.0) == (0, 4, 6)
    with pytest.raises(ValueError, match="must be >= 0"):
        balanced_partition([1.0, -1.0], 1)


def test_random_partition_is_valid_and_seeded():
    for seed in range(20):
        bounds = random_partition(9, 4, seed)
        assert check_boundaries(bounds, 9, 4) == bounds
    assert random_partition(30, 5, 3) == random_partition(30, 5, np.random.default_rng(3))


def test_unit_ranges_put_pre_first_and_post_last():
    assert unit_ranges((0, 2, 5), 5) == [(0, 3), (3, 7)]
    assert unit_ranges((0, 5), 5) == [(0, 7)]


def test_check_boundaries_names_the_problem():
    with pytest.raises(ValueError, match="expected 3"):
        check_boundaries([0, 2, 5], 5, 3)
    with pytest.raises(ValueError, match="at least 2 entries"):
        check_boundaries([0], 5)
