"""Every schedule family runs on real processes and trains exactly like a single process."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.schedules import ActionType, Instruction, register_instruction, unregister_instruction
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, reference_batches, token_batches

STEPS = 3


@pytest.mark.parametrize(
    ("schedule", "pp", "layers", "merge"),
    [
        ("interleaved_1f1b", 2, 4, True),  # 2 model chunks per rank, circular placement
        ("looped_bfs", 2, 4, True),
        ("zb_h1", 2, 4, True),  # split backward: I then W
        ("zbv", 2, 4, True),  # V placement: rank 0 runs the first and the last stage; pairs merged into B
        ("zbv", 2, 4, False),  # every pair split as the family writes it
        ("zb_h1", 4, 4, True),
    ],
)
def test_family_parity(tmp_path, schedule, pp, layers, merge):
    batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
    make = lambda: TinyGPT(layers=layers).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=pp, num_microbatches=4, schedule=schedule, merge_split_backward=merge,
        start_method=START_METHOD,
    )
    pipelined = fit(make, batches, strategy, devices=pp, steps=STEPS)
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)


def test_outcome_shared_before_the_step_ends_keeps_parity(tmp_path, monkeypatch):
    """ZB-V puts the last stage on rank 0, whose last backwards wait for rank 1: the step's loss, logs
    and gradient normalizer go out from there (runtime/side_task.py, forced right after the last
    stage's last forward here). Parameters and every logged loss equal one process's."""
    from lightning_pipe.runtime.outcome_channel import OutcomeChannel
    from lightning_pipe.runtime.side_task import SideTaskPlacer
    from tests.helpers.training import logged

    sent = tmp_path / "sent_early"
    send_early = OutcomeChannel.send_early

    def recorded(self, kind, root, payload):
        done = send_early(self, kind, root, payload)
        if done:
            with open(sent, "a") as f:
                f.write(f"{kind}\n")
        return done

    monkeypatch.setattr(OutcomeChannel, "send_early", recorded)
    monkeypatch.setattr(SideTaskPlacer, "point", lambda self, program: 0)  # as early as the outcome is known
    steps = 4
    batches = token_batches(steps, batch_size=4, lengths=[9, 5, 13, 7])
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, schedule="zbv", start_method=START_METHOD)
    pipelined = fit(make, batches, strategy, devices=2, steps=steps, log_dir=tmp_path / "pipe")
    reference = fit(make, reference_batches(batches, 1), steps=steps, log_dir=tmp_path / "ref")
    assert_same_parameters(pipelined, reference, atol=1e-10)
    torch.testing.assert_close(logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss"))
    assert sent.read_text().split() == ["training_step"] * (steps - 1)  # the first step sends its schema pickled


def test_a_failing_early_outcome_raises_after_the_program():
    """An exception in the last stage's side task (here its payload) does not leave the program half
    run, with the other ranks waiting for its remaining actions: it is kept and raised where the step
    raised it before, at the outcome's share, ahead of any broadcast."""
    from lightning_pipe.strategies.elastic_pipeline import _EarlyOutcome

    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4)

    def failing(*args):
        raise RuntimeError("payload bug")

    strategy._outcome_payload = failing
    early = _EarlyOutcome()
    strategy._send_outcome_early("training_step", None, None, [], True, None, early)  # does not raise
    assert isinstance(early.error, RuntimeError) and early.sent is False
    with pytest.raises(RuntimeError, match="payload bug"):
        strategy._share_outcome("training_step", None, None, [], True, None, early)


def test_switching_family_mid_training_keeps_parity(tmp_path):
    """1F1B, then ZB-V (two stages per rank: units migrate), then GPipe."""
    from lightning_pipe.callbacks import ScheduleSwitch
    from tests.helpers.callbacks import RecordPlans, read_plans

    batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    switch = ScheduleSwitch({0: "1f1b", 1: "zbv", 2: "gpipe"})
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, start_method=START_METHOD)
    record = RecordPlans(str(tmp_path / "plans.jsonl"))
    pipelined = fit(make, batches, strategy, devices=2, steps=STEPS, callbacks=[switch, record])
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    plans = read_plans(tmp_path / "plans.jsonl")
    assert [p["schedule"] for p in plans] == ["1f1b", "zbv", "gpipe"]
    assert [len(p["boundaries"]) - 1 for p in plans] == [2, 4, 2]


def test_schedule_switch_rejects_bad_rules():
    from lightning_pipe.callbacks import ScheduleSwitch

    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        ScheduleSwitch({0: "nope"})
    with pytest.raises(ValueError, match="unit='hour'"):
        ScheduleSwitch({0: "1f1b"}, unit="hour")


@pytest.mark.parametrize(
    "spec",
    [
        "placement=circular stages_per_rank=2 priority=backward_first traversal=depth_first max_in_flight=4",
        {"preset": "v_zb"},  # DSL-only V-shape zero bubble, dict form as in a YAML config
    ],
    ids=["circular-depth-first", "v_zb-dict"],
)
def test_dsl_schedule_parity(spec):
    batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, schedule=spec, start_method=START_METHOD)
    assert strategy.schedule.stages_per_rank == 2
    pipelined = fit(make, batches, strategy, devices=2, steps=STEPS)
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)


def test_a_registered_instruction_runs_where_the_schedule_places_it(tmp_path):
    """FlexPipe's user instructions run on the rank, after their anchor action, results unchanged."""
    register_instruction(
        Instruction("MARK", "tests.helpers.instructions:record", after=ActionType.BACKWARD, stages=None, every=2,
                    attributes={"dir": str(tmp_path)}),
        overwrite=True,
    )
    try:
        batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
        make = lambda: TinyGPT(layers=4).double()  # noqa: E731
        strategy = ElasticPipelineStrategy(
            pipeline_parallel_size=2, num_microbatches=4, schedule="1f1b instructions=MARK", start_method=START_METHOD
        )
        pipelined = fit(make, batches, strategy, devices=2, steps=STEPS)
    finally:
        unregister_instruction("MARK")
    reference = fit(make, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    for rank in (0, 1):  # after the backward of microbatches 1 and 3 of the rank's stage, every step
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == [["MARK", rank, 1], ["MARK", rank, 3]] * STEPS


@pytest.mark.parametrize(("merge", "model"), [("measured", "llama"), (True, "gpt")])
def test_merges_decided_again_on_measured_times_keep_parity(tmp_path, monkeypatch, merge, model):
    """After a few timed steps the pipeline agrees on each stage's measured seconds (one all-reduce) and
    installs ZB-V again with its pairs merged as those costs say (runtime/merge_tuning.py). The agreed
    seconds are replaced here by a benchmark's (after the real all-reduce), under which the decision
    differs from the uniform one, so the steps after it run another program; parameters equal one
    process's all the same, on transformers' Llama with right padding and -100 labels (microbatches cut to
    their own lengths, token-averaged loss). With ``merge_split_backward=True`` (the default) the uniform
    decision stays: nothing is timed or agreed."""
    from lightning_pipe.runtime.merge_tuning import MergeTuning, StageSeconds
    from lightning_pipe.schedules import merged_program, resolve_schedule

    log = tmp_path / "tuned"
    agree, measured_merge = MergeTuning.agree, ElasticPipelineStrategy._measured_merge
    benchmark = StageSeconds(  # the benchmark GPT's stages (tests/schedules/test_backward_merging.py)
        {0: 7.78, 1: 4.37, 2: 10.92, 3: 9.96}, {0: 12.16, 1: 5.3, 2: 15.94, 3: 13.43},
        {1: 4.36, 2: 12.04, 3: 8.79}, {1: 1.99, 2: 5.59, 3: 4.32},
    )

    def agree_then_use_the_benchmarks(self, num_stages, group):
        measured = agree(self, num_stages, group)
        assert set(measured.forward) == set(range(num_stages))  # every stage's forward came through the reduce
        self.seconds = benchmark
        return benchmark

    def logged_merge(self, schedule, num_microbatches, seconds, default):
        program = measured_merge(self, schedule, num_microbatches, seconds, default)
        with open(log, "a") as f:
            f.write(f"{int(program != merged_program(resolve_schedule('zbv'), 2, num_microbatches))}\n")
        return program

    monkeypatch.setattr(MergeTuning, "agree", agree_then_use_the_benchmarks)
    monkeypatch.setattr(ElasticPipelineStrategy, "_measured_merge", logged_merge)
    steps = 8  # 2 not timed, 3 timed, then 3 steps with the program decided on the agreed seconds
    lengths = [9, 5, 13, 7, 9, 11, 6, 8]
    atol = 1e-10
    if model == "llama":
        pytest.importorskip("transformers")
        from tests.helpers.hf_models import HFCausalLM, lm_batches

        batches = lm_batches(steps, batch_size=4, lengths=lengths, padding="variable")
        make = lambda: HFCausalLM("llama", layers=4).double()  # noqa: E731
        atol = 1e-7  # its loss is float32 inside a float64 model (tests/strategies/test_real_models.py, HF_ATOL)
    else:
        batches = token_batches(steps, batch_size=4, lengths=lengths)
        make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule="zbv", merge_split_backward=merge, start_method=START_METHOD
    )
    pipelined = fit(make, batches, strategy, devices=2, steps=steps)
    reference = fit(make, reference_batches(batches, 1), steps=steps)
    assert_same_parameters(pipelined, reference, atol=atol)
    if merge == "measured":  # on both ranks, once, a program other than the uniform decision
        assert log.read_text().split() == ["1", "1"]
    else:
        assert not log.exists()
