"""``ranks_per_device``: several pipeline ranks sharing one device (the single-GPU development mode)."""

from __future__ import annotations

import pytest

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, reference_batches, token_batches


def test_two_ranks_on_one_device_keep_parity(tmp_path):
    batches = token_batches(3, batch_size=4, lengths=[9, 5, 13])
    make = lambda: TinyGPT(layers=4).double()
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, start_method=START_METHOD, ranks_per_device=2)
    pipelined = fit(make, batches, strategy, devices=1, steps=3)
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert strategy.process_group_backend == "gloo"
    assert_same_parameters(pipelined, reference, atol=1e-10)


def test_shared_device_refuses_nccl():
    with pytest.raises(ValueError, match="ranks_per_device=2.*NCCL refuses"):
        ElasticPipelineStrategy(ranks_per_device=2, process_group_backend="nccl")
    with pytest.raises(ValueError, match="at least 1"):
        ElasticPipelineStrategy(ranks_per_device=0)
