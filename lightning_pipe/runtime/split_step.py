"""One training step of a split-placement program (HelixPipe, SPipe) around the user's own step.

:class:`~lightning_pipe.runtime.split_executor.SplitPlacementExecutor` moves values and runs autograd;
the stages (``runtime/helix.StepHelixStages``, ``runtime/spipe.StepSPipeStages``) run pieces of the
user's unchanged step through the :class:`~lightning_pipe.model.StageRunner`. This module adds what the
strategy's step needs from the last stage, as :class:`~lightning_pipe.runtime.StepOutcome` (the form
``PipelineExecutor`` gives it): the loss, the step's output, its ``self.log`` calls, its loss record
(what the loss was computed from, for token-averaged weights) and the weight decided from it.

The last stage may run twice for one microbatch: its ``F`` without autograd when the program
recomputes it (SPipe always; HelixPipe with recomputation), then its ``RECOMPUTE`` with autograd on the
rank of its backward. Only the run with autograd counts: it records the outcome and updates metrics;
the run without autograd is made inert (metric updates skipped, logs dropped), so a metric or a logged
value is never counted twice. That rank is the stage's owner (``Program.rank_of``), checked by
:func:`check_last_stage`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.loss_counting import LossCounter
from lightning_pipe.model.metrics import metrics_inert
from lightning_pipe.model.stage_runner import StageResult
from lightning_pipe.runtime.executor import StepOutcome
from lightning_pipe.runtime.split_executor import SplitPlacementExecutor
from lightning_pipe.schedules.ir import Program

__all__ = ["LastStageRecorder", "check_last_stage", "run_split_step"]


def check_last_stage(program: Program) -> int:
    """The rank where every microbatch's last stage runs with autograd (its backward rank).

    Raises:
        ValueError: the backward of the last stage moves between ranks (the step's outcome would be
            spread over ranks, which the strategy's broadcast from one rank does not gather).
    """
    last = program.num_stages - 1
    ranks = {program.backward_rank(last, mb) for mb in range(program.num_microbatches)}
    if ranks != {program.rank_of(last)}:
        raise ValueError(
            f"program {program.name!r} runs the last stage's backward on ranks {sorted(ranks)}, not only on its owner "
            f"{program.rank_of(last)}: the step's loss and logs must come from one rank"
        )
    return program.rank_of(last)


class LastStageRecorder:
    """Runs the last stage's user step and records the outcome of the run that builds autograd.

    Args:
        module: the user's module (its metrics are made inert in a run without autograd).
        microbatches: the step's arguments per microbatch (identified by object, as the executor
            hands them to the stages).
        loss_weight: given (microbatch index, loss record), the factor its loss gets before backward
            (token-averaged losses: the counted targets); None: none.
        loss: picks the loss from what the step returns.
        train: False for an evaluation step (forwards only, without autograd): every run records, and
            the step's output need not be a loss.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        microbatches: Sequence[Any],
        loss_weight: Callable[[int, Any], Any] | None,
        loss: Callable[[Any], Tensor],
        train: bool = True,
    ) -> None:
        self.module = module
        self.train = train
        self.index = {id(mb): i for i, mb in enumerate(microbatches)}
        self.loss_weight = loss_weight
        self.loss = loss
        self.outcome = StepOutcome()

    def run(self, microbatch: Any, run_stage: Callable[..., StageResult]) -> list[Tensor]:
        """The last stage's outputs (its loss, weighted) for ``microbatch``; ``run_stage(observers)`` runs
        the step with the loss counter as an observer of the stage runner (it sees the step's operations,
        not the runner's own)."""
        if not self.train:
            mb = self.index[id(microbatch)]
            counter = LossCounter()
            result = run_stage((counter,))
            outcome = self.outcome
            outcome.step_outputs[mb], outcome.logs[mb] = result.step_output, result.logs
            returned = result.step_output.get("loss") if isinstance(result.step_output, dict) else result.step_output
            outcome.loss_records[mb] = counter.record(returned, [call.value for call in result.logs])
            return [torch.zeros(())]
        if not torch.is_grad_enabled():  # the F of a recomputed pair: its RECOMPUTE records
            with metrics_inert(self.module):
                result = run_stage()
            return [self.loss(result.step_output).detach()]
        mb = self.index[id(microbatch)]
        counter = LossCounter()
        result = run_stage((counter,))
        loss = self.loss(result.step_output)
        outcome = self.outcome
        outcome.step_outputs[mb], outcome.logs[mb], outcome.losses[mb] = result.step_output, result.logs, loss.detach()
        record = counter.record(loss, [call.value for call in result.logs])
        outcome.loss_records[mb] = record
        if self.loss_weight is None:
            return [loss]
        weight = self.loss_weight(mb, record)
        outcome.loss_weights[mb] = weight
        return [loss * weight]


def run_split_step(
    executor: SplitPlacementExecutor,
    program: Program,
    microbatches: Sequence[Any],
    loss_scales: Sequence[float],
    recorder: LastStageRecorder,
) -> StepOutcome:
    """Run this rank's actions of ``program``; the outcome holds the last stage's records (its owner's).

    The stages of ``executor`` must hand their last stage to ``recorder`` (``StepHelixStages`` and
    ``StepSPipeStages`` take it as ``recorder``).
    """
    executor.run(program, microbatches, loss_scales)
    return recorder.outcome
