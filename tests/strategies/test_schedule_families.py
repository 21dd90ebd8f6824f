"""Every schedule family runs on real processes and trains exactly like a single process."""

from __future__ import annotations

import pytest

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import TinyGPT
from tests.helpers.training import assert_same_parameters, fit, reference_batches, token_batches

STEPS = 3


@pytest.mark.parametrize(
    ("schedule", "pp", "layers"),
    [
        ("interleaved_1f1b", 2, 4),  # 2 model chunks per rank, circular placement
        ("looped_bfs", 2, 4),
        ("zb_h1", 2, 4),  # split backward: I then W
        ("zbv", 2, 4),  # V placement: rank 0 runs the first and the last stage
        ("zb_h1", 4, 4),
    ],
)
def test_family_parity(tmp_path, schedule, pp, layers):
    batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
    make = lambda: TinyGPT(layers=layers).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=pp, num_microbatches=4, schedule=schedule, start_method="spawn"
    )
    pipelined = fit(make, batches, strategy, devices=pp, steps=STEPS)
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)
