"""The strategy's cost models: what planners price batches with, agreed on by every rank.

:class:`StrategyCosts` is what ``ElasticPipelineStrategy.costs`` holds. It answers the planner
callbacks (``ElasticRepartition``, ``ScheduleSwitch("auto")``, ``PipelineProfiler``) and the
strategy's own ``partition="auto"``:

* the microbatch lengths of a batch, split exactly as the strategy splits it, and the same lengths
  from every data-parallel replica (all replicas must run one partition: their stage ``s`` holds
  the same parameters, whose gradients they average);
* a cost model without profiling: the meta-device probe of ``profiling.cost_probe``, made from shapes
  every rank agrees on, so every rank gets the same numbers;
* a measured profile: each rank times the units it owns, rank 0 fits, every rank gets rank 0's fit;
  it is also what :meth:`StrategyCosts.ensure_estimate` falls back to, with measured bytes, when the
  user's step cannot run on meta tensors, so no planner needs the step to run on meta;
* the longest batch of the training data, for the static ``partition="auto"``.

Lightning-free: it reads the strategy through a :class:`~lightning_pipe.strategies.context.PipelineContext`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.planning.partition import plan_partition
from lightning_pipe.profiling.cost_probe import CostEstimate, DeviceSpeed, MetaProbeError
from lightning_pipe.profiling.estimate import assumed_link, estimate_costs, probe_grid, probe_lengths
from lightning_pipe.profiling.memory_profile import sequence_lengths
from lightning_pipe.profiling.probing import token_tensor
from lightning_pipe.profiling.split_timing import time_split_backward
from lightning_pipe.profiling.unit_timing import fit_timings, measured_template, time_units
from lightning_pipe.runtime import collectives
from lightning_pipe.runtime.microbatch import sample_ranges
from lightning_pipe.schedules import SplitBackward, resolve_schedule
from lightning_pipe.strategies.context import PipelineContext
from lightning_pipe.strategies.memory import StrategyMemory

log = logging.getLogger(__name__)

LengthsFn = Callable[[Any], Sequence[int]]
"""``lengths_fn(batch) -> one length per sample``; default: ``[T] * B`` of the token tensor ``[B, T]``."""

class StrategyCosts:
    """Cost models and batch shapes of one ``ElasticPipelineStrategy`` (see the module docstring).

    Args:
        speed: the assumed device of meta estimates; None: :meth:`DeviceSpeed.for_device`.
    """

    def __init__(self, speed: DeviceSpeed | None = None) -> None:
        self.speed = speed
        self.estimate: CostEstimate | None = None
        self.longest_batch_lengths: list[int] | None = None
        self._context: PipelineContext | None = None
        self._memory: StrategyMemory | None = None
        self._candidates_split: dict[tuple, bool] = {}  # split_to_measure's answers for candidate families
        self._split_measured = False

    def setup(self, context: PipelineContext, memory: StrategyMemory) -> None:
        """Attach to the strategy's context (after sharding); ``memory`` gives the static bytes per parameter."""
        self._context = context
        self._memory = memory

    @property
    def context(self) -> PipelineContext:
        """The strategy's context (after :meth:`setup`)."""
        if self._context is None:
            raise RuntimeError("`StrategyCosts` is used before the strategy's setup gave it its context.")
        return self._context

    # --- batches ---------------------------------------------------------------------------------

    def microbatch_lengths(self, batch: Any, lengths_fn: LengthsFn | None = None) -> list[list[int]]:
        """Per microbatch, the length of each of its samples, split as the strategy splits the batch.

        The samples of each microbatch are those of the strategy's microbatch plan for the batch
        (``ElasticPipelineStrategy.split_batch``); with packing, the pieces each packed row holds (a
        slice counts its own tokens; the attention over its context is not priced).

        Raises:
            ValueError: ``lengths_fn`` gives another number of lengths than the batch has samples.
        """
        split = self.context.split_batch(batch)
        plan = split.plan
        if hasattr(plan, "pieces"):  # packed microbatches (runtime/packing.py): their pieces' lengths
            return [[n for _, _, n in group] for group in plan.pieces]
        if lengths_fn is None:  # the length each microbatch runs at (its own when padding is cut)
            return [[int(n) for n in sequence_lengths(mb)] for mb in split.microbatches]
        lengths = [int(n) for n in lengths_fn(batch)]
        if len(lengths) != plan.batch_size:
            raise ValueError(f"`lengths_fn` returned {len(lengths)} lengths for a batch of {plan.batch_size} samples.")
        return [[lengths[i] for i in plan.samples(mb)] for mb in range(plan.num_microbatches)]

    def replica_values(self, value: Any) -> list[Any]:
        """``value`` of every data-parallel replica, in replica order (a collective when dp > 1)."""
        context = self.context
        if context.layout.data_parallel_size == 1:
            return [value]
        return collectives.all_gather_objects(value, context.groups.data_parallel)

    def max_over_ranks(self, value: float) -> float:
        """The largest ``value`` of all processes (a collective), so that every rank uses one number.

        One all-reduce of a number, not an object all-gather (two collectives and pickling: 1.0 ms
        against 0.3 ms on two gloo processes); planners call it after every batch."""
        if self.context.world_size == 1:
            return float(value)
        largest = torch.tensor(float(value), dtype=torch.float64, device=self.context.device)
        collectives.all_reduce_tensor(largest, "max", "the agreement on a measured time (its largest over ranks)")
        return float(largest.item())

    def shapes(self, microbatch_lengths: Sequence[Sequence[int]]) -> list[MicrobatchShape]:
        """The planner's microbatch shapes (the current estimate's ``length_offset`` removed)."""
        offset = self.estimate.length_offset if self.estimate is not None else 0
        return [MicrobatchShape.from_lengths([max(1, n - offset) for n in lengths]) for lengths in microbatch_lengths]

    def heaviest(self, per_replica: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
        """The replica batch with the most work under the current cost model (first one on ties).

        A partition is shared by all replicas and the slowest one sets the step time, so planners
        plan for this batch.
        """
        if len(per_replica) == 1 or self.estimate is None:
            return [list(mb) for mb in per_replica[0]]
        model = self.estimate.cost_model

        def work(lengths: Sequence[Sequence[int]]) -> float:
            tables = model.tables(self.shapes(lengths))
            return float(tables.forward.sum() + tables.backward.sum())

        best = max(range(len(per_replica)), key=lambda r: (work(per_replica[r]), -r))
        return [list(mb) for mb in per_replica[best]]

    # --- cost models -----------------------------------------------------------------------------

    def use(self, estimate: CostEstimate | None) -> None:
        """Make ``estimate`` the model planners use."""
        self.estimate = estimate

    def use_model(self, cost_model: CostModel) -> None:
        """Use a plain ``CostModel`` (lengths read as the batch gives them)."""
        self.use(CostEstimate(cost_model, 0, "given"))

    def load(self, path: str | Path) -> CostEstimate:
        """Read a JSON profile (``CostModel.save`` or ``PipelineProfiler``'s) and use it."""
        import json

        data = json.loads(Path(path).read_text())
        self.use(CostEstimate.from_dict(data))
        return self.estimate

    def meta_estimate(self, batch: Any, max_length: int, num_sequences: int) -> CostEstimate:
        """A cost model from the meta-device probe (no profiling), identical on every rank.

        Args:
            batch: any batch of the training data (only its structure and dtypes are used).
            max_length: the longest sample length to probe (every rank must pass the same).
            num_sequences: samples per probe microbatch (every rank must pass the same).
        """
        context = self.context
        assert self._memory is not None
        microbatch = context.split_batch(batch).microbatches[0]
        return estimate_costs(
            context.module,
            context.runner.stack,
            context.current().unit_layout,
            microbatch,
            max_length,
            num_sequences,
            context.device,
            self._memory.static_bytes_per_parameter_byte() - 2.0,
            self.speed,
        )

    def ensure_estimate(
        self, batch: Any, max_length: int, num_sequences: int, batch_index: int = 0, split_backward: bool = False
    ) -> CostEstimate:
        """The estimate in use, else the meta-device one, else (the step reads values) a measured one.

        Every rank must call it at the same point of the step (the fallback is collective). The meta
        probe fails alike on every rank, since every rank runs the same step on the same shapes; the
        ranks still agree on it before profiling, so that a difference cannot leave one rank waiting.

        Args:
            batch: a batch of the training data (the probes' structure; real values when measured).
            max_length: the longest sample length to probe (every rank must pass the same).
            num_sequences: samples per probe microbatch (every rank must pass the same).
            batch_index: the step's second argument for measured probes.
            split_backward: the caller prices zero-bubble's split backward: an estimate without
                measured shares of ``I`` and ``W`` gets them (:meth:`measure_split_backward`, once).
                Every rank must pass the same.
        """
        if self.estimate is None:
            self.use(self._first_estimate(batch, max_length, num_sequences, batch_index))
        if split_backward and not self._split_measured and self.estimate.cost_model.split_backward is None:
            self.use_split_backward(self.measure_split_backward(batch, batch_index))
        return self.estimate

    def _first_estimate(self, batch: Any, max_length: int, num_sequences: int, batch_index: int) -> CostEstimate:
        """The meta-device estimate, else (the step reads values, on any rank) a measured one."""
        estimate, reason = None, ""
        try:
            estimate = self.meta_estimate(batch, max_length, num_sequences)
        except MetaProbeError as error:
            reason = str(error.__cause__ or error)
        if self.context.world_size > 1:
            reasons = collectives.all_gather_objects(reason, None)
            reason = next((r for r in reasons if r), "")
        if reason:
            sizes = dict.fromkeys((num_sequences, max(1, num_sequences // 2)))
            lengths = probe_lengths(max_length)
            tokens = token_tensor(self.context.split_batch(batch).microbatches[0])
            if tokens.is_floating_point():  # features, not token ids: no length to vary, only the sample count
                lengths = [int(tokens.shape[1])]
                sizes = dict.fromkeys((*sizes, 2 * num_sequences, 3 * num_sequences))
            shapes = probe_grid(lengths, sizes)
            log.info(
                "The meta-device cost probe cannot run the step (%s); measuring the stages' costs on %d real probe "
                "shapes instead (once).", reason, len(shapes),
            )
            estimate = self.profile(batch, batch_index, shapes, repeats=1, warmup=1)
        return estimate

    def split_to_measure(self, schedules: Sequence[Any] = ()) -> bool:
        """Whether a planner's ``ensure_estimate`` must measure the split backward: the estimate has no
        measured shares yet, and the running program or one of ``schedules`` (at this pipeline's size)
        runs zero-bubble's ``I`` and ``W``. Cheap once measured (planners ask on every batch)."""
        if self._split_measured or (self.estimate is not None and self.estimate.cost_model.split_backward is not None):
            return False
        current = self.context.current()
        if current.program.splits_backward:
            return True
        key = (tuple(repr(s) for s in schedules), self.context.pipeline_parallel_size, current.num_microbatches)
        if key not in self._candidates_split:
            found = False
            for schedule in schedules:
                with contextlib.suppress(ValueError):  # a family that cannot run at this size is not a candidate
                    found = found or resolve_schedule(schedule).build(*key[1:]).splits_backward
            self._candidates_split[key] = found
        return self._candidates_split[key]

    def use_split_backward(self, split: SplitBackward | None) -> None:
        """Price ``I`` and ``W`` with ``split`` in the estimate in use (None: leave it as it is)."""
        if split is not None and self.estimate is not None:
            model = dataclasses.replace(self.estimate.cost_model, split_backward=split)
            self.use(dataclasses.replace(self.estimate, cost_model=model))

    def measure_split_backward(self, batch: Any, batch_index: int = 0) -> SplitBackward | None:
        """What ``I`` and ``W`` cost as shares of ``B``, measured on this pipeline's stages after the first.

        Each rank of the first replica times its own stages after the first on the batch's first
        microbatch (``profiling/split_timing.py``); rank 0 sums them and every rank gets its shares.
        A collective: every rank must call it at the same point. None where no stage after the first
        exists (one stage): nothing there is split. Measured once: :meth:`split_to_measure` answers
        False afterwards, whatever came out.
        """
        self._split_measured = True
        context = self.context
        microbatch = context.split_batch(batch).microbatches[0]
        params = [p for p in context.module.parameters() if not p.is_meta]
        timings = []
        if context.layout.data_parallel_rank == 0:
            timings = [
                time_split_backward(
                    context.runner, "training_step", (microbatch, batch_index), span, params, context.device,
                    step_context=context.train_step_context,
                )
                for span in context.current().spans.values()
                if not span.is_first
            ]
        gathered = context.gather_from_pipeline(timings)
        split = None
        if context.global_rank == 0:
            found = [t for part in gathered for t in part]
            backward = sum(t.backward_seconds for t in found)
            if backward > 0 and sum(t.input_seconds + t.weight_seconds for t in found) > 0:
                split = SplitBackward.measured(
                    sum(t.input_seconds for t in found), sum(t.weight_seconds for t in found), backward
                )
                log.info(
                    "Zero-bubble's split backward measured on %d stage(s): I %.2f and W %.2f of a full backward.",
                    len(found), split.input_share, split.weight_share,
                )
        if context.world_size > 1:
            split = context.broadcast(split, 0)
        return split

    def profile(
        self,
        batch: Any,
        batch_index: int,
        shapes: Sequence[tuple[int, int]],
        repeats: int = 3,
        warmup: int = 1,
        holdout_fraction: float = 0.25,
    ) -> CostEstimate:
        """Time every unit for real on ``shapes`` (each rank its own stages), fit on rank 0, share.

        Args:
            batch: a training batch (its first microbatch gives the probes' structure and values).
            batch_index: the batch's index (the step's second argument).
            shapes: ``(num_sequences, length)`` of every probe microbatch.
            repeats: timed runs per shape (the median is kept).
            warmup: untimed runs per shape first.
            holdout_fraction: share of samples held out to report each fit's error.

        Returns:
            The fitted :class:`CostEstimate` (``source="profile"``), the same on every rank.
        """
        context = self.context
        microbatch = context.split_batch(batch).microbatches[0]
        params = [p for p in context.module.parameters() if not p.is_meta]
        timings = []
        if context.layout.data_parallel_rank == 0:  # replicas hold the same units: one pipeline times them
            timings = time_units(
                context.runner,
                "training_step",
                (microbatch, batch_index),
                list(context.current().spans.values()),
                shapes,
                params,
                context.device,
                repeats,
                warmup,
                context.train_step_context,
            )
        gathered = context.gather_from_pipeline(timings)
        estimate = None
        if context.global_rank == 0:
            max_length = max(length for _, length in shapes)
            num_sequences = max(count for count, _ in shapes)
            timings = [t for part in gathered for t in part]
            try:
                template = self.meta_estimate(batch, max_length, num_sequences)
            except MetaProbeError:  # the step reads values: bytes as measured too
                template = self._measured_template(timings)
            estimate = fit_timings(timings, template, holdout_fraction)
        if context.world_size > 1:
            estimate = context.broadcast(estimate, 0)
        return estimate

    def _measured_template(self, timings: Sequence[Any]) -> CostEstimate:
        context = self.context
        assert self._memory is not None
        latency, bandwidth = assumed_link(context.device)
        return measured_template(
            timings,
            context.module,
            context.current().unit_layout,
            self._memory.static_bytes_per_parameter_byte() - 2.0,
            latency,
            bandwidth,
        )

    # --- partition="auto" ------------------------------------------------------------------------

    def scan_longest_batch(self, loader: Any, lengths_fn: LengthsFn | None = None) -> tuple[Any, list[int]]:
        """The batch of ``loader`` with the longest sample (most tokens on ties) and its lengths.

        Reads the loader's dataset through its sampler and collate function in this process, under
        saved-and-restored RNG states (torch, ``random``, numpy), without creating an iterator of the
        loader (no worker processes, no draw of the iterator's base seed), so training sees the same
        data and random numbers as without the scan. It loads every batch once.

        Raises:
            TypeError: the loader is not one ``DataLoader`` over a map-style dataset.
        """
        if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
            raise TypeError(
                "`partition='auto'` finds the longest batch by reading the training `DataLoader`'s map-style dataset "
                f"through its sampler, but the training data is {type(loader).__name__}"
                f"{' over an IterableDataset' if isinstance(loader, DataLoader) else ''}. Use `partition='balanced'` "
                "(or a list of blocks per stage) and the `ElasticRepartition` callback."
            )
        measure = lengths_fn or sequence_lengths
        dataset, collate = loader.dataset, loader.collate_fn
        if loader.batch_sampler is None:
            batches = (collate(dataset[i]) for i in loader.sampler)
        else:
            batches = (collate([dataset[i] for i in indices]) for indices in loader.batch_sampler)
        best, best_key, best_lengths = None, None, []
        with _restored_random_states():
            for batch in batches:
                lengths = [int(n) for n in measure(batch)]
                key = (max(lengths), sum(lengths))
                if best_key is None or key > best_key:
                    best, best_key, best_lengths = batch, key, lengths
        if best is None:
            raise ValueError("`partition='auto'`: the training dataloader yields no batch.")
        return best, best_lengths

    def plan_static_partition(self, loader: Any, lengths_fn: LengthsFn | None = None) -> tuple[int, ...]:
        """``partition="auto"``: the best partition for the longest batch of the whole training data.

        Every replica scans its shard (:meth:`scan_longest_batch`); the longest over replicas is
        planned with the meta-device cost model (:func:`~lightning_pipe.planning.plan_partition`
        for the strategy's schedule), so every rank gets the same boundaries.
        """
        current = self.context.current()
        batch, lengths = self.scan_longest_batch(loader, lengths_fn)
        everyone = self.replica_values(lengths)
        longest = max(everyone, key=lambda ls: (max(ls), sum(ls)))
        self.longest_batch_lengths = list(longest)
        per_microbatch = _split(longest, current.num_microbatches)
        self.ensure_estimate(batch, max(longest), max(len(mb) for mb in per_microbatch))
        plan = plan_partition(
            self.estimate.cost_model, self.shapes(per_microbatch), current.schedule, self.context.pipeline_parallel_size
        )
        log.info(
            "partition='auto': longest batch (%d samples, up to %d long) planned as %s, predicted %.4g s per step",
            len(longest),
            max(longest),
            list(plan.boundaries),
            plan.step_seconds,
        )
        return plan.boundaries


def _split(lengths: Sequence[int], num_microbatches: int) -> list[list[int]]:
    return [list(lengths[start:end]) for start, end in sample_ranges(len(lengths), num_microbatches)]


@contextlib.contextmanager
def _restored_random_states():
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
