"""PipelineMonitor logs real measurements and draws the real step."""

from __future__ import annotations

import json

import pytest

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import PipelineMonitor
from lightning_pipe.callbacks.monitor import RankReport, measured_step
from lightning_pipe.schedules import F, TimedAction, B
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, fit, logged, token_batches


def test_measured_bubble_counts_receive_waits_as_idle():
    reports = [
        RankReport(0, [TimedAction(0, F(0, 0), 10.0, 11.0), TimedAction(0, B(0, 0), 13.0, 14.0)], 0, 0),
        RankReport(1, [TimedAction(1, F(1, 0), 11.0, 12.0), TimedAction(1, B(1, 0), 12.0, 13.0)], 0, 0),
    ]
    events, makespan, busy = measured_step(reports)
    assert makespan == 4.0 and busy == [2.0, 2.0]
    assert min(e.start for e in events) == 0.0


def test_monitor_logs_and_draws_a_real_run(tmp_path):
    batches = token_batches(4, batch_size=4, lengths=[9, 5, 13, 7])
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, schedule="1f1b", start_method=START_METHOD)
    monitor = PipelineMonitor(log_every_n_steps=1, timeline_every_n_steps=2)
    fit(lambda: TinyGPT(layers=4).double(), batches, strategy, devices=2, steps=4, log_dir=tmp_path, callbacks=[monitor])

    bubbles = logged(tmp_path, "pipeline/bubble_ratio")
    assert len(bubbles) == 4 and all(0.0 <= b < 1.0 for b in bubbles)
    assert all(t > 0 for t in logged(tmp_path, "pipeline/stage0_compute_s") + logged(tmp_path, "pipeline/stage1_compute_s"))
    assert all(t > 0 for t in logged(tmp_path, "pipeline/tokens_per_s"))
    assert logged(tmp_path, "pipeline/rank1_peak_memory_bytes")[0] > 0
    steps = [json.loads(line) for line in (tmp_path / "pipeline_steps.jsonl").read_text().splitlines()]
    assert [s["schedule"] for s in steps] == ["1f1b"] * 4 and steps[0]["boundaries"] == [0, 2, 4]
    pictures = sorted(p.name for p in tmp_path.glob("pipeline_timeline_step*.png"))
    assert pictures == ["pipeline_timeline_step2.png", "pipeline_timeline_step4.png"]
    assert (tmp_path / pictures[0]).stat().st_size > 10_000


def test_monitor_refuses_other_strategies():
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match="needs `strategy='elastic_pipe'`"):
        PipelineMonitor().setup(trainer, TinyGPT(), "fit")
