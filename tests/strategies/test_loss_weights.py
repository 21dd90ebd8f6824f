"""Token-averaged losses: microbatch losses weighted by their counted targets equal one device."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import PaddedLM, padded_batches
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, logged, reference_batches

STEPS = 3
# two microbatches of two samples: 1 + 2 counted labels against 8 + 8
COUNTED = [1, 2, 8, 8]


def _strategy(schedule: str = "1f1b", pp: int = 2, **kwargs) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=pp, num_microbatches=2, schedule=schedule, start_method=START_METHOD, **kwargs
    )


def _max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    other = dict(b.named_parameters())
    return max((p - other[n]).abs().max().item() for n, p in a.named_parameters())


# counts that change from batch to batch: each step's losses are divided by the last step's counted
# targets upfront (DeferredNormalization's `expected`), and what remains is corrected after the step
CHANGING = [COUNTED, [3, 3, 8, 6], COUNTED]


@pytest.mark.parametrize(
    ("schedule", "loss", "counted"),
    [("1f1b", "functional", COUNTED), ("zbv", "module", COUNTED), ("1f1b", "num_items", COUNTED), ("1f1b", "functional", CHANGING)],
)
def test_token_mean_parity(tmp_path, schedule, loss, counted):
    batches = padded_batches(STEPS, batch_size=4, length=8, counted=counted)
    make = lambda: PaddedLM(loss=loss).double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(schedule), devices=2, steps=STEPS, log_dir=tmp_path / "pipe")
    reference = fit(make, reference_batches(batches, 1), steps=STEPS, log_dir=tmp_path / "ref")
    assert_same_parameters(pipelined, reference, atol=1e-10)
    torch.testing.assert_close(logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss"))
    if loss == "functional":  # the test can fail: weighting by samples is visibly different here
        by_samples = fit(make, batches, _strategy(schedule, loss_weights="samples"), devices=2, steps=STEPS)
        assert _max_difference(by_samples, reference) > 1e-6


def test_token_mean_with_gradient_accumulation():
    batches = padded_batches(4, batch_size=4, length=8, counted=COUNTED)
    make = lambda: PaddedLM().double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(), devices=2, steps=2, accumulate_grad_batches=2)
    reference = fit(make, reference_batches(batches, 1), steps=2, accumulate_grad_batches=2)
    assert_same_parameters(pipelined, reference, atol=1e-10)


def test_token_mean_with_data_parallel_equals_ddp():
    """pp=2 x dp=2 against Lightning's DDP on 2 processes: each replica averages over its own batch."""
    batches = padded_batches(2 * STEPS, batch_size=4, length=8, counted=[COUNTED, [8, 8, 8, 6], [3, 8, 1, 8]])
    make = lambda: PaddedLM().double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(), devices=4, steps=STEPS)
    ddp = fit(make, batches, "ddp_fork", devices=2, steps=STEPS)
    assert_same_parameters(pipelined, ddp, atol=1e-10)
    # replicas count different targets: averaging over both replicas' tokens at once would differ
    global_tokens = fit(make, reference_batches(batches, 2), steps=STEPS)
    assert _max_difference(global_tokens, ddp) > 1e-6


def test_custom_loss_weights():
    """A per-sample weighted mean no loss function shows: `loss_weights=` a callable of the microbatch."""
    batches = padded_batches(STEPS, batch_size=4, length=8, counted=COUNTED)
    make = lambda: PaddedLM(loss="weighted").double()  # noqa: E731
    weights = lambda microbatch: microbatch["weight"].sum()  # noqa: E731
    pipelined = fit(make, batches, _strategy(loss_weights=weights), devices=2, steps=STEPS)
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)
