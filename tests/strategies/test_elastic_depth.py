"""Elastic depth: 4 processes move between layouts of stages and widths every step, exactly.

Every step runs a different layout (4x1, 2x2, 1x4 and the uneven ones), with new random boundaries,
inside and across accumulation windows; parameters equal one device's to 1e-10 (float64).
"""

from __future__ import annotations

import itertools
import json

import lightning as L
import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import PipelineMonitor
from tests.helpers.callbacks import RandomLayouts
from tests.helpers.loop import rank_files
from tests.helpers.models import TinyGPT, with_spare_parameter
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, logged, reference_batches, token_batches

LAYOUTS = [(1, 1, 1, 1), (2, 2), (4,), (2, 1, 1), (1, 3), (1, 2, 1), (3, 1), (1, 1, 2)]


class RecordLayouts(L.Callback):
    """Every rank writes the widths, boundaries and its stage of each step."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        row = {"widths": strategy.plan.widths, "boundaries": strategy.plan.boundaries, "stages": list(strategy.spans)}
        with open(self.directory / f"rank{strategy.global_rank}.txt", "a") as f:
            f.write(json.dumps(row) + "\n")




@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_random_layouts_parity(tmp_path, optimizer):
    steps, accumulate = 3, 2
    batches = token_batches(steps * accumulate, batch_size=8, lengths=[9, 5, 7, 9, 6, 8])
    validation = token_batches(2, batch_size=6, lengths=[7, 4], seed=5)
    if optimizer == "sgd":  # a batch of 3 samples: 3 microbatches, so a replica of a width-4 stage may run none
        batches[1] = batches[1][:3]  # it runs on (4,) (seed 11)
    make = lambda: with_spare_parameter(TinyGPT(layers=6, optimizer=optimizer).double())
    strategy = ElasticPipelineStrategy(num_microbatches=4, elastic_depth=True, start_method=START_METHOD)
    proposer = RandomLayouts(LAYOUTS, seed=7 if optimizer == "adamw" else 11)
    pipelined = fit(
        make, batches, strategy, devices=4, steps=steps, accumulate_grad_batches=accumulate,
        callbacks=[proposer, RecordLayouts(tmp_path), PipelineMonitor(timeline_every_n_steps=0)],
        log_dir=tmp_path / "pipe", gradient_clip_val=0.1, val_batches=validation, val_check_interval=2,
    )
    reference = fit(
        make, reference_batches(batches, 1), steps=steps, accumulate_grad_batches=accumulate, log_dir=tmp_path / "ref",
        gradient_clip_val=0.1, val_batches=validation, val_check_interval=2,
    )
    assert_same_parameters(pipelined, reference, atol=1e-10)
    # validation ran on whatever layout the step before left (forward-only layout programs)
    val_losses = logged(tmp_path / "pipe", "val_loss")
    assert len(val_losses) == 3
    torch.testing.assert_close(val_losses, logged(tmp_path / "ref", "val_loss"))
    torch.testing.assert_close(logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss"))
    files = rank_files(tmp_path)
    rows = [[json.loads(line) for line in files[rank].splitlines()] for rank in sorted(files)]
    assert len(rows) == 4 and all(len(r) == steps * accumulate for r in rows)
    widths = [tuple(row["widths"]) for row in rows[0]]
    assert all(a != b for a, b in itertools.pairwise(widths))  # a new layout every step
    assert any(len(set(w)) > 1 for w in widths) and any(max(w) > 1 for w in widths)
    for step in range(steps * accumulate):  # every rank ran the stage its layout gives it
        w = widths[step]
        owners = [s for s, width in enumerate(w) for _ in range(width)]
        assert [rows[rank][step]["stages"] for rank in range(4)] == [[s] for s in owners]
    if optimizer == "adamw":  # the monitor logged every step's widths and drew the layouts over time
        summaries = [json.loads(line) for line in (tmp_path / "pipe" / "pipeline_steps.jsonl").open()]
        assert [tuple(row["widths"]) for row in summaries] == widths
        # the simulator runs layout programs: a simulated bubble for every layout, > 0 with several stages
        assert all(0.0 <= row["simulated_bubble_ratio"] < 1.0 for row in summaries)
        assert all(row["simulated_bubble_ratio"] > 0.0 for row in summaries if len(row["widths"]) > 1)
        assert (tmp_path / "pipe" / "pipeline_layouts.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"optimizer_offload": True}, "does not support `optimizer_offload=True`"),
        ({"packing": True}, "does not support `packing`"),
        ({"recompute": "full"}, "does not apply memory plans yet"),
        ({"memory_budget": "1GiB"}, "does not apply memory plans yet"),
        ({"schedule": "gpipe"}, "Use `schedule='1f1b'`"),
        ({"pipeline_parallel_size": 2}, "leave `pipeline_parallel_size` unset"),
    ],
)
def test_refusals_at_construction(arguments, message):
    with pytest.raises(ValueError, match=message):
        ElasticPipelineStrategy(elastic_depth=True, **arguments)


def test_refusals_of_plans_and_modules():
    from lightning_pipe.planning.memory_model import MemoryPlan, StageMemory
    from lightning_pipe.planning.plan import PipelinePlan
    from lightning_pipe.strategies.regrouping import Regrouping, contiguous_rank_sets

    with pytest.raises(ValueError, match="needs `ElasticPipelineStrategy\\(elastic_depth=True\\)`"):
        Regrouping.check_plan(PipelinePlan((0, 2, 4), widths=(2, 2)), 4, enabled=False)
    with pytest.raises(ValueError, match="runs heterogeneous 1F1B; its schedule is 'gpipe'"):
        Regrouping.check_plan(PipelinePlan((0, 2, 4), "gpipe", widths=(2, 2)), 4, enabled=True)
    with pytest.raises(ValueError, match="must sum to the 4 processes"):
        Regrouping.check_plan(PipelinePlan((0, 2, 4), widths=(2, 1)), 4, enabled=True)
    recompute = MemoryPlan(default=StageMemory(full=1))
    with pytest.raises(ValueError, match="does not apply memory plans"):
        Regrouping.check_plan(PipelinePlan((0, 2, 4), memory=recompute, widths=(2, 2)), 4, enabled=True)
    Regrouping.check_plan(PipelinePlan((0, 2, 4), memory=MemoryPlan(), widths=(2, 2)), 4, enabled=True)
    with pytest.raises(ValueError, match="tied embeddings"):
        Regrouping().check_module(False, [(None, (0, 3))])
    with pytest.raises(ValueError, match="torchmetrics"):
        Regrouping().check_module(True, [])
    assert contiguous_rank_sets(4) == [(0, 1), (1, 2), (2, 3), (0, 1, 2), (1, 2, 3), (0, 1, 2, 3)]


def _skewed_cost_model():
    """6 blocks whose parameters dominate memory, activations growing with tokens (see the test)."""
    from lightning_pipe.planning.cost_model import CostModel, LinearCost, UnitCost

    def unit(name, parameter_bytes):
        saved = LinearCost(per_token=10.0 if parameter_bytes else 0.0)
        return UnitCost(
            name, LinearCost(per_token=0.1), LinearCost(per_token=0.2), saved, output_bytes_per_token=8.0,
            parameter_bytes=parameter_bytes,
        )

    blocks = tuple(unit(f"block{i}", 1000.0) for i in range(6))
    return CostModel((unit("pre", 0.0), *blocks, unit("post", 0.0)), latency=1e-3, bandwidth=1e6)


@pytest.mark.timeout(300)
def test_elastic_depth_follows_lengths_exactly(tmp_path):
    """FMOP on a skewed trace: short batches run data parallel (1 x 4), long ones deeper, and the run
    stays exact (SGD with momentum, accumulation over a layout change)."""
    from lightning_pipe.callbacks import ElasticDepth

    lengths = [4, 24, 24, 4, 4, 16]
    batches = token_batches(len(lengths), batch_size=8, lengths=lengths)
    make = lambda: TinyGPT(layers=6, optimizer="sgd").double()
    strategy = ElasticPipelineStrategy(num_microbatches=4, elastic_depth=True, start_method=START_METHOD)
    depth = ElasticDepth(cost_model=_skewed_cost_model(), device_memory=7000, migration_horizon=1)
    pipelined = fit(
        make, batches, strategy, devices=4, steps=3, accumulate_grad_batches=2,
        callbacks=[depth, RecordLayouts(tmp_path)],
    )
    reference = fit(make, reference_batches(batches, 1), steps=3, accumulate_grad_batches=2)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    files = rank_files(tmp_path)
    widths = [tuple(json.loads(line)["widths"] or ()) for line in files[0].splitlines()]
    short = {w for w, n in zip(widths, lengths) if n == 4}
    long = {w for w, n in zip(widths, lengths) if n >= 16}
    assert short == {(4,)} and all(len(w) > 1 for w in long), widths


@pytest.mark.timeout(300)
def test_sharded_checkpoint_of_replicas_resumes_exactly(tmp_path):
    """A checkpoint written by two replicas of one stage (layout (2,), both holding every tensor)
    loads into the next run's starting layout (2 stages), which then moves to the saved layout, and
    resumes exactly, still regrouping."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.loop import run
    from tests.strategies.test_elastic_depth_io import RecordStart

    batches = token_batches(1, batch_size=4, lengths=[9])  # one step per epoch: checkpoints at epoch ends
    make = lambda: TinyGPT(layers=4).double()

    def elastic() -> ElasticPipelineStrategy:
        return ElasticPipelineStrategy(num_microbatches=4, elastic_depth=True, start_method=START_METHOD)

    saving = ModelCheckpoint(tmp_path / "saved", every_n_train_steps=1, save_top_k=-1)
    run(make, batches, elastic(), devices=2, max_steps=1, callbacks=[RandomLayouts([(1, 1), (2,)]), saving])
    path = tmp_path / "saved" / "epoch=0-step=1.ckpt"
    assert path.is_dir()
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["pipeline"]["plan"]["widths"] == [2]
    records = tmp_path / "resumed"
    records.mkdir()
    resumed, _, _ = run(
        make, batches, elastic(), devices=2, max_steps=3, ckpt_path=str(path),
        callbacks=[RandomLayouts([(1, 1), (2,)]), RecordStart(records)],
    )
    reference, _, _ = run(make, batches, max_steps=3)
    assert_same_parameters(resumed, reference, atol=1e-10)
    starts = [json.loads(text.splitlines()[0]) for text in rank_files(records).values()]
    assert [row["widths"] for row in starts] == [[2], [2]]  # resumed on the saved layout, then regrouped


@pytest.mark.parametrize("other", ["ElasticRepartition", "MemoryPlanner", "AutoPlanner"])
def test_elastic_depth_refuses_other_planners_before_training(other):
    """Planners of the partition or of memory plans next to `ElasticDepth` are refused in `setup`."""
    from types import SimpleNamespace

    from lightning_pipe import callbacks
    from lightning_pipe.strategies.regrouping import Regrouping

    depth = callbacks.ElasticDepth()
    trainer = SimpleNamespace(strategy=SimpleNamespace(regrouping=Regrouping()), callbacks=[depth, getattr(callbacks, other)()])
    with pytest.raises(ValueError, match=f"the Trainer also has {other}.*Remove them from `callbacks`"):
        depth.setup(trainer, None, "fit")
    trainer.callbacks = [depth]
    depth.setup(trainer, None, "fit")  # alone it is fine


def test_saved_plan_restores_only_a_layout_that_fits(caplog):
    """A resume moves to the checkpoint's layout when it has widths and fits the run; otherwise it
    keeps its own layout (and says so when the record does not fit)."""
    from lightning_pipe.planning.plan import PipelinePlan
    from lightning_pipe.strategies.regrouping import Regrouping

    current = PipelinePlan((0, 1, 2, 3, 4), num_microbatches=4)
    record = {"plan": {"boundaries": [0, 3, 4], "widths": [1, 3]}}
    plan = Regrouping.saved_plan(record, current, 4)
    assert plan.widths == (1, 3) and plan.boundaries == (0, 3, 4) and plan.num_microbatches == 4
    assert Regrouping.saved_plan(None, current, 4) is None
    assert Regrouping.saved_plan({"plan": {"boundaries": [0, 2, 4], "widths": None}}, current, 4) is None
    assert Regrouping.saved_plan(record, plan, 4) is None  # already there
    with caplog.at_level("WARNING"):
        assert Regrouping.saved_plan(record, current, 2) is None  # saved by 4 processes, resumed on 2
        assert Regrouping.saved_plan({"plan": {"boundaries": [0, 3, 6], "widths": [2, 2]}}, current, 4) is None
    assert caplog.text.count("does not fit this run") == 2


def _depth_fit_then_plain_validate(rank: int, init_file: str, out_dir: str) -> None:
    """Processes started outside Lightning: an elastic-depth fit that moves block 1 to the second stage,
    then a new Trainer with a plain 2-stage pipeline (balanced: block 1 back on the first) validates the
    same module."""
    import os

    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PlanProposal
    from tests.helpers.loop import SEED, loader, started_outside
    from tests.strategies.test_loop_features import EvalGPT

    class Layout(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                trainer.strategy.propose(PlanProposal("depth", boundaries=(0, 1, 4), widths=(1, 1)))

    settings = dict(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    with started_outside(rank, init_file):
        L.seed_everything(SEED, verbose=False)
        model = EvalGPT(layers=4).double()
        batches = token_batches(2, batch_size=4, lengths=[6, 9], seed=3)
        elastic = ElasticPipelineStrategy(num_microbatches=2, elastic_depth=True)
        L.Trainer(strategy=elastic, callbacks=[Layout()], **settings).fit(model, loader(batches))
        plain = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2)
        validated = L.Trainer(strategy=plain, **settings).validate(model, loader(batches))
        torch.save({"validated": validated, "boundaries": (elastic.boundaries, plain.boundaries)},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_new_trainer_gathers_what_an_elastic_depth_fit_left_where_it_moved_it(tmp_path):
    """The module's placement after an elastic-depth fit (torchrun: the processes go on) is gathered by a
    new Trainer's pipeline like a repartitioning, and its validation equals one process's."""
    import torch.multiprocessing as mp

    from tests.helpers.loop import loader, run
    from tests.strategies.test_loop_features import EvalGPT

    mp.start_processes(
        _depth_fit_then_plain_validate, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
        start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(part["boundaries"] == ((0, 1, 4), (0, 2, 4)) for part in parts)  # block 1 had to move back
    batches = token_batches(2, batch_size=4, lengths=[6, 9], seed=3)
    model, trainer, _ = run(lambda: EvalGPT(layers=4).double(), batches, max_steps=2)
    expected = trainer.validate(model, loader(batches))[0]["val_loss"]
    for part in parts:
        got = torch.tensor(part["validated"][0]["val_loss"])
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-10, rtol=0)
