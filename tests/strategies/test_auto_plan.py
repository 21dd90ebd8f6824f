"""``ElasticPipelineStrategy(plan="auto")``: the joint planner installed by the strategy, exact, and
refused next to callbacks or arguments whose decisions it would override."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from jsonargparse import ArgumentParser

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import AutoPlanner, ElasticRepartition, PipelineMonitor
from lightning_pipe.strategies.auto_plan import install_auto_planner
from tests.helpers.models import PaddedLM, padded_batches
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, logged, reference_batches

COUNTED = [[8, 1, 1, 2, 8, 1, 3, 8], [2, 8, 8, 1, 1, 1, 8, 4]]


def test_plan_auto_parity_and_logs(tmp_path):
    batches = padded_batches(3, batch_size=8, length=8, counted=COUNTED)
    make = lambda: PaddedLM(layers=4).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, start_method=START_METHOD, plan="auto")
    pipelined = fit(make, batches, strategy, devices=2, steps=3, log_dir=tmp_path / "pipe")
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    assert len(logged(tmp_path / "pipe", "auto/predicted_step_s")) == 3  # the installed planner planned every step
    waited = logged(tmp_path / "pipe", "auto/planning_waited_s")
    assert len(waited) == 3 and all(w >= 0 for w in waited)


def test_plan_auto_installs_once_and_refuses_conflicts():
    trainer = SimpleNamespace(callbacks=[PipelineMonitor()])
    install_auto_planner(trainer)
    install_auto_planner(trainer)  # a second fit with the same Trainer
    assert [type(c).__name__ for c in trainer.callbacks] == ["PipelineMonitor", "AutoPlanner"]
    for clash in (AutoPlanner(), ElasticRepartition()):
        with pytest.raises(ValueError, match=f"installs its own AutoPlanner.*{type(clash).__name__}"):
            install_auto_planner(SimpleNamespace(callbacks=[clash]))
    with pytest.raises(ValueError, match="chooses recomputation and offload per batch"):
        ElasticPipelineStrategy(plan="auto", recompute="full")
    with pytest.raises(ValueError, match="use 'static' or 'auto'"):
        ElasticPipelineStrategy(plan="joint")


def test_plan_auto_from_a_config():
    """What LightningCLI does with ``trainer.strategy: {class_path: ..., init_args: {plan: auto}}``."""
    parser = ArgumentParser()
    parser.add_class_arguments(ElasticPipelineStrategy, "strategy")
    config = parser.parse_string("strategy:\n  pipeline_parallel_size: 2\n  plan: auto\n")
    strategy = parser.instantiate_classes(config).strategy
    assert strategy._plan_mode == "auto"
    with pytest.raises(SystemExit):  # jsonargparse refuses a value outside the Literal
        parser.parse_string("strategy:\n  plan: joint\n")
