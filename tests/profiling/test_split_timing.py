"""Measuring zero-bubble's split backward on a real stage: times for B, I and W, nothing changed."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.model import StageRunner, StageSpan, find_blocks
from lightning_pipe.profiling.split_timing import time_split_backward
from tests.helpers.models import TinyGPT


@pytest.mark.parametrize("span", [StageSpan(1, 2, 4, 4), StageSpan(1, 1, 3, 4)], ids=["last", "middle"])
def test_times_the_stage_whole_and_split_without_touching_gradients(span):
    torch.manual_seed(0)
    model = TinyGPT(layers=4)
    runner = StageRunner(model, find_blocks(model))
    params = list(model.parameters())
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    batch = torch.randint(0, 32, (4, 17))
    rng = torch.get_rng_state()
    timing = time_split_backward(runner, "training_step", (batch, 0), span, params, torch.device("cpu"), repeats=2)
    assert timing.backward_seconds > 0 and timing.input_seconds > 0 and timing.weight_seconds > 0
    assert all(p.grad is None for p in params) and not fired  # W computed its gradients and dropped them
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_first_stage_has_nothing_to_split():
    model = TinyGPT(layers=2)
    runner = StageRunner(model, find_blocks(model))
    with pytest.raises(ValueError, match="its I computes nothing"):
        time_split_backward(runner, "training_step", (torch.randint(0, 32, (2, 9)), 0), StageSpan(0, 0, 1, 2),
                            list(model.parameters()), torch.device("cpu"))
