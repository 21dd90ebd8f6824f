"""What the strategy's helpers read of it, typed: a frozen context instead of a back-pointer.

:class:`~lightning_pipe.strategies.memory.StrategyMemory` and
:class:`~lightning_pipe.strategies.costs.StrategyCosts` used to hold the whole strategy and read
about fifty of its attributes. They now receive a :class:`PipelineContext`, built once after
sharding: the handles that stay fixed for the run (rank layout, process groups, stage runner,
device, module) as fields, and what a new plan replaces (program, stage spans, boundaries, unit
layout, shared parameters) through :meth:`PipelineContext.current`, which returns a
:class:`PipelineState` snapshot of the plan in force. The strategy's Lightning services the helpers
need (batch split, broadcast, step context) are passed as plain functions. Nothing here imports
Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.model.stage_runner import StageRunner, StageSpan
from lightning_pipe.model.units import UnitLayout
from lightning_pipe.runtime.groups import ProcessGroups, RankLayout
from lightning_pipe.runtime.microbatch import SplitBatch
from lightning_pipe.schedules import Program, Schedule

__all__ = ["PipelineContext", "PipelineState"]


@dataclass(frozen=True)
class PipelineState:
    """The plan in force on this rank (replaced, never changed, when a new plan is installed).

    Attributes:
        schedule: the schedule family and its options.
        program: every rank's actions for one step.
        boundaries: block boundaries of every stage, ``[0, ..., num_blocks]``.
        spans: this rank's stages, by global stage index.
        unit_layout: units and the tensors of each (it changes when the first step is observed).
        num_microbatches: microbatches per batch.
        shared_parameters: real parameters of this rank that other pipeline ranks hold copies of
            (tied weights: their gradients are summed after the pipeline).
    """

    schedule: Schedule
    program: Program
    boundaries: tuple[int, ...]
    spans: dict[int, StageSpan]
    unit_layout: UnitLayout
    num_microbatches: int
    shared_parameters: tuple[Tensor, ...]


@dataclass(frozen=True)
class PipelineContext:
    """Fixed handles of one rank's pipeline, and functions for what changes (see the module docstring).

    Attributes:
        layout: this process's place in the pipeline x data-parallel grid.
        groups: the process groups (pipeline, data parallel).
        runner: the stage runner (block stack, stage execution).
        device: this rank's device.
        module: the user's module (units this rank does not hold are on the meta device).
        world_size: number of processes.
        global_rank: this process's rank.
        current: the plan in force now.
        optimizers: the optimizers (Lightning sets them after setup).
        split_batch: the strategy's microbatch plan of a batch (cut once per batch); optionally by
            a draft plan's microbatching (``split_batch(batch, plan)``).
        program_for_plan: the validated training program of a plan's family and microbatch count.
        train_step_context: the precision plugin's context for a training step.
        broadcast: ``broadcast(obj, src)`` over every process.
        gather_from_pipeline: one object per pipeline rank on global rank 0 (None elsewhere).
    """

    layout: RankLayout
    groups: ProcessGroups
    runner: StageRunner
    device: torch.device
    module: nn.Module
    world_size: int
    global_rank: int
    current: Callable[[], PipelineState]
    optimizers: Callable[[], list[Any]]
    split_batch: Callable[..., SplitBatch]
    program_for_plan: Callable[[Any], Program]
    train_step_context: Callable[[], AbstractContextManager]
    broadcast: Callable[[Any, int], Any]
    gather_from_pipeline: Callable[[Any], list[Any] | None]

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline ranks per replica."""
        return self.layout.pipeline_parallel_size
