"""Execute one rank's program of actions for one step.

``F`` runs the user's step as a stage (:class:`~lightning_pipe.model.StageRunner`), ``B``/``I``/``W``
run autograd from the stage outputs, ``SEND_*`` post transfers. A receive completes where its
tensor is consumed (``F`` for activations, ``B``/``I`` for gradients): an activation's shape is only
known when the stage reaches its first block on the meta device, and this keeps microbatches free
to have any shape without a shape exchange. The program's ``RECV_*`` actions therefore only assert
order; validated programs place them right before their consumer.

Where shapes are known earlier, the receive is *posted* earlier (on gloo, which matches messages by
tag; gloo moves a message only once its receive is posted, so a late post puts the whole transfer on
the critical path): a stage's gradients right after it sent the activations they belong to, and,
when the step's microbatches share their shapes (``StepWork.same_shapes``), the next microbatch's
activations as soon as this one's arrived, and each stage's first activations at the step's start in
the shapes of the last step (:meth:`PipelineExecutor._post_first_receives`). Where microbatches have
their own lengths, an activation message is preceded by a header with its shapes, of one size
whatever it describes: the headers' receives are posted at the same points, so a header lands when
it is sent and only the tensors' receive waits for the consumer.

Zero-bubble split backward (``runtime/split_backward.py``): ``I`` computes the input gradients
(and the norms' and biases' on its way) and records the gradients at the nodes where each matrix
parameter's subgraph meets the input path; ``W`` starts there and computes the matrices' gradients.
Together they cost one backward's FLOPs but more time (the products of ``W`` read the kept gradients
back from memory: 14-24% over ``B`` for a 2-block GPT stage on CPU), so the strategy runs a pair as one
``B`` where splitting it buys nothing (``schedules/backward_merging.py``); the executor runs the
program it is given. Every backward action runs outside the step's autocast (:func:`outside_autocast`).

Memory actions (``RECOMPUTE``, ``OFFLOAD``, ``RELOAD``, written by the strategy from its memory plan)
are markers: the pair's blocks recompute and offload through the block wrapper armed for that
(stage, microbatch) from the same plan, when autograd needs them; a marker without a block wrapper
is refused (nothing would perform it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from lightning_pipe.model._torch_compat import tree_flatten, view_base
from lightning_pipe.model.loss_counting import LossCounter, LossRecord
from lightning_pipe.model.stage_runner import BlockWrapper, LogCall, StageResult, StageRunner, StageSpan
from lightning_pipe.model.units import is_float
from lightning_pipe.runtime.failures import PeerFailure
from lightning_pipe.runtime.instructions import run_instruction
from lightning_pipe.runtime.p2p import ACTIVATION, GRADIENT, PendingHeader, PendingReceive, PointToPoint
from lightning_pipe.runtime.side_task import SideTaskPlacer, ready_index
from lightning_pipe.runtime.split_backward import WeightPass, backward_input
from lightning_pipe.schedules.action_rules import ACTION_RULES
from lightning_pipe.schedules.ir import Action, ActionType, Program


@dataclass
class StepWork:
    """What one step computes.

    Attributes:
        step_name: the user's step function (``"training_step"``, ...).
        microbatches: the arguments of the step for each microbatch.
        loss_scales: per microbatch, the factor applied to the loss before backward (its share of
            the batch divided by the accumulation count); None for forward-only steps.
        block_wrapper: given (stage, microbatch), the wrapper for that stage's block calls, or None
            (how memory plans apply recompute or offload per stage and microbatch).
        count_losses: trace the last stage's loss calls (``model/loss_counting.py``) into
            ``StepOutcome.loss_records``.
        loss_weight: given (microbatch, its loss record), a further factor for its loss, decided
            when its forward has run (``runtime/loss_weights.raw_weight``); None: none.
        describe_shapes: microbatches have their own lengths: activations travel with their shapes,
            and stages learn the shapes of blocks they do not run instead of probing each new
            length (``model/shape_rules.py``). Every rank of the pipeline must pass the same.
        extra_roots: given (stage, microbatch), more tensors its backward differentiates and their
            gradients (a slice's keys and values with what later slices left them,
            ``model/attention.KeyValueStore``); None: none. Full backward (``B``) only.
        same_shapes: every microbatch of the step has the same input shapes, so each stage's
            activations have the shapes of the microbatch before: their receives are posted as soon
            as that one's arrived (where the transfer layer matches by tag). Every rank of the
            pipeline must pass the same.
        side_task: on the rank of the last stage, work that needs all of that stage's forwards and
            nothing else (the step's outcome), given the outcome so far; run once, inside the program
            where the rank waited for as long in the last step of the same program, else after it
            (``runtime/side_task.py``). None: none.
    """

    step_name: str
    microbatches: list[tuple]
    loss_scales: list[float] | None = None
    block_wrapper: Callable[[int, int], BlockWrapper | None] | None = None
    count_losses: bool = False
    loss_weight: Callable[[int, LossRecord], Any] | None = None
    describe_shapes: bool = False
    extra_roots: Callable[[int, int], tuple[list[Tensor], list[Tensor]]] | None = None
    same_shapes: bool = False
    side_task: Callable[[StepOutcome], None] | None = None


@dataclass
class ActionRecord:
    """When one action ran on this rank (``time.perf_counter`` seconds).

    ``wait`` is the part of ``end - start`` spent blocked in receives (an ``F`` or ``B`` waits for its
    input there), so ``end - start - wait`` is the time the rank was busy. ``arrival``: when the
    message from another rank it waited for arrived (None if it did not wait for one).
    """

    action: Action
    start: float
    end: float
    wait: float = 0.0
    arrival: float | None = None


@dataclass
class StepOutcome:
    """What a step produced on this rank.

    Attributes:
        losses: detached loss per microbatch (last stage only).
        step_outputs: the user's step output per microbatch (last stage only).
        logs: recorded ``self.log`` calls per microbatch (last stage only).
        records: timing of every action this rank ran.
        loss_records: what each microbatch's loss was computed from (last stage, with ``count_losses``).
        loss_weights: the factor ``StepWork.loss_weight`` gave each microbatch (last stage only).
        side_task_s: seconds the side task ran between this rank's actions (0 when it ran after them).
    """

    losses: dict[int, Tensor] = field(default_factory=dict)
    step_outputs: dict[int, Any] = field(default_factory=dict)
    logs: dict[int, list[LogCall]] = field(default_factory=dict)
    records: list[ActionRecord] = field(default_factory=list)
    loss_records: dict[int, LossRecord] = field(default_factory=dict)
    loss_weights: dict[int, Any] = field(default_factory=dict)
    side_task_s: float = 0.0


@dataclass
class _Slot:
    result: StageResult
    loss: Tensor | None = None
    weight: Any = 1.0
    input_grads: list[Tensor] | None = None
    output_grads: list[Tensor | None] | None = None
    weight_pass: WeightPass | None = None
    kept: list[Tensor] = field(default_factory=list)  # the step's output and logs holding the graph (last stage)


def _timed(task: Callable[[StepOutcome], None], outcome: StepOutcome) -> float:
    started = time.perf_counter()
    task(outcome)
    return time.perf_counter() - started


_BACKWARDS = frozenset({ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT})


class PipelineExecutor:
    """Runs programs on one pipeline rank.

    Args:
        runner: runs stages of the user's module.
        p2p: transfer layer for the pipeline group.
        pipeline_ranks: global rank of every pipeline rank (index = pipeline rank).
        pipeline_rank: this rank's index in ``pipeline_ranks``.
        device: where received tensors are placed.
    """

    def __init__(
        self,
        runner: StageRunner,
        p2p: PointToPoint,
        pipeline_ranks: list[int],
        pipeline_rank: int,
        device: torch.device,
    ) -> None:
        self.runner = runner
        self.p2p = p2p
        self.pipeline_ranks = pipeline_ranks
        self.pipeline_rank = pipeline_rank
        self.device = device
        self._waited = 0.0
        self._arrival: float | None = None
        self._side_tasks = SideTaskPlacer()
        # the activation shapes each stage received in the last step, and the program and stage starts
        # they belong to (:meth:`_post_first_receives`)
        self._received_shapes: dict[int, list[tuple[torch.Size, torch.dtype]]] = {}
        self._received_for: tuple[Program, tuple] | None = None

    def run(self, program: Program, spans: dict[int, StageSpan], work: StepWork) -> StepOutcome:
        """Run this rank's actions of ``program`` for ``work``; ``spans`` maps its stages to blocks."""
        self._program = program
        self._spans = spans
        self._work = work
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._local_activations: dict[tuple[int, int], list[Tensor]] = {}
        self._local_gradients: dict[tuple[int, int], list[Tensor]] = {}
        self._prefetched: dict[tuple[int, int], PendingReceive] = {}
        self._prefetched_activations: dict[tuple[int, int], PendingReceive] = {}
        self._prefetched_headers: dict[tuple[int, int], PendingHeader] = {}
        self._early_activations = self._prefetch_activations(work)
        self._early_headers = work.describe_shapes and self.p2p.matches_by_tag
        first, self._next_forward = (
            self._forward_order(program) if self._early_activations or self._early_headers else ({}, {})
        )
        self._post_first_receives(program, spans, first)
        outcome = StepOutcome()
        self.runner.predict_shapes = work.describe_shapes
        me = f"Rank {self.pipeline_ranks[self.pipeline_rank]} (pipeline rank {self.pipeline_rank})"
        task = work.side_task
        ready = None if task is None else ready_index(program, self.pipeline_rank)
        point = None if ready is None else self._side_tasks.point(program)
        point = None if point is None else max(point, ready)  # never before the outcome is complete
        ran_before, task_s = None, 0.0
        try:
            for index, action in enumerate(program.actions[self.pipeline_rank]):
                if index == point and task is not None:
                    task_s, ran_before, task = _timed(task, outcome), index, None
                    outcome.side_task_s = task_s
                self._waited, self._arrival = 0.0, None
                start = time.perf_counter()
                try:
                    self._execute(action, outcome)
                except PeerFailure as failure:  # say which action of which stage waited
                    where = (
                        f"{me}, running {action.type.name} of stage {action.stage}, "
                        f"microbatch {action.microbatch} ({action}),"
                    )
                    raise failure.located(where) from failure.cause
                outcome.records.append(ActionRecord(action, start, time.perf_counter(), self._waited, self._arrival))
            try:
                self.p2p.wait_sends()
            except PeerFailure as failure:
                raise failure.located(f"{me}, at the end of the step,") from failure.cause
            if task is not None:
                task_s = _timed(task, outcome)
            if ready is not None:
                self._side_tasks.observe(program, ready, [r.wait for r in outcome.records], ran_before, task_s)
        except BaseException:
            self._received_for = None  # a failed step's receives may be left posted: post nothing early next time
            raise
        finally:
            self.runner.predict_shapes = False
            self._slots = {}
            self._local_activations = {}
            self._local_gradients = {}
            self._prefetched = {}
            self._prefetched_activations = {}
            self._prefetched_headers = {}
        return outcome

    # --- actions ---------------------------------------------------------------------------------

    def _execute(self, action: Action, outcome: StepOutcome) -> None:
        kind, stage, mb = action.type, action.stage, action.microbatch
        if kind is ActionType.FORWARD:
            self._forward(stage, mb, outcome)
        elif kind in _BACKWARDS:
            with outside_autocast(self.device):
                if kind is ActionType.BACKWARD_WEIGHT:
                    self._backward_weight(stage, mb)
                else:
                    self._backward(stage, mb, full=kind is ActionType.BACKWARD)
        elif kind is ActionType.SEND_F:
            outputs = self._slot(action).result.outputs
            self.p2p.send(outputs, self._peer(stage + 1, mb), ACTIVATION, stage, mb, describe=self._work.describe_shapes)
            self._prefetch_gradients(stage, mb, outputs)
        elif kind is ActionType.SEND_B:
            self.p2p.send(self._slot(action).input_grads, self._peer(stage - 1, mb), GRADIENT, stage, mb)
        elif kind in (ActionType.RECV_F, ActionType.RECV_B):
            return  # nothing to do here: the tensor is received where it is consumed (module docstring)
        elif kind is ActionType.CUSTOM:
            run_instruction(action, self.pipeline_rank)
        elif ACTION_RULES[kind].from_memory_plan:
            if self._work.block_wrapper is None:
                raise RuntimeError(
                    f"Rank {self.pipeline_rank}: {action} ({kind.name}) but the step has no block wrapper to perform "
                    "it; memory actions are written from the strategy's memory plan (planning.memory_lowering)."
                )
        else:
            raise RuntimeError(
                f"Rank {self.pipeline_rank} has no runtime for action {action} ({kind.name}); "
                "register one or remove it from the schedule."
            )

    def _forward(self, stage: int, mb: int, outcome: StepOutcome) -> None:
        span = self._spans[stage]
        wrapper = self._work.block_wrapper(stage, mb) if self._work.block_wrapper is not None else None
        counter = LossCounter() if self._work.count_losses and span.is_last else None
        result = self.runner.run(
            self._work.step_name,
            self._work.microbatches[mb],
            span,
            receive=lambda metas: self._receive(stage, mb, metas),
            wrap_block=wrapper,
            observers=() if counter is None else (counter,),
        )
        slot = _Slot(result)
        self._slots[(stage, mb)] = slot
        if span.is_last:
            record = None
            if self._work.loss_scales is not None:
                slot.loss = extract_loss(result.step_output, self._work.step_name)
                outcome.losses[mb] = slot.loss.detach()
            if counter is not None:
                returned = slot.loss if slot.loss is not None else _maybe_loss(result.step_output)
                record = counter.record(returned, [call.value for call in result.logs])
                outcome.loss_records[mb] = record
                if self._work.loss_weight is not None:
                    slot.weight = self._work.loss_weight(mb, record)
                    outcome.loss_weights[mb] = slot.weight
            outcome.step_outputs[mb], outcome.logs[mb] = result.step_output, result.logs
            slot.kept = _graph_holders(result.step_output, result.logs)
        elif self._program.rank_of(stage + 1) == self.pipeline_rank:
            self._local_activations[(stage + 1, mb)] = result.outputs

    def _prefetch_gradients(self, stage: int, mb: int, outputs: list[Tensor]) -> None:
        """Post the receive of the gradients of the outputs just sent: their shapes are the outputs',
        so the transfer can run whenever the next stage sends, while this rank computes, instead of
        starting when the backward asks for it (gloo moves a message only once its receive is
        posted). Where receives must be posted in program order (NCCL), they are not posted early."""
        if not self.p2p.matches_by_tag or self._work.loss_scales is None:
            return
        shapes = [(t.shape, t.dtype) for t in outputs if is_float(t)]
        self._prefetched[(stage, mb)] = self.p2p.post_receive(shapes, self._peer(stage + 1, mb), GRADIENT, stage + 1, mb, self.device)

    def _prefetch_activations(self, work: StepWork) -> bool:
        """Whether activations are received early: when the microbatches of the step share their
        shapes and no header precedes activations, the next microbatch's activations have the
        shapes this one's had, so their receive is posted as soon as this one's arrived."""
        return work.same_shapes and not work.describe_shapes and not self.p2p.send_dtypes and self.p2p.matches_by_tag

    def _forward_order(self, program: Program) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
        """For the stages after the first on this rank: ``stage -> the microbatch of its first forward``,
        and ``(stage, microbatch) -> the microbatch of the stage's next forward``."""
        first: dict[int, int] = {}
        following, last = {}, {}
        for action in program.actions[self.pipeline_rank]:
            stage = action.stage
            if action.type is not ActionType.FORWARD or stage == 0:
                continue
            if stage in last:
                following[(stage, last[stage])] = action.microbatch
            else:
                first[stage] = action.microbatch
            last[stage] = action.microbatch
        return first, following

    def _post_first_receives(self, program: Program, spans: dict[int, StageSpan], first: dict[int, int]) -> None:
        """Post, at the step's start, the receive of each stage's first activations from another rank,
        in the shapes that stage received in the last step; where lengths vary (``describe_shapes``),
        the receive of the header that describes them (it has one size whatever it describes).

        Within a step a stage's next activations are received early once its first arrived; the first
        had its receive posted only when its forward asked for it, after the sender had sent: gloo
        then moves the payload only once the sender's transfer thread gets a core again, measured at
        1-7 ms on the 2-core CPU run of ZB-V (rank 0's last stage waiting for the first forward of
        the stage before it, sent several milliseconds earlier). When the step's shapes are those of
        the last step (``same_shapes``: microbatches alike and unchanged since the last step, no header)
        and the program and this rank's stage starts are the same objects and blocks, the stage's
        input is the same block's output for inputs of the same shapes, so the last step's shapes are
        this step's; a stage whose shapes would still differ is refused by :meth:`_receive`. A header
        is sent with every activation message that holds tensors, so its receive is posted wherever
        the stage received tensors in the last step (within a step: where the message before held some).
        """
        key = (program, tuple(sorted((stage, span.first_block) for stage, span in spans.items())))
        remembered, self._received_shapes = self._received_shapes, {}
        same = self._received_for is not None and self._received_for[0] is program and self._received_for[1] == key[1]
        self._received_for = key
        if not (same and (self._early_activations or self._early_headers)):
            return
        me = self.pipeline_ranks[self.pipeline_rank]
        for stage, mb in first.items():
            shapes, peer = remembered.get(stage), self._peer(stage - 1, mb)
            if not shapes or peer == me:  # nothing was received last time: no header is sent either
                continue
            if self._early_activations:
                self._prefetched_activations[(stage, mb)] = self.p2p.post_receive(
                    shapes, peer, ACTIVATION, stage - 1, mb, self.device
                )
            else:  # lengths vary: the header describing them, whatever they are
                self._prefetched_headers[(stage, mb)] = self.p2p.post_header_receive(peer, stage - 1, mb, self.device)

    def _receive(self, stage: int, mb: int, metas: list[Tensor]) -> list[Tensor]:
        local = self._local_activations.pop((stage, mb), None)
        if local is None:
            shapes = [(m.shape, m.dtype) for m in metas]
            started = time.perf_counter()
            pending = self._prefetched_activations.pop((stage, mb), None)
            if pending is not None:
                posted = [(b.shape, b.dtype) for b in pending.buffers]
                if posted != shapes:
                    raise RuntimeError(
                        f"Stage {stage} microbatch {mb}: its activations were expected in the shapes of the microbatch "
                        f"before ({posted}), but this one needs {shapes}. Microbatches of one step share their shapes "
                        "unless lengths vary; a block whose output shape depends on values cannot cross a stage boundary."
                    )
                local = pending.wait()
            else:
                local = self.p2p.receive(
                    shapes, self._peer(stage - 1, mb), ACTIVATION, stage - 1, mb, self.device,
                    describe=self._work.describe_shapes, header=self._prefetched_headers.pop((stage, mb), None),
                )
            self._waited += time.perf_counter() - started
            self._arrival = self.p2p.last_arrival
            arrived = self._received_shapes[stage] = [(t.shape, t.dtype) for t in local]
            following = self._next_forward.get((stage, mb))
            peer = None if following is None else self._peer(stage - 1, following)
            if peer is not None and peer != self.pipeline_ranks[self.pipeline_rank]:
                if self._early_headers and local:  # a header follows every message that holds tensors
                    self._prefetched_headers[(stage, following)] = self.p2p.post_header_receive(
                        peer, stage - 1, following, self.device
                    )
                elif self._early_activations:
                    self._prefetched_activations[(stage, following)] = self.p2p.post_receive(
                        arrived, peer, ACTIVATION, stage - 1, following, self.device
                    )
        received = []
        for meta, tensor in zip(metas, local, strict=True):
            if tensor.shape != meta.shape and self._work.describe_shapes:
                # the sizes were predicted (model/shape_rules.py) and the sender's are the truth
                for block in range(self._spans[stage].first_block):
                    self.runner.shape_rules.forget(block)
            elif tensor.shape != meta.shape:
                raise RuntimeError(
                    f"Stage {stage} microbatch {mb}: received shape {tuple(tensor.shape)} but the step expects "
                    f"{tuple(meta.shape)} at its first block."
                )
            leaf = tensor.detach()
            if is_float(leaf) and torch.is_grad_enabled():
                leaf.requires_grad_(True)
            received.append(leaf)
        return received

    def _output_gradients(self, stage: int, mb: int, slot: _Slot) -> tuple[list[Tensor], list[Tensor | None]]:
        """The stage's outputs to differentiate and the gradients flowing into them."""
        if self._spans[stage].is_last:
            assert slot.loss is not None and self._work.loss_scales is not None
            return [slot.loss * self._work.loss_scales[mb] * slot.weight], [None]
        floats = [t for t in slot.result.outputs if is_float(t)]
        if slot.output_grads is None:
            grads = self._local_gradients.pop((stage, mb), None)
            if grads is None:
                shapes = [(t.shape, t.dtype) for t in floats]
                started = time.perf_counter()
                pending = self._prefetched.pop((stage, mb), None)
                if pending is not None:
                    grads = pending.wait()
                else:
                    grads = self.p2p.receive(shapes, self._peer(stage + 1, mb), GRADIENT, stage + 1, mb, self.device)
                self._waited += time.perf_counter() - started
                self._arrival = self.p2p.last_arrival
            slot.output_grads = list(grads)
        pairs = [(t, g) for t, g in zip(floats, slot.output_grads, strict=True) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _float_inputs(self, slot: _Slot) -> list[Tensor]:
        return [t for t in slot.result.inputs if is_float(t)]

    def _backward(self, stage: int, mb: int, full: bool) -> None:
        slot = self._slots[(stage, mb)]
        outputs, grads = self._output_gradients(stage, mb, slot)
        if self._work.extra_roots is not None:
            more, more_grads = self._work.extra_roots(stage, mb)
            if more and not full:
                raise RuntimeError(f"Rank {self.pipeline_rank}: stage {stage} microbatch {mb} has key/value gradients "
                                   "to apply, which a split backward (I/W) does not support.")
            outputs, grads = outputs + more, grads + more_grads
        inputs = self._float_inputs(slot)
        if full:
            if outputs:
                torch.autograd.backward(outputs, grads)
            input_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
            _release(slot)
        else:  # zero-bubble I: input gradients only; W later computes only the weights' (split_backward.py)
            computed, slot.weight_pass = backward_input(outputs, grads, inputs)
            input_grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, computed)]
        slot.input_grads = input_grads
        if stage > 0 and self._program.rank_of(stage - 1) == self.pipeline_rank:
            self._local_gradients[(stage - 1, mb)] = input_grads

    def _backward_weight(self, stage: int, mb: int) -> None:
        slot = self._slots[(stage, mb)]
        if slot.weight_pass is None:
            raise RuntimeError(f"Rank {self.pipeline_rank}: W of stage {stage} microbatch {mb} before its I (order of the program?).")
        slot.weight_pass.run()
        _release(slot)

    def _slot(self, action: Action) -> _Slot:
        slot = self._slots.get((action.stage, action.microbatch))
        if slot is None:
            raise RuntimeError(f"Rank {self.pipeline_rank}: {action} has nothing to send (order of the program?).")
        return slot

    def _peer(self, stage: int, microbatch: int) -> int:
        """Global rank that runs ``stage`` for ``microbatch`` (the stage's rank here; a subclass may
        route microbatches to replicas)."""
        return self.pipeline_ranks[self._program.rank_of(stage)]


def outside_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a backward runs: outside the step's autocast, as in Lightning's own loop.

    The strategy runs the whole pipelined step, backward included, inside the precision plugin's
    ``train_step_context`` (autocast under ``bf16-mixed``), and the autograd engine applies an active
    autocast to the backward's products: the weight gradients of a region the model runs in float32
    (``torch.autocast(..., enabled=False)`` in its forward) would come out at bfloat16 precision. A
    recomputed forward restores its own autocast state (``torch.utils.checkpoint`` records it).
    """
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _release(slot: _Slot) -> None:
    """Drop the activations and graph of a finished microbatch; its input gradients stay for SEND_B."""
    slot.result = StageResult()
    slot.loss = None
    slot.output_grads = None
    slot.weight_pass = None
    for tensor in slot.kept:
        tensor.detach_()  # in place: the step's output and logs keep their identity and values
    slot.kept = []


def _graph_holders(step_output: Any, logs: list[LogCall]) -> list[Tensor]:
    """The tensors of the step's output and logged values that hold the microbatch's autograd graph.

    They are kept until the step ends (log replay, loss records, which know them by identity), so
    :func:`_release` detaches them in place once the microbatch's backward is done: a full backward
    frees the saved tensors anyway, but a split backward (I keeps the graph for W, and W visits only
    the weights' nodes) would leave the rest of them alive as long as anything holds the graph.
    Views are left out: torch cannot detach a view in place, so a returned or logged view keeps its
    graph to the end of the step, as before (more memory for that microbatch, which the memory
    accounting counts; the values are the same).
    """
    values = [leaf for leaf in tree_flatten(step_output)[0]] + [call.value for call in logs]
    return [v for v in values if isinstance(v, Tensor) and v.grad_fn is not None and view_base(v) is None]


def _maybe_loss(step_output: Any) -> Any:
    return step_output.get("loss") if isinstance(step_output, Mapping) else step_output


def extract_loss(step_output: Any, step_name: str) -> Tensor:
    """The loss the user's step returned (the value, or its ``"loss"``), or an error saying what to return."""
    loss = step_output.get("loss") if isinstance(step_output, Mapping) else step_output
    if not isinstance(loss, Tensor):
        raise RuntimeError(
            f"`{step_name}` returned {type(step_output).__name__}; with pipeline parallelism it must return the loss "
            "tensor or a dict with a 'loss' key on every step (skipping a step by returning None is not supported)."
        )
    return loss
