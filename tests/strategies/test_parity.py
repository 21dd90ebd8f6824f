"""The central invariant: a pipelined run ends with the parameters of a single-process run."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import MaskedModel, TinyGPT, with_spare_parameter
from tests.helpers.training import (
    START_METHOD,
    assert_same_parameters,
    fit,
    logged,
    reference_batches,
    token_batches,
)

STEPS = 3


def _strategy(pp: int, schedule: str, microbatches: int = 4, start_method: str = START_METHOD) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=pp, num_microbatches=microbatches, schedule=schedule, start_method=start_method
    )


@pytest.mark.parametrize(("schedule", "pp", "dp"), [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 2, 2), ("gpipe", 4, 1)])
def test_gpt_parity(tmp_path, schedule, pp, dp):
    lengths = [9, 5, 13, 7, 9, 5][: STEPS * dp] if dp == 1 else 8  # replicas of one step share T
    batches = token_batches(STEPS * dp, batch_size=4, lengths=lengths)
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    if dp > 1:  # a parameter no replica uses keeps no gradient, as on one device (AdamW then skips it)
        make = lambda: with_spare_parameter(TinyGPT(layers=4).double())  # noqa: E731

    start = "spawn" if (schedule, pp, dp) == ("gpipe", 2, 1) else START_METHOD  # keep the spawn launcher covered
    pipelined = fit(make, batches, _strategy(pp, schedule, start_method=start), devices=pp * dp, steps=STEPS, log_dir=tmp_path / "pipe")
    reference = fit(make, reference_batches(batches, dp), steps=STEPS, log_dir=tmp_path / "ref")

    assert_same_parameters(pipelined, reference, atol=1e-10)
    assert not torch.equal(reference.blocks[0].qkv.weight, TinyGPT(layers=4).blocks[0].qkv.weight)
    if dp == 1:  # with data parallelism each replica logs its own batch's loss; sync_dist is not used here
        torch.testing.assert_close(logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss"))


def test_masked_tuple_blocks_parity(tmp_path):
    """Blocks with mask/position arguments and tuple outputs, a dict batch, a sum-reduced log."""
    generator = torch.Generator().manual_seed(0)
    batches = [
        {
            "input_ids": torch.randint(0, 32, (4, t), generator=generator),
            "labels": torch.randint(0, 32, (4, t), generator=generator),
            "scale": torch.rand(4, generator=generator, dtype=torch.float64) + 0.5,
        }
        for t in (6, 10, 8)
    ]
    make = lambda: MaskedModel(layers=4).double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(2, "1f1b"), devices=2, steps=STEPS, log_dir=tmp_path / "pipe")
    reference = fit(make, reference_batches(batches, 1), steps=STEPS, log_dir=tmp_path / "ref")
    assert_same_parameters(pipelined, reference, atol=1e-10)
    tokens = [float(b["input_ids"].numel()) for b in reference_batches(batches, 1)]
    assert logged(tmp_path / "pipe", "tokens") == logged(tmp_path / "ref", "tokens") == tokens
    torch.testing.assert_close(logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss"))


def test_configure_model_parity(tmp_path):
    """Blocks built in `configure_model` get the values a single-process run gives them."""
    from tests.helpers.callbacks import SaveFullState
    from tests.helpers.models import ConfiguredGPT

    batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
    make = lambda: ConfiguredGPT(layers=4).double()  # noqa: E731
    saved = tmp_path / "full.pt"
    fit(make, batches, _strategy(2, "1f1b"), devices=2, steps=STEPS, callbacks=[SaveFullState(str(saved))])
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    state = torch.load(saved)
    assert len(reference.blocks) == 4 and state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")
