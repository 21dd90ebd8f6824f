"""The checked batch split in training: layouts, per-sample lists, short batches, batch normalization."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import TimeMajorClassifier, TinyGPT, time_major_batches
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, reference_batches, token_batches

STEPS = 3


def _strategy(**kwargs) -> ElasticPipelineStrategy:
    options = {"pipeline_parallel_size": 2, "num_microbatches": 4, "start_method": START_METHOD, **kwargs}
    return ElasticPipelineStrategy(**options)


def test_time_major_batch_is_refused_without_batch_dim():
    with pytest.raises(ValueError, match=r"time-major layers .*`encoder.layers.0.self_attn` \(MultiheadAttention\).*batch_dim"):
        _strategy().validate_module(TimeMajorClassifier())


@pytest.mark.parametrize("batch_dim", [{0: 1, 1: 0}, lambda path, tensor: 1 if tensor.dim() == 3 else 0])
def test_time_major_batch_parity(batch_dim):
    """(T, B, d) inputs and (B,) targets, cut along each one's batch dimension: equal to one device."""
    batches = time_major_batches(STEPS, batch_size=8, length=5)
    make = lambda: TimeMajorClassifier().double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(batch_dim=batch_dim), devices=2, steps=STEPS)
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)


def test_time_major_batch_with_the_default_dimension_names_the_sizes():
    """`batch_dim=0` stated for (T, B, d) inputs: the batch is refused with every item's size."""
    batches = time_major_batches(1, batch_size=8, length=5)
    make = lambda: TimeMajorClassifier().double()  # noqa: E731
    with pytest.raises(Exception, match=r"batch\[0\] \(5, 8, 8\) -> 5 \(dim 0\), batch\[1\] \(8,\) -> 8 \(dim 0\)"):
        fit(make, batches, _strategy(batch_dim=0), devices=2, steps=1)


def test_short_last_batch_runs_with_fewer_microbatches():
    """A last batch of 2 samples with 4 microbatches runs as 2 microbatches, exactly."""
    batches = token_batches(STEPS, batch_size=4, lengths=[6, 9, 7])
    batches[-1] = batches[-1][:2]
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(), devices=2, steps=STEPS)
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)


def test_batch_norm_is_refused_then_runs_with_a_warning():
    batches = time_major_batches(STEPS, batch_size=8, length=5)
    make = lambda: TimeMajorClassifier(norm=True).double()  # noqa: E731
    with pytest.raises(Exception, match=r"`bn` \(BatchNorm1d\) normalize over the samples of each microbatch"):
        fit(make, batches, _strategy(batch_dim={0: 1, 1: 0}), devices=2, steps=1)
    with pytest.warns(UserWarning, match="allow_sample_mixing=True"):
        fit(make, batches, _strategy(batch_dim={0: 1, 1: 0}, allow_sample_mixing=True, start_method="fork"), devices=2, steps=1)
