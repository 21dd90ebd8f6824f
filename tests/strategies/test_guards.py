"""Rows of docs/user-guide.md "What is checked for you": where one device trains fine, the pipeline
either does the same or says clearly what to change (and prints nothing a user cannot act on).

Timeouts and failing ranks are in test_failures.py; the loader rule in test_data_order.py;
checkpoint completeness in test_resume_features.py.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

import lightning_pipe  # noqa: F401  (registers the name and the hint)
from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.strategies.checkpointing import load_module_state
from tests.helpers.loop import pipeline, run
from tests.helpers.models import TinyGPT
from tests.helpers.training import token_batches

BATCHES = token_batches(2, batch_size=4, lengths=6)


class LBFGSGPT(TinyGPT):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


class ClosureTwice(torch.optim.SGD):
    """A user optimizer that evaluates the loss once more before its own step (as line searches do)."""

    def step(self, closure=None):
        closure()
        return super().step(closure)


class ClosureTwiceGPT(TinyGPT):
    def configure_optimizers(self):
        return ClosureTwice(self.parameters(), lr=0.1)


@pytest.mark.timeout(120)
def test_lbfgs_is_refused_before_the_first_update():
    with pytest.raises(
        Exception,
        match=r"`LBFGS` is not supported by `ElasticPipelineStrategy`: it re-evaluates the closure.*Use a first-order optimizer",
    ):
        run(lambda: LBFGSGPT(layers=2).double(), BATCHES, pipeline(2), devices=2, max_steps=1)


@pytest.mark.timeout(120)
def test_an_optimizer_calling_its_closure_twice_is_stopped_before_it_updates():
    with pytest.raises(
        Exception, match=r"`ClosureTwice.step` called its closure a second time in one step.*first-order optimizer"
    ):
        run(lambda: ClosureTwiceGPT(layers=2).double(), BATCHES, pipeline(2), devices=2, max_steps=1)


@pytest.mark.parametrize("name", ["elastic-pipe", "Elastic-Pipe", "elasticpipe", "elastic_pipeline"])
def test_misspelled_strategy_name_gets_a_hint(name):
    with pytest.raises(ValueError, match=r"invalid strategy name.*Did you mean `strategy='elastic_pipe'`"):
        L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)


def test_unrelated_strategy_names_keep_lightnings_message():
    with pytest.raises(ValueError, match=r"invalid strategy name") as error:
        L.Trainer(strategy="ddpx", accelerator="cpu", devices=2, logger=False)
    assert "Did you mean" not in str(error.value)


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("-1GiB", r"`memory_budget='-1GiB'`: A size must be finite and not negative, got '-1GiB'"),
        (
            "40 GiBs",
            r"`memory_budget='40 GiBs'`: Cannot read the size '40 GiBs': use a number of bytes or a number with a unit",
        ),
        (-5, r"`memory_budget=-5`: A size must be finite and not negative"),
    ],
)
def test_memory_budget_errors_blame_what_is_wrong(budget, message):
    with pytest.raises(ValueError, match=message):
        ElasticPipelineStrategy(memory_budget=budget)


def test_loading_a_checkpoint_into_a_sharded_module_is_quiet_and_still_strict():
    """Units other ranks hold are on meta: copying into them is skipped without torch's warning per
    parameter; real ones are filled; missing or unexpected keys still fail under ``strict``."""
    full = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    sharded = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        load_module_state(sharded, full.state_dict())
    torch.testing.assert_close(sharded[0].weight, full[0].weight)
    assert sharded[1].weight.is_meta
    with pytest.raises(RuntimeError, match="Missing key"):
        load_module_state(sharded, {k: v for k, v in full.state_dict().items() if k != "1.bias"})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_module_state(sharded, {**full.state_dict(), "2.weight": torch.zeros(1)})
