"""``PipelineMonitor``: what the pipeline really did, per step, through Lightning's loggers.

Every rank times its actions (``runtime.executor``); every logged step the monitor gathers the
timings, memory and plan of every pipeline rank on global rank 0 and logs:

* ``pipeline/tokens_per_s``, ``pipeline/step_s``: throughput and wall time of the step,
* ``pipeline/bubble_ratio``: idle share of the step measured from per-rank busy time (time blocked
  in receives is idle, not busy),
* ``pipeline/simulated_bubble_ratio``: the bubble the simulator predicts for the same program with
  this step's measured compute times and message latency (:func:`measured_latency`); the difference
  to the measured one is what the schedule and a constant latency do not explain (variable waits,
  framework time between actions); under elastic depth the program is the layout's, one action
  list per device (the all-reduce of a stage's replicas is not simulated),
* ``pipeline/stage{s}_compute_s``: compute time of every stage,
* ``pipeline/compute/{kind}_s``: compute time of each kind of action (``F``, ``B``, and for
  zero-bubble families ``I`` and ``W``) summed over the pipeline's ranks: what a split backward
  costs (``I + W``) against the ``B`` of a family that does not split (pairs the strategy merged into
  one backward, ``merge_split_backward``, are counted as ``B``),
* ``pipeline/time/{part}_s``: where the first rank's step went (they sum to ``step_s``): its
  ``compute`` actions, blocked in receives (``wait``), posting sends (``send``),
  ``between_actions`` (the executor's own work), and outside the program the strategy's measured
  parts (``runtime.StepClock``): ``plan`` (planner callbacks' work on the critical path),
  ``plan_sync`` (waiting at the collective that hands one rank's plan to the others: mostly the
  ranks arriving at different times, which the step's first transfer would otherwise absorb), ``apply``
  (merging their proposals and installing the plan, migrations included), ``data`` (the next batch
  fetched early for a planner's lookahead), ``prepare``
  (splitting the batch, the step's checks), ``share_outcome`` (the loss and log broadcast, their
  replay, gradient normalization), ``gradient_sync``, ``optimizer``, and ``outside_program``, the
  rest (Lightning's loop and hooks, callbacks),
* ``pipeline/plan_fraction``: ``time/plan_s`` over ``step_s`` (the goal: under 2%), and
  ``pipeline/plan_background_s``: planning done for this step on lookahead threads while the step
  before ran (hidden, unless it competes for the same cores),
* ``pipeline/rank{r}_peak_memory_bytes``: peak memory per rank (CUDA allocator peak, or the process's
  resident-set peak on CPU),
* ``pipeline/num_stages``, ``pipeline/num_microbatches``, ``pipeline/boundary{k}``, ``pipeline/width{k}``
  (elastic depth: replicas of stage ``k``),
  ``pipeline/migrated_bytes`` when units moved,
* ``pipeline/recomputed_blocks``, ``pipeline/offloaded_blocks``: block runs of the step under
  recomputation (full or keep-attention) and activation offload, summed over stages and
  microbatches (the memory plan's summary; zero without one).

Every ``timeline_every_n_steps`` it draws the real step as a Gantt chart (the same renderer as
simulated schedules), saves the PNG in the log directory and sends it to TensorBoard; with
``simulated_beside`` the simulation of the same program with the step's measured compute times is
drawn under it (the difference is communication and waiting). At the end of ``fit`` it prints a
summary table and, when the partition changed, draws the partitions over the logged steps
(``pipeline_partitions.png``) and, under elastic depth when the layout changed, the stages and
their widths over the logged steps (``pipeline_layouts.png``). ``history`` keeps one row per logged step (schedule, partition),
also written to ``pipeline_steps.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import statistics
import sys
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

from lightning_pipe.schedules import ActionCosts, ActionType, TimedAction, simulate

if TYPE_CHECKING:
    from lightning_pipe.strategies import PipelineStrategy

log = logging.getLogger(__name__)

_COMPUTE = {ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT}
_SENDS = {ActionType.SEND_F, ActionType.SEND_B}


@dataclass
class RankReport:
    """What one pipeline rank measured in one step (sent to rank 0)."""

    pipeline_rank: int
    events: list[TimedAction]
    peak_memory_bytes: int
    migrated_bytes: int


@dataclass
class StepSummary:
    """One logged step, as the monitor saw it."""

    step: int
    schedule: str
    boundaries: list[int]
    num_microbatches: int
    tokens_per_s: float
    step_s: float
    bubble_ratio: float
    simulated_bubble_ratio: float = 0.0
    time_s: dict[str, float] = field(default_factory=dict)
    plan_background_s: float = 0.0
    stage_compute_s: dict[int, float] = field(default_factory=dict)
    kind_compute_s: dict[str, float] = field(default_factory=dict)  # per action kind (F, B, I, W), all ranks
    migrated_bytes: int = 0
    recomputed_blocks: int = 0
    offloaded_blocks: int = 0
    widths: list[int] | None = None  # elastic depth: replicas of every stage (None: one per stage)


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _tokens(batch: Any) -> int:
    """Token count of a batch: elements of its first tensor with a batch dimension."""
    tensor = _first_batched_tensor(batch)
    return 0 if tensor is None else int(tensor.numel())


def _first_batched_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor with a dimension, walking the containers torch's pytree walks (dicts, lists,
    tuples, named tuples, deques) in its order, without its private module."""
    if isinstance(tree, torch.Tensor):
        return tree if tree.dim() > 0 else None
    if type(tree) in (dict, OrderedDict, defaultdict):
        children: Any = tree.values()
    elif type(tree) in (list, tuple, deque) or (isinstance(tree, tuple) and hasattr(type(tree), "_fields")):
        children = tree
    else:
        return None
    for child in children:
        found = _first_batched_tensor(child)
        if found is not None:
            return found
    return None


def _memory_plan_counts(strategy: PipelineStrategy) -> tuple[int, int]:
    """Block runs of one step under recomputation and under activation offload, by the memory plan."""
    memory = getattr(strategy, "memory", None)
    if memory is None or memory.plan.is_empty:
        return 0, 0
    from lightning_pipe.planning.memory_model import FULL, KEEP_ATTENTION, OFFLOAD

    recomputed = offloaded = 0
    bounds = strategy.boundaries
    for stage in range(len(bounds) - 1):
        for microbatch in range(strategy.num_microbatches):
            modes = memory.plan.choice(stage, microbatch).block_modes(bounds[stage + 1] - bounds[stage])
            recomputed += sum(mode in (FULL, KEEP_ATTENTION) for mode in modes)
            offloaded += sum(mode == OFFLOAD for mode in modes)
    return recomputed, offloaded


def measured_costs(events: list[TimedAction], program: Any) -> ActionCosts:
    """Per-action costs of ``program`` from one measured step: every compute action's own duration.

    Communication is free in the result, so simulating it shows what the step would take if only
    compute and the schedule's dependencies mattered. Actions the step did not run cost zero.
    """
    tables: dict[ActionType, list[list[float]]] = {
        kind: [[0.0] * program.num_microbatches for _ in range(program.num_stages)] for kind in _COMPUTE
    }
    for e in events:
        if e.action.type in _COMPUTE:
            tables[e.action.type][e.action.stage][e.action.microbatch] = e.duration

    def frozen(kind: ActionType) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(row) for row in tables[kind])

    split = any(e.action.type == ActionType.BACKWARD_INPUT for e in events)
    return ActionCosts(
        forward=frozen(ActionType.FORWARD),
        backward=frozen(ActionType.BACKWARD),
        backward_input=frozen(ActionType.BACKWARD_INPUT) if split else None,
        backward_weight=frozen(ActionType.BACKWARD_WEIGHT) if split else None,
    )


def measured_latency(events: list[TimedAction]) -> float:
    """Seconds a message takes between ranks in one measured step.

    Where a consumer had to wait for its message, the executor recorded when it arrived
    (``TimedAction.arrival``): arrival minus the send's start is that message's latency, and the
    step's latency is the median over those messages. A consumer that did not wait had its message
    already, so consumer start minus send start only bounds the latency from above; without any
    waited message (simulated events, which start when their message arrives) the step's latency is
    the tightest of these bounds, the minimum (0 without messages).

    (Before arrivals were recorded, the minimum bound was used for real steps too. A real ``F``
    starts before its receive, running the code before its first block, so that bound was often
    zero, and the simulator saw free messages: it explained interleaved 1F1B, which sends twice as
    many messages, least well.)
    """
    sends = {(e.action.stage, e.action.microbatch, e.action.type): e for e in events if e.action.type in _SENDS}
    exact, bounds = [], []
    for e in events:
        kind = e.action.type
        if kind is ActionType.FORWARD:
            send = sends.get((e.action.stage - 1, e.action.microbatch, ActionType.SEND_F))
        elif kind in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT):
            send = sends.get((e.action.stage + 1, e.action.microbatch, ActionType.SEND_B))
        else:
            continue
        if send is None or send.rank == e.rank:
            continue
        if e.arrival is not None:
            exact.append(max(0.0, e.arrival - send.start))
        else:
            bounds.append(max(0.0, e.start - send.start))
    if exact:
        return statistics.median(exact)
    return min(bounds) if bounds else 0.0


def simulate_measured(events: list[TimedAction], program: Any):
    """The simulation of ``program`` with one measured step's compute times and message latency."""
    return simulate(program, dataclasses.replace(measured_costs(events, program), latency=measured_latency(events)))


def step_breakdown(
    records: list, step_s: float, parts: dict[str, float] | None = None, inside: float = 0.0
) -> dict[str, float]:
    """Where one rank's step went, from its action records: compute, receive waits, sends, the
    executor's time between actions, and everything outside the program (sums to ``step_s``).

    ``parts``: the strategy's measured parts (``StepClock``); each becomes its own entry, and
    ``outside_program`` keeps the rest (Lightning's loop and hooks, callbacks). ``inside``: seconds of
    those parts spent between the program's actions (the step's outcome as a side task,
    ``runtime/side_task.py``), not counted again in ``between_actions``.
    """
    parts = {name: max(0.0, seconds) for name, seconds in (parts or {}).items()}
    if not records:
        return {**parts, "outside_program": max(0.0, step_s - sum(parts.values()))}
    compute = sum(r.end - r.start - r.wait for r in records if r.action.type in _COMPUTE)
    wait = sum(r.wait for r in records)
    send = sum(r.end - r.start for r in records if r.action.type in _SENDS)
    span = max(r.end for r in records) - min(r.start for r in records)
    return {
        "compute": compute,
        "wait": wait,
        "send": send,
        "between_actions": max(0.0, span - compute - wait - send - inside),
        **parts,
        "outside_program": max(0.0, step_s - span - sum(parts.values()) + inside),
    }


def _stack_images(paths: list[str], target: str) -> None:
    """Stack PNGs vertically on a white background (the measured step over its simulation)."""
    import matplotlib.image
    import numpy as np

    images = [matplotlib.image.imread(p)[..., :3] for p in paths]
    width = max(image.shape[1] for image in images)
    padded = [np.pad(i, ((0, 0), (0, width - i.shape[1]), (0, 0)), constant_values=1.0) for i in images]
    matplotlib.image.imsave(target, np.concatenate(padded, axis=0))


def measured_step(reports: list[RankReport]) -> tuple[list[TimedAction], float, list[float]]:
    """Events of all ranks on one clock starting at 0, the makespan, and per-rank busy seconds."""
    events = [e for report in reports for e in report.events]
    if not events:
        return [], 0.0, [0.0] * len(reports)
    origin = min(e.start for e in events)
    shifted = [
        TimedAction(e.rank, e.action, e.start - origin, e.end - origin, None if e.arrival is None else e.arrival - origin)
        for e in events
    ]
    makespan = max(e.end for e in shifted)
    busy = [0.0] * len(reports)
    for e in shifted:
        if e.action.type in _COMPUTE:
            busy[e.rank] += e.duration
    return shifted, makespan, busy


class PipelineMonitor(L.Callback):
    """Log what the pipeline did each step; draw real timelines; summarize at the end.

    Args:
        log_every_n_steps: log every this many optimizer steps (None: the Trainer's setting).
        timeline_every_n_steps: draw the real step's timeline every this many steps (0: never).
        timeline_dir: where the PNGs go (None: the first logger's directory, else ``default_root_dir``).
        simulated_beside: draw the simulated step of the same program, with the measured compute
            times, under every real timeline.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        timeline_every_n_steps: int = 50,
        timeline_dir: str | None = None,
        simulated_beside: bool = False,
    ) -> None:
        if timeline_every_n_steps < 0:
            raise ValueError(f"`timeline_every_n_steps` must be >= 0, got {timeline_every_n_steps}.")
        self.log_every_n_steps = log_every_n_steps
        self.timeline_every_n_steps = timeline_every_n_steps
        self.timeline_dir = timeline_dir
        self.simulated_beside = simulated_beside
        self.partitions_picture: str | None = None
        self.layouts_picture: str | None = None  # elastic depth: stages and widths over steps
        self.history: list[StepSummary] = []
        self.timelines: list[str] = []
        self._migrated = 0

    def _strategy(self, trainer: L.Trainer) -> PipelineStrategy:
        from lightning_pipe.strategies import ElasticPipelineStrategy

        if not isinstance(trainer.strategy, ElasticPipelineStrategy):
            raise TypeError(
                f"`PipelineMonitor` needs `strategy='elastic_pipe'`, the Trainer runs {type(trainer.strategy).__name__}."
            )
        return trainer.strategy

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Fail early when the Trainer does not run the pipeline strategy."""
        self._strategy(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Gather this step's measurements on rank 0 and log them."""
        strategy = self._strategy(trainer)
        migration = strategy.last_migration
        if migration is not None:
            self._migrated += migration.bytes_sent
            strategy.last_migration = None
        step = trainer.global_step
        every = self.log_every_n_steps or trainer.log_every_n_steps
        draw = self.timeline_every_n_steps and step % self.timeline_every_n_steps == 0
        if step % every and not draw:
            return
        step_s = time.perf_counter() - strategy.step_clock.started  # from the batch's move, planners included
        outcome = strategy.last_outcome
        offset = time.time() - time.perf_counter()  # one clock for all ranks, also across nodes
        rank = strategy.layout.pipeline_rank
        events = [
            TimedAction(
                rank, r.action, r.start + r.wait + offset, r.end + offset, None if r.arrival is None else r.arrival + offset
            )
            for r in (outcome.records if outcome else [])
        ]
        report = RankReport(rank, events, _peak_memory_bytes(strategy.root_device), self._migrated)
        self._migrated = 0
        reports = strategy.gather_from_pipeline(report)
        if trainer.global_rank != 0 or reports is None:
            return
        summary = self._summarize(strategy, reports, step, step_s, _tokens(batch) * strategy.layout.data_parallel_size)
        summary.time_s = step_breakdown(
            outcome.records if outcome else [], step_s, dict(strategy.step_clock.parts),
            getattr(outcome, "side_task_s", 0.0),
        )
        summary.plan_background_s = strategy.step_clock.background.get("plan", 0.0)
        self.history.append(summary)
        metrics = {
            "pipeline/tokens_per_s": summary.tokens_per_s,
            "pipeline/step_s": summary.step_s,
            "pipeline/bubble_ratio": summary.bubble_ratio,
            "pipeline/simulated_bubble_ratio": summary.simulated_bubble_ratio,
            "pipeline/num_stages": float(len(summary.boundaries) - 1),
            "pipeline/num_microbatches": float(summary.num_microbatches),
            "pipeline/migrated_bytes": float(summary.migrated_bytes),
            "pipeline/recomputed_blocks": float(summary.recomputed_blocks),
            "pipeline/plan_fraction": summary.time_s.get("plan", 0.0) / max(summary.step_s, 1e-12),
            "pipeline/plan_background_s": summary.plan_background_s,
            "pipeline/offloaded_blocks": float(summary.offloaded_blocks),
        }
        metrics.update({f"pipeline/stage{s}_compute_s": t for s, t in summary.stage_compute_s.items()})
        metrics.update({f"pipeline/compute/{kind}_s": t for kind, t in summary.kind_compute_s.items()})
        metrics.update({f"pipeline/time/{part}_s": t for part, t in summary.time_s.items()})
        metrics.update({f"pipeline/boundary{k}": float(b) for k, b in enumerate(summary.boundaries)})
        metrics.update({f"pipeline/width{k}": float(w) for k, w in enumerate(summary.widths or ())})
        metrics.update({f"pipeline/rank{r.pipeline_rank}_peak_memory_bytes": float(r.peak_memory_bytes) for r in reports})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        self._write_plan_history(trainer, summary)
        if draw:
            self._draw(trainer, strategy, reports, step)

    def _summarize(self, strategy: PipelineStrategy, reports: list[RankReport], step: int, step_s: float, tokens: int) -> StepSummary:
        events, makespan, busy = measured_step(reports)
        stage_compute: dict[int, float] = {}
        kind_compute: dict[str, float] = {}
        for e in events:
            if e.action.type in _COMPUTE:
                stage_compute[e.action.stage] = stage_compute.get(e.action.stage, 0.0) + e.duration
                kind_compute[e.action.type.value] = kind_compute.get(e.action.type.value, 0.0) + e.duration
        bubble = 1.0 - sum(busy) / (len(busy) * makespan) if makespan > 0 else 0.0
        layout_widths = getattr(strategy.program, "widths", None)  # a LayoutProgram: one action list per device
        simulated = simulate_measured(events, strategy.program) if events else None
        recomputed, offloaded = _memory_plan_counts(strategy)
        return StepSummary(
            step=step,
            schedule=strategy.schedule.name,
            boundaries=list(strategy.boundaries),
            num_microbatches=strategy.num_microbatches,
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            step_s=step_s,
            bubble_ratio=bubble,
            simulated_bubble_ratio=simulated.bubble_ratio if simulated is not None else 0.0,
            stage_compute_s=dict(sorted(stage_compute.items())),
            kind_compute_s=kind_compute,
            migrated_bytes=sum(r.migrated_bytes for r in reports),
            recomputed_blocks=recomputed,
            offloaded_blocks=offloaded,
            widths=list(layout_widths) if layout_widths else None,
        )

    def _directory(self, trainer: L.Trainer) -> str:
        if self.timeline_dir:
            directory = self.timeline_dir
        elif trainer.loggers and trainer.loggers[0].log_dir:
            directory = trainer.loggers[0].log_dir
        else:
            directory = trainer.default_root_dir
        os.makedirs(directory, exist_ok=True)
        return directory

    def _write_plan_history(self, trainer: L.Trainer, summary: StepSummary) -> None:
        with open(os.path.join(self._directory(trainer), "pipeline_steps.jsonl"), "a") as f:
            f.write(json.dumps(asdict(summary)) + "\n")

    def _draw(self, trainer: L.Trainer, strategy: PipelineStrategy, reports: list[RankReport], step: int) -> None:
        from lightning_pipe.schedules.render import render_png

        events, makespan, busy = measured_step(reports)
        bubble = 1.0 - sum(busy) / (len(busy) * makespan) if makespan > 0 else 0.0
        path = os.path.join(self._directory(trainer), f"pipeline_timeline_step{step}.png")
        render_png(events, path, title=f"measured step {step} (bubble {bubble:.2f})")
        if self.simulated_beside:
            simulated = simulate_measured(events, strategy.program)
            beside = path.replace(".png", "_simulated.png")
            render_png(
                simulated, beside,
                title=f"simulated, measured compute times (bubble {simulated.bubble_ratio:.2f})",
            )
            _stack_images([path, beside], path)
            os.remove(beside)
        self.timelines.append(path)
        self._send_image(trainer, "pipeline/timeline", path, step)

    def _send_image(self, trainer: L.Trainer, tag: str, path: str, step: int) -> None:
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                import matplotlib.image

                image = matplotlib.image.imread(path)
                experiment.add_image(tag, image[..., :3], global_step=step, dataformats="HWC")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Print the run's summary table on rank 0; draw the partitions if they changed."""
        if trainer.global_rank != 0 or not self.history:
            return
        if len({tuple(r.boundaries) for r in self.history}) > 1:
            from lightning_pipe.planning.render import plot_partitions

            path = os.path.join(self._directory(trainer), "pipeline_partitions.png")
            plot_partitions(
                [r.step for r in self.history], [r.boundaries for r in self.history], path,
                values=[r.step_s for r in self.history], value_label="step time (s)",
                title="partitions over the logged steps",
            )
            self.partitions_picture = path
            self._send_image(trainer, "pipeline/partitions", path, self.history[-1].step)
        if any(r.widths for r in self.history) and len({(tuple(r.boundaries), tuple(r.widths or ())) for r in self.history}) > 1:
            from lightning_pipe.planning.render import plot_layouts

            path = os.path.join(self._directory(trainer), "pipeline_layouts.png")
            widths = [r.widths or [1] * (len(r.boundaries) - 1) for r in self.history]
            plot_layouts(  # one column per logged batch (with accumulation, several share a step)
                list(range(len(self.history))), [r.boundaries for r in self.history], widths, path,
                step_label="logged batch", title="stages and widths over the logged batches",
            )
            self.layouts_picture = path
            self._send_image(trainer, "pipeline/layouts", path, self.history[-1].step)
        from rich.console import Console
        from rich.table import Table

        rows = self.history[1:] or self.history  # the first step includes warm-up
        table = Table(title="lightning-pipe: pipeline summary")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_row("logged steps", str(len(self.history)))
        table.add_row("tokens/s (mean)", f"{sum(r.tokens_per_s for r in rows) / len(rows):,.0f}")
        table.add_row("bubble ratio (mean)", f"{sum(r.bubble_ratio for r in rows) / len(rows):.3f}")
        table.add_row("simulated bubble (mean)", f"{sum(r.simulated_bubble_ratio for r in rows) / len(rows):.3f}")
        stages = sorted({s for r in rows for s in r.stage_compute_s})
        for s in stages:
            mean = sum(r.stage_compute_s.get(s, 0.0) for r in rows) / len(rows)
            table.add_row(f"stage {s} compute s/step", f"{mean:.4f}")
        for part in rows[0].time_s:
            mean = sum(r.time_s.get(part, 0.0) for r in rows) / len(rows)
            table.add_row(f"rank 0 {part.replace('_', ' ')} s/step", f"{mean:.4f}")
        if any(r.recomputed_blocks or r.offloaded_blocks for r in rows):
            table.add_row("recomputed blocks/step (mean)", f"{sum(r.recomputed_blocks for r in rows) / len(rows):.1f}")
            table.add_row("offloaded blocks/step (mean)", f"{sum(r.offloaded_blocks for r in rows) / len(rows):.1f}")
        changes = sum(1 for a, b in zip(self.history, self.history[1:]) if a.boundaries != b.boundaries)
        table.add_row("repartitions seen", str(changes))
        table.add_row("schedules seen", ", ".join(dict.fromkeys(r.schedule for r in self.history)))
        Console(file=sys.stdout).print(table)
