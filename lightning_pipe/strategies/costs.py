"""The strategy's cost models: what planners price batches with, agreed on by every rank.

:class:`StrategyCosts` is what ``ElasticPipelineStrategy.costs`` holds. It answers the planner
callbacks (``ElasticRepartition``, ``ScheduleSwitch("auto")``, ``PipelineProfiler``) and the
strategy's own ``partition="auto"``:

* the microbatch lengths of a batch, split exactly as the strategy splits it, and the same lengths
  from every data-parallel replica (all replicas must run one partition: their stage ``s`` holds
  the same parameters, whose gradients they average);
* a cost model without profiling: the meta-device probe of ``runtime.cost_probe``, made from shapes
  every rank agrees on, so every rank gets the same numbers;
* a measured profile: each rank times the units it owns, rank 0 fits, every rank gets rank 0's fit;
* the longest batch of the training data, for the static ``partition="auto"``.

Lightning-free: it needs only the strategy's attributes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_pipe.model.blocks import BlockStack
from lightning_pipe.model.units import UnitLayout
from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.planning.partition import plan_partition
from lightning_pipe.runtime import collectives
from lightning_pipe.runtime.cost_probe import CostEstimate, DeviceSpeed, count_units, fit_cost_model
from lightning_pipe.runtime.memory_profile import sequence_lengths
from lightning_pipe.runtime.microbatch import sample_ranges
from lightning_pipe.runtime.unit_timing import fit_timings, time_units

log = logging.getLogger(__name__)

LengthsFn = Callable[[Any], Sequence[int]]
"""``lengths_fn(batch) -> one length per sample``; default: ``[T] * B`` of the token tensor ``[B, T]``."""

# Assumed stage-to-stage link, (seconds per message, bytes per second), until migrations are measured.
_LINK = {"cpu": (1e-4, 2e9), "cuda": (1e-5, 50e9)}


class StrategyCosts:
    """Cost models and batch shapes of one ``ElasticPipelineStrategy`` (see the module docstring).

    Args:
        speed: the assumed device of meta estimates; None: :meth:`DeviceSpeed.for_device`.
    """

    def __init__(self, speed: DeviceSpeed | None = None) -> None:
        self.speed = speed
        self.estimate: CostEstimate | None = None
        self.longest_batch_lengths: list[int] | None = None
        self._strategy: Any = None

    def setup(self, strategy: Any) -> None:
        """Attach to the strategy (after sharding)."""
        self._strategy = strategy

    # --- batches ---------------------------------------------------------------------------------

    def microbatch_lengths(self, batch: Any, lengths_fn: LengthsFn | None = None) -> list[list[int]]:
        """Per microbatch, the length of each of its samples, split as the strategy splits the batch.

        The samples of each microbatch are those of the strategy's microbatch plan for the batch
        (``ElasticPipelineStrategy.split_batch``); with packing, the pieces each packed row holds (a
        slice counts its own tokens; the attention over its context is not priced).

        Raises:
            ValueError: ``lengths_fn`` gives another number of lengths than the batch has samples.
        """
        plan = self._strategy.split_batch(batch).plan
        if hasattr(plan, "pieces"):  # packed microbatches (runtime/packing.py): their pieces' lengths
            return [[n for _, _, n in group] for group in plan.pieces]
        lengths = [int(n) for n in (lengths_fn or sequence_lengths)(batch)]
        if len(lengths) != plan.batch_size:
            raise ValueError(f"`lengths_fn` returned {len(lengths)} lengths for a batch of {plan.batch_size} samples.")
        return [lengths[start:end] for start, end in plan.sample_ranges]

    def replica_values(self, value: Any) -> list[Any]:
        """``value`` of every data-parallel replica, in replica order (a collective when dp > 1)."""
        strategy = self._strategy
        if strategy.layout.data_parallel_size == 1:
            return [value]
        return collectives.all_gather_objects(value, strategy.groups.data_parallel)

    def max_over_ranks(self, value: float) -> float:
        """The largest ``value`` of all processes (a collective), so that every rank uses one number."""
        if self._strategy.world_size == 1:
            return float(value)
        return float(max(collectives.all_gather_objects(float(value), None)))

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
        strategy = self._strategy
        microbatch = strategy.split_batch(batch).microbatches[0]
        return estimate_costs(
            strategy.lightning_module,
            strategy.runner.stack,
            strategy.unit_layout,
            microbatch,
            max_length,
            num_sequences,
            strategy.root_device,
            strategy.memory.static_bytes_per_parameter_byte() - 2.0,
            self.speed,
        )

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
        strategy = self._strategy
        microbatch = strategy.split_batch(batch).microbatches[0]
        params = [p for p in strategy.lightning_module.parameters() if not p.is_meta]
        timings = []
        if strategy.layout.data_parallel_rank == 0:  # replicas hold the same units: one pipeline times them
            timings = time_units(
                strategy.runner,
                "training_step",
                (microbatch, batch_index),
                list(strategy.spans.values()),
                shapes,
                params,
                strategy.root_device,
                repeats,
                warmup,
                strategy.precision_plugin.train_step_context,
            )
        gathered = strategy.gather_from_pipeline(timings)
        estimate = None
        if strategy.global_rank == 0:
            max_length = max(length for _, length in shapes)
            num_sequences = max(count for count, _ in shapes)
            template = self.meta_estimate(batch, max_length, num_sequences)
            estimate = fit_timings([t for part in gathered for t in part], template, holdout_fraction)
        if strategy.world_size > 1:
            estimate = strategy.broadcast(estimate, 0)
        return estimate

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
        strategy = self._strategy
        batch, lengths = self.scan_longest_batch(loader, lengths_fn)
        everyone = self.replica_values(lengths)
        longest = max(everyone, key=lambda ls: (max(ls), sum(ls)))
        self.longest_batch_lengths = list(longest)
        per_microbatch = _split(longest, strategy.num_microbatches)
        if self.estimate is None:
            sizes = [len(mb) for mb in per_microbatch]
            self.use(self.meta_estimate(batch, max(longest), max(sizes)))
        plan = plan_partition(
            self.estimate.cost_model, self.shapes(per_microbatch), strategy.schedule, strategy.pipeline_parallel_size
        )
        log.info(
            "partition='auto': longest batch (%d samples, up to %d long) planned as %s, predicted %.4g s per step",
            len(longest),
            max(longest),
            list(plan.boundaries),
            plan.step_seconds,
        )
        return plan.boundaries


def probe_shapes(max_length: int, num_sequences: int) -> list[tuple[int, int]]:
    """The meta probe's ``(num_sequences, length)`` grid: full, half and quarter length, two sizes."""
    half, quarter = max(2, math.ceil(max_length / 2)), max(2, math.ceil(max_length / 4))
    shapes = [(num_sequences, max_length), (num_sequences, half), (2 * num_sequences, quarter)]
    shapes.append((max(1, num_sequences // 2) if num_sequences > 1 else 2, max_length))
    return list(dict.fromkeys(shapes))


def estimate_costs(
    module: torch.nn.Module,
    stack: BlockStack,
    layout: UnitLayout,
    microbatch: Any,
    max_length: int,
    num_sequences: int,
    device: torch.device,
    optimizer_states_per_parameter: float = 2.0,
    speed: DeviceSpeed | None = None,
) -> CostEstimate:
    """The meta-device cost model of ``module`` (``runtime.cost_probe``) for microbatches like ``microbatch``.

    Args:
        module: the user's module.
        stack: its block stack.
        layout: its units.
        microbatch: an example microbatch (structure and dtypes only).
        max_length: the longest sample length to probe.
        num_sequences: samples per probe microbatch.
        device: the device training runs on (sets the assumed speed and link).
        optimizer_states_per_parameter: optimizer state tensors per trained parameter.
        speed: the assumed device; None: :meth:`DeviceSpeed.for_device`.
    """
    counts = count_units(
        module,
        stack,
        "training_step",
        (microbatch, 0),
        probe_shapes(max_length, num_sequences),
        speed or DeviceSpeed.for_device(device),
    )
    latency, bandwidth = _LINK.get(torch.device(device).type, _LINK["cuda"])
    return fit_cost_model(counts, module, layout, optimizer_states_per_parameter, latency, bandwidth)


def profile_grid(max_length: int, num_sequences: int) -> list[tuple[int, int]]:
    """The profiler's default ``(num_sequences, length)`` grid: 4 lengths down to a quarter, 2 sizes."""
    lengths = dict.fromkeys(max(2, round(max_length * f)) for f in (1.0, 0.75, 0.5, 0.25))
    sizes = dict.fromkeys((num_sequences, max(1, num_sequences // 2)))
    return [(b, n) for n in lengths for b in sizes]


def profile_module(
    module: torch.nn.Module,
    microbatch: Any,
    shapes: Sequence[tuple[int, int]],
    blocks: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    holdout_fraction: float = 0.25,
    optimizer_states_per_parameter: float = 2.0,
) -> CostEstimate:
    """Profile a whole module in this process (no strategy, no process group): time every unit on
    ``shapes``, fit, and return the :class:`CostEstimate` (``lightning-pipe-profile`` uses this).

    Args:
        module: the user's module, on the device to profile.
        microbatch: an example microbatch on that device (values are reused to make the probes).
        shapes: ``(num_sequences, length)`` of every probe microbatch.
        blocks: dotted path of the block stack; None: found automatically.
        repeats: timed runs per shape (median kept).
        warmup: untimed runs per shape first.
        holdout_fraction: share of samples held out to report each fit's error.
        optimizer_states_per_parameter: optimizer state tensors per trained parameter (2: Adam).
    """
    from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks

    stack = find_blocks(module, blocks)
    layout = analyze_units(module, stack)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    runner = StageRunner(module, stack)
    try:
        span = StageSpan(0, 0, stack.num_blocks, stack.num_blocks)
        timings = time_units(
            runner, "training_step", (microbatch, 0), [span], shapes, list(module.parameters()), device, repeats, warmup
        )
    finally:
        runner.remove()
    template = estimate_costs(
        module,
        stack,
        layout,
        microbatch,
        max(n for _, n in shapes),
        max(b for b, _ in shapes),
        device,
        optimizer_states_per_parameter,
    )
    return fit_timings(timings, template, holdout_fraction)


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
