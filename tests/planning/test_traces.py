
import numpy as np
import pytest

from lightning_pipe.planning import (
    flan_like_trace,
    github_like_trace,
    sample_github_lengths,
    split_microbatches,
)



def test_flan_like_batches_have_a_short_maximum_95_percent_of_the_time():
    trace = flan_like_trace(5000, batch_size=32, seed=0)
    maxima = np.array([max(batch) for batch in trace.batches])
    assert abs((maxima < 4096).mean() - 0.95) < 0.01
    assert maxima.max() - trace.lengths().min() > 50_000  # lengths differ by up to ~60000 (heavy tail)
    assert all(len(batch) == 32 for batch in trace.batches)


def test_github_like_sequence_statistics():
    lengths = sample_github_lengths(300_000, np.random.default_rng(0))
    assert abs((lengths <= 8192).mean() - 0.915) < 0.003
    assert abs((lengths >= 65536).mean() - 0.006) < 0.0005
    share = lengths[lengths >= 65536].sum() / lengths.sum()
    assert abs(share - 0.216) < 0.015


def test_github_like_batches_fill_a_token_budget():
    trace = github_like_trace(50, tokens_per_batch=262144, seed=1)
    totals = [sum(batch) for batch in trace.batches]
    assert trace.num_batches == 50 and max(totals) <= 262144 and min(totals) > 262144 - 131072
    with pytest.raises(ValueError, match="must be >= `max_length`"):
        github_like_trace(1, tokens_per_batch=1000)


def test_traces_are_deterministic_by_seed():
    assert flan_like_trace(10, seed=5) == flan_like_trace(10, seed=5)
    assert flan_like_trace(10, seed=5) != flan_like_trace(10, seed=6)
    assert github_like_trace(3, seed=2) == github_like_trace(3, seed=2)


def test_split_microbatches_balances_tokens():
    shapes = split_microbatches([100, 5, 3, 7, 2, 90], 3)
    assert [s.tokens for s in shapes] == [100, 90, 17]
    assert sum(s.num_sequences for s in shapes) == 6
    assert len(split_microbatches([10, 20], 8)) == 2  # never an empty microbatch
    with pytest.raises(ValueError, match="`lengths` is empty"):
        split_microbatches([], 2)
