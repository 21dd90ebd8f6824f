"""Memory plans change how a step keeps activations, never what it computes; budgets hold; predictions match."""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import MemoryPlanner, PipelineMonitor
from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks
from lightning_pipe.planning.memory_lowering import read_memory_plan
from lightning_pipe.planning.memory_model import MemoryPlan, StageMemory, predict_memory
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.runtime.memory import MemoryRuntime
from lightning_pipe.profiling.memory_profile import measure_stages, probe_microbatches
from lightning_pipe.runtime.microbatch import split_batch
from lightning_pipe.schedules import resolve_schedule
from lightning_pipe.strategies.memory import StrategyMemory, build_profile
from tests.helpers.callbacks import RandomPlans
from tests.helpers.loop import ScheduledGPT, rank_files
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, logged, reference_batches, token_batches

MICROBATCHES = 4


def _strategy(schedule: str = "1f1b", **kwargs) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=MICROBATCHES, schedule=schedule, partition="uniform",
        start_method=START_METHOD, **kwargs,
    )


class RecordMemory(L.Callback):
    """Every rank appends, per step: plan, measured saved peak, static bytes, predicted peaks, MLP chunk sizes."""

    def __init__(self, directory, track: bool = False, profile: bool = False) -> None:
        self.directory = directory
        self.track = track
        self.profile = profile
        self.widths: list[int] = []

    def setup(self, trainer, pl_module, stage) -> None:
        trainer.strategy.memory.track = self.track
        def record(module, args, output) -> None:
            if not args[0].is_meta:  # real calls only (meta twins of other stages' blocks share the hook)
                self.widths.append(int(args[0].shape[-2]))

        for block in pl_module.blocks:
            block.mlp[0].register_forward_hook(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        memory = trainer.strategy.memory
        if self.profile and memory.profile is None:
            memory.measure_profile(batch, (batch_idx,))
        self.widths.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        memory, rank = strategy.memory, strategy.layout.pipeline_rank
        row = {
            "batch": batch_idx,
            "boundaries": list(strategy.boundaries),
            "plan": memory.plan.to_dict(),
            "measured": memory.last_step.peak_saved_bytes,
            "static": memory.last_step.static_bytes,
            "offloaded": memory.last_step.offloaded_tensors,
            "reloaded": memory.last_step.reloaded_tensors,
            "widths": sorted(set(self.widths)),
            # the memory plan read off the program this rank ran, and the memory actions it ran
            "ran_plan": read_memory_plan(memory.program_with_plan(strategy.program)).to_dict(),
            "markers": sorted({a.action.type.value for a in strategy.last_outcome.records if a.action.type.value.endswith(("COMPUTE", "LOAD"))}),
        }
        if memory.profile is not None:
            shapes = memory.microbatch_shapes(batch)
            args = (strategy.program, strategy.boundaries, shapes)
            row["predicted"] = predict_memory(*args, memory.plan, memory.profile).saved_peak_bytes[rank]
            row["none_peak"] = predict_memory(*args, MemoryPlan(), memory.profile).peak_bytes[rank]
        with open(self.directory / f"rank{rank}.txt", "a") as f:
            f.write(json.dumps(row) + "\n")


def _records(directory) -> dict[int, list[dict]]:
    return {rank: [json.loads(line) for line in text.splitlines()] for rank, text in rank_files(directory).items()}


def _recomputed(plan: dict) -> int:
    return sum((c["full"] or 0) + (c["keep_attention"] or 0) for c in plan["microbatches"].values())


def _budget(batch, fraction: float = 0.5) -> tuple[int, float]:
    """A budget between the full-recompute and no-recompute peaks of ``batch`` (1F1B, 2 uniform stages).

    Measured here in one process with the same probe the strategy runs, so the test knows before the
    run that the budget is below what the batch needs without recompute.
    """
    torch.manual_seed(0)
    model = TinyGPT(layers=4).double()
    model.log = lambda *args, **kwargs: None
    stack = find_blocks(model)
    runner = StageRunner(model, stack)
    first = split_batch(batch, MICROBATCHES)[0]
    records = measure_stages(
        runner, MemoryRuntime(stack.blocks, "cpu"), "training_step", [(p, 0) for p in probe_microbatches(first)],
        [StageSpan(0, 0, 2, 4), StageSpan(1, 2, 4, 4)], list(model.parameters()), torch.device("cpu"),
    )
    profile = build_profile(records, model, analyze_units(model, stack), 4.0)  # AdamW: weight, grad, 2 moments
    shapes = [profile.shape([batch.shape[1]] * (batch.shape[0] // MICROBATCHES))] * MICROBATCHES
    program = resolve_schedule("1f1b").build(2, MICROBATCHES)
    none = max(predict_memory(program, (0, 2, 4), shapes, MemoryPlan(), profile).peak_bytes)
    full = max(predict_memory(program, (0, 2, 4), shapes, MemoryPlan.from_options("full"), profile).peak_bytes)
    return int(full + fraction * (none - full)), none


def test_every_mechanism_keeps_parity(tmp_path):
    """Full, every-2nd, keep-attention, offload and chunked MLP, mixed per stage and microbatch."""
    plan = MemoryPlan(
        default=StageMemory(full=1, offload=1, mlp_chunk_size=4),
        stages={1: StageMemory(keep_attention=1, offload=1, mlp_chunk_size=4)},
        microbatches={(0, 2): StageMemory(full=None, every=2, mlp_chunk_size=4), (1, 3): StageMemory(keep_attention=None, mlp_chunk_size=3)},
    )
    batches = token_batches(3, batch_size=4, lengths=[9, 13, 11])
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(recompute=plan), devices=2, steps=3, callbacks=[RecordMemory(tmp_path)])
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    records = _records(tmp_path)
    for rank in (0, 1):
        for row in records[rank]:
            assert MemoryPlan.from_dict(row["plan"]) == plan
            assert row["offloaded"] > 0 and row["reloaded"] >= row["offloaded"]  # offload really copied
            assert max(row["widths"]) <= 4 < 9  # the MLPs really ran in chunks
            # the program that ran carried the plan as RECOMPUTE/OFFLOAD/RELOAD actions, and the plan reads back
            ran = MemoryPlan.from_dict(row["ran_plan"])
            assert all(ran.choice(s, mb) == plan.choice(s, mb) for s in (0, 1) for mb in range(MICROBATCHES))
            assert row["markers"] == ["OFFLOAD", "RECOMPUTE", "RELOAD"]
    assert 3 in records[1][0]["widths"]  # microbatch 3 of stage 1 used its own chunk size


def test_plans_changing_every_batch_keep_parity(tmp_path):
    """Random memory plans per batch on top of random partitions and schedules (zero-bubble included)."""

    class RandomMemoryPlans(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            strategy = trainer.strategy
            rng = random.Random(batch_idx)
            split = strategy.schedule.name.startswith("zb")
            modes = ["full", "offload"] + ([] if split else ["keep_attention"])
            choices = {}
            for stage in range(strategy.program.num_stages):
                for mb in range(strategy.num_microbatches):
                    counts = {mode: rng.randint(0, 2) for mode in modes}
                    choices[(stage, mb)] = StageMemory(
                        full=counts["full"], keep_attention=counts.get("keep_attention", 0), offload=counts["offload"],
                        mlp_chunk_size=rng.choice([None, 3]),
                    )
            plan = MemoryPlan(microbatches=choices)
            strategy.apply_plan(dataclasses.replace(strategy.plan, memory=plan.to_dict()))

    layers = 8
    batches = token_batches(4, batch_size=4, lengths=[5, 9, 7, 11])
    make = lambda: TinyGPT(layers=layers).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=MICROBATCHES, start_method=START_METHOD)
    callbacks = [RandomPlans(["1f1b", "zb_h1", "interleaved_1f1b", "gpipe"]), RandomMemoryPlans(), RecordMemory(tmp_path)]
    pipelined = fit(make, batches, strategy, devices=2, steps=4, callbacks=callbacks)
    reference = fit(make, reference_batches(batches, 1), steps=4)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    plans = [json.dumps(row["plan"], sort_keys=True) for row in _records(tmp_path)[0]]
    assert len(set(plans)) == 4  # a different memory plan every batch


def test_memory_planner_fits_a_budget_below_the_no_recompute_peak(tmp_path):
    """Long batches need recompute, short ones not; parameters equal; the measured peak stays under the budget."""
    batches = token_batches(3, batch_size=4, lengths=[16, 6, 16])
    budget, none_peak = _budget(batches[0])
    assert none_peak > budget
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    callbacks = [MemoryPlanner(budget=budget), RecordMemory(tmp_path), PipelineMonitor(log_every_n_steps=1)]
    pipelined = fit(make, batches, _strategy(), devices=2, steps=3, callbacks=callbacks, log_dir=tmp_path)
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    # the plans of batches 2 and 3 were solved on a lookahead thread while the batch before trained
    background = logged(tmp_path, "pipeline/plan_background_s")
    assert background[0] == 0.0 and all(b > 0 for b in background[1:])
    fractions, plan_s = logged(tmp_path, "pipeline/plan_fraction"), logged(tmp_path, "pipeline/time/plan_s")
    assert all(0 < f < 1 for f in fractions) and len(plan_s) == 3
    sync_s = logged(tmp_path, "pipeline/time/plan_sync_s")  # the plan's broadcast, apart from planning
    assert len(sync_s) == 3 and all(s > 0 for s in sync_s)
    records = _records(tmp_path)
    for rank in (0, 1):
        for row in records[rank]:
            assert row["boundaries"] == [0, 2, 4]
            assert row["static"] + row["measured"] <= budget  # accounted bytes within the budget
            assert row["predicted"] == pytest.approx(row["measured"], rel=0.10)
    long = [row for row in records[0] if row["none_peak"] > budget]
    short = [row for row in records[0] if row["none_peak"] <= budget]
    assert long and short
    assert min(_recomputed(row["plan"]) for row in long) > max(_recomputed(row["plan"]) for row in short) == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_predicted_saved_peak_matches_measured(tmp_path, schedule):
    """Within 10% per rank, for a step without recompute and one with full recompute."""

    class NoneThenFull(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            plan = MemoryPlan.from_options("full" if batch_idx % 2 else "none")
            trainer.strategy.apply_plan(dataclasses.replace(trainer.strategy.plan, memory=plan.to_dict()))

    batches = token_batches(2, batch_size=8, lengths=[24, 24])
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    fit(make, batches, _strategy(schedule), devices=2, steps=2, callbacks=[NoneThenFull(), RecordMemory(tmp_path, True, True)])
    records = _records(tmp_path)
    for rank in (0, 1):
        without, with_recompute = records[rank]
        assert _recomputed(with_recompute["plan"]) == 0  # counts of None mean "all blocks"
        assert with_recompute["plan"]["default"]["full"] is None and without["plan"]["default"]["full"] == 0
        assert with_recompute["measured"] < without["measured"] / 3
        for row in (without, with_recompute):
            assert row["predicted"] == pytest.approx(row["measured"], rel=0.10)


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv", "interleaved_1f1b"])
def test_split_backward_and_several_stages_per_rank_keep_what_the_model_predicts(tmp_path, schedule):
    """Split backward keeps a microbatch's saved activations from its forward to its W, on the last
    stage too (nothing the step returns or logs keeps the microbatch's graph, and with it what W does
    not visit, alive past W), and two stages per rank keep each stage's own: the measured peak per
    rank is the predicted one, within 10%."""
    batches = token_batches(2, batch_size=8, lengths=[24, 24])
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    fit(make, batches, _strategy(schedule), devices=2, steps=2, callbacks=[RecordMemory(tmp_path, True, True)])
    records = _records(tmp_path)
    for rank in (0, 1):
        for row in records[rank]:
            assert row["predicted"] == pytest.approx(row["measured"], rel=0.10)


def test_auto_plan_is_chosen_once_under_the_budget(tmp_path):
    """`recompute="auto"`: the first batch's fastest fitting plan, kept for every batch (a static plan)."""
    batches = token_batches(2, batch_size=4, lengths=[16, 16])
    budget, none_peak = _budget(batches[0])
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    strategy = _strategy(memory_budget=budget, recompute="auto")
    fit(make, batches, strategy, devices=2, steps=2, callbacks=[RecordMemory(tmp_path)])
    records = _records(tmp_path)
    for rank in (0, 1):
        first, second = records[rank]
        assert first["plan"] == second["plan"] and _recomputed(first["plan"]) > 0
        assert all(row["static"] + row["measured"] <= budget < none_peak for row in (first, second))


def test_optimizer_offload_keeps_parity_and_steps_stages_during_backward(tmp_path):
    """SPipe: host optimizers per stage (AdamW with a per-step learning-rate schedule), stepping as soon
    as a stage's gradients are final; two stages per rank, so one steps while the other is in backward."""

    class RecordSteps(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            strategy = trainer.strategy
            steps = strategy.memory.last_stage_steps
            user = trainer.optimizers[0]
            row = {
                "stages": sorted(steps),
                "first_launch": min(r.launched for r in steps.values()),
                "program_end": strategy.last_outcome.records[-1].end,
                "user_state": sum(1 for p in pl_module.parameters() if p.device.type != "meta" and user.state.get(p)),
                "host_state": sum(len(strategy.memory.stage_optimizers.host_optimizer(s).state) for s in steps),
            }
            with open(tmp_path / f"rank{strategy.layout.pipeline_rank}.txt", "a") as f:
                f.write(json.dumps(row) + "\n")

    batches = token_batches(3, batch_size=4, lengths=[7, 11, 9])
    make = lambda: ScheduledGPT(layers=8).double()  # noqa: E731
    strategy = _strategy("interleaved_1f1b", optimizer_offload=True)
    pipelined = fit(make, batches, strategy, devices=2, steps=3, callbacks=[RecordSteps()])
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    records = _records(tmp_path)
    assert sorted(records) == [0, 1] and all(len(rows) == 3 for rows in records.values())
    for rank, rows in records.items():
        for row in rows:
            assert len(row["stages"]) == 2 and row["first_launch"] < row["program_end"]  # overlapped backward
            assert row["user_state"] == 0 and row["host_state"] > 0


def test_static_arguments_are_checked():
    with pytest.raises(ValueError, match="recompute='auto'.*memory_budget"):
        ElasticPipelineStrategy(recompute="auto")
    with pytest.raises(ValueError, match="Cannot read the size"):
        ElasticPipelineStrategy(memory_budget="lots")
    with pytest.raises(ValueError, match="recompute='sometimes'"):
        ElasticPipelineStrategy(recompute="sometimes")
    strategy = ElasticPipelineStrategy(memory_budget="40GiB", recompute=2, offload=1, mlp_chunk_size=256)
    assert strategy.memory.budget == 40 * 2**30
    assert strategy.memory.static_plan.default == StageMemory(full=None, every=2, offload=1, mlp_chunk_size=256)
    fake_trainer = SimpleNamespace(accumulate_grad_batches=2, gradient_clip_val=1.0)
    fake = SimpleNamespace(  # a PipelineContext's fields that the check reads
        optimizers=lambda: [object()], module=SimpleNamespace(trainer=fake_trainer),
        layout=SimpleNamespace(data_parallel_size=2), current=lambda: SimpleNamespace(shared_parameters=()),
    )
    offloading = StrategyMemory(optimizer_offload=True)
    offloading._context = fake
    with pytest.raises(ValueError, match="optimizer_offload=True.*accumulate_grad_batches=2.*gradient_clip_val=1.0.*data parallel"):
        offloading._single_optimizer()
    memory = StrategyMemory(recompute="keep_attention")
    with pytest.raises(ValueError, match="zb_h1.*splits backward"):
        memory.install(PipelinePlan((0, 2, 4), "zb_h1", 4), resolve_schedule("zb_h1").build(2, 4))
