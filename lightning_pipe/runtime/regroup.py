"""Live regrouping on real processes: rank groups for every layout, executing heterogeneous programs,
summing gradients over a stage's replicas, and keeping an open accumulation window exact when units move.

Used by ``strategies/regrouping.py`` (docs/repartitioning.md, section 9.7):

- :func:`create_rank_groups`: every all-reduce rank set the planner may need, created once, up
  front, in one order on every rank (creating a group is a collective).
- :class:`LayoutExecutor`: the executor for ``schedules.layout_program.LayoutProgram``: a stage
  of width ``w`` receives microbatch ``m`` on replica ``m % w``, so a transfer's peer depends on
  the microbatch.
- :func:`~lightning_pipe.runtime.collectives.reduce_gradients`: at the optimizer step, each stage's replicas sum their partial
  gradients (each replica ran its share of the microbatches with weights normalised by the whole
  batch, so the sum, not the mean, is the batch's gradient, also with unequal shares).
- :func:`sum_moved_gradients` and :func:`keep_moved_gradients`, around ``runtime.migration.migrate``:
  before units move, the old replicas' partial gradients of every unit whose holders change are
  summed on one keeper (the lowest holder that stays, else the lowest old holder, which is
  migration's source); after the move only one new holder keeps the sum, the others start the rest
  of the window from zero. The sum over a unit's holders (what the step all-reduces) is unchanged.
- :func:`merge_replica_outcomes`: a last stage of width ``w`` has each microbatch's loss on the
  replica that ran it; they are gathered on the stage's first device, which reports the step.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_pipe.runtime.collectives import gather_objects, reduce_gradients
from lightning_pipe.runtime.executor import PipelineExecutor, StepOutcome


def create_rank_groups(
    rank_sets: Iterable[Sequence[int]], timeout: timedelta | None = None
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """Create one process group per rank set, in the given order (a collective: every rank calls it).

    Args:
        rank_sets: e.g. ``planning.regroup.replica_groups(layouts)``; identical on every rank.
        timeout: the strategy's timeout for every operation of these groups.

    Returns:
        Every group by its rank tuple (a rank outside a set gets a non-member handle, as torch does).
    """
    groups = {}
    for ranks in rank_sets:
        key = tuple(int(r) for r in ranks)
        groups[key] = dist.new_group(list(key), timeout=timeout)
    return groups


class LayoutExecutor(PipelineExecutor):
    """A :class:`PipelineExecutor` whose peers depend on the microbatch (heterogeneous programs).

    Every transfer of an action concerns the action's own microbatch (``SEND_F``/``SEND_B`` send it,
    ``F``/``B`` receive for it), so the peer is the program's ``rank_for(stage, microbatch)`` when the
    program has one (``LayoutProgram``) and the stage's rank otherwise. ``pipeline_ranks`` maps the
    program's devices to global ranks.
    """

    def _peer(self, stage: int, microbatch: int) -> int:
        route = getattr(self._program, "rank_for", None)
        if route is None:
            return super()._peer(stage, microbatch)
        return self.pipeline_ranks[route(stage, microbatch)]


def sum_moved_gradients(
    parameters: Mapping[str, Tensor],
    old_holders: Mapping[str, frozenset[int]],
    new_holders: Mapping[str, frozenset[int]],
    rank: int,
    groups: Mapping[tuple[int, ...], dist.ProcessGroup],
) -> dict[str, int]:
    """Before a move: sum every moving parameter's partial gradients on its keeper.

    Args:
        parameters: this rank's real parameters by name.
        old_holders: ranks holding each tensor now (``runtime.migration.holders_of``).
        new_holders: ranks holding it after the move.
        rank: this rank (global; holders are global ranks).
        groups: the replica groups by rank tuple (:func:`create_rank_groups`).

    Returns:
        For every tensor whose holders change, the old holder that now has the whole sum (the
        lowest holder that stays, else the lowest old holder); the other old holders hold zero.
    """
    keepers: dict[str, int] = {}
    mine: dict[tuple[int, ...], list[str]] = {}
    for name in sorted(old_holders):
        was, will = old_holders[name], new_holders.get(name, old_holders[name])
        if was == will or not was:
            continue
        staying = sorted(was & will)
        keepers[name] = staying[0] if staying else min(was)
        param = parameters.get(name)
        if rank in was and len(was) > 1 and param is not None and param.requires_grad:
            mine.setdefault(tuple(sorted(was)), []).append(name)
    for holders, names in sorted(mine.items()):
        params = [parameters[name] for name in names]
        reduce_gradients(params, groups[holders], f"the sum of moving units' gradients over ranks {list(holders)}")
        for name, param in zip(names, params, strict=True):
            if rank != keepers[name] and param.grad is not None:
                param.grad.zero_()
    return keepers


def keep_moved_gradients(
    parameters: Mapping[str, Tensor],
    new_holders: Mapping[str, frozenset[int]],
    keepers: Mapping[str, int],
    rank: int,
) -> None:
    """After the move: of every moved tensor's new holders, only one keeps the summed gradient.

    The keeper of :func:`sum_moved_gradients` if it stays a holder; else the lowest new holder (a
    destination that received the sum from migration's source, the lowest old holder).
    """
    for name, keeper in keepers.items():
        will = new_holders.get(name, frozenset())
        if rank not in will:
            continue
        final = keeper if keeper in will else min(will)
        param = parameters.get(name)
        if rank != final and param is not None and param.grad is not None:
            param.grad.zero_()


class _DetachingPickler(pickle.Pickler):
    """Pickles tensors that require gradients as detached copies (a loss logged with its graph)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor) and obj.requires_grad:
            return _same, (obj.detach(),)
        return NotImplemented


def _same(value: Any) -> Any:
    return value


def _pickled(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _DetachingPickler(buffer).dump(obj)
    return buffer.getvalue()


def merge_replica_outcomes(outcome: StepOutcome, group: dist.ProcessGroup, first: int, rank: int) -> StepOutcome:
    """Gather the last stage's per-microbatch results of every replica on ``first`` (a collective of ``group``).

    ``outcome`` is this replica's; on ``first`` the returned outcome holds every microbatch's loss,
    step output, logs, loss record and loss weight (the logged values' tracing is kept: a record's
    ``logged`` keys are re-made for the received values). Other replicas return theirs unchanged.
    """
    entries = {}
    for mb in outcome.logs:
        record = outcome.loss_records.get(mb)
        positions = {}
        if record is not None:
            ids = {id(call.value): i for i, call in enumerate(outcome.logs[mb])}
            positions = {ids[key]: traced for key, traced in record.logged.items() if key in ids}
        entries[mb] = (
            outcome.losses.get(mb), outcome.step_outputs.get(mb), outcome.logs[mb], record, positions,
            outcome.loss_weights.get(mb),
        )
    gathered = gather_objects(_pickled(entries), first, group)
    if rank != first:
        return outcome
    for data in gathered:
        for mb, (loss, step_output, logs, record, positions, weight) in pickle.loads(data).items():
            if mb in outcome.logs:
                continue  # this replica's own
            if loss is not None:
                outcome.losses[mb] = loss
            outcome.step_outputs[mb] = step_output
            outcome.logs[mb] = logs
            if record is not None:
                record.logged = {id(logs[i].value): traced for i, traced in positions.items()}
                outcome.loss_records[mb] = record
            if weight is not None:
                outcome.loss_weights[mb] = weight
    return outcome
