"""What moving to a new partition costs: bytes that change rank, and the seconds that takes.

Live migration (``runtime.migration``) moves every unit whose rank changes: its parameters and
optimizer state (and its gradients when they are accumulated across steps). Transfers between
different pairs of ranks run in parallel over full-duplex links, so the time is set by the busiest
rank: ``latency + max over ranks of max(bytes sent, bytes received) / bandwidth``. Measured
migration times correct this prediction through :class:`MigrationCalibration`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.planning.boundaries import check_boundaries, unit_ranges
from lightning_pipe.planning.cost_model import CostModel


@dataclass(frozen=True)
class MigrationEstimate:
    """Predicted cost of moving from one partition to another.

    Attributes:
        moved_units: indices of the units (``pre`` is 0) whose rank changes.
        bytes_moved: total bytes sent over all ranks.
        busiest_rank_bytes: the largest of any rank's bytes sent or bytes received.
        seconds: predicted wall-clock seconds of the migration (0 when nothing moves).
    """

    moved_units: tuple[int, ...]
    bytes_moved: float
    busiest_rank_bytes: float
    seconds: float


def _unit_ranks(cost_model: CostModel, boundaries: Sequence[int], stage_to_rank: Sequence[int]) -> list[int]:
    bounds = check_boundaries(boundaries, cost_model.num_blocks, len(stage_to_rank))
    ranks = [0] * len(cost_model.units)
    for stage, (start, stop) in enumerate(unit_ranges(bounds, cost_model.num_blocks)):
        for unit in range(start, stop):
            ranks[unit] = stage_to_rank[stage]
    return ranks


def estimate_migration(
    cost_model: CostModel,
    old_boundaries: Sequence[int],
    new_boundaries: Sequence[int],
    stage_to_rank: Sequence[int] | None = None,
    *,
    include_gradients: bool = False,
    bandwidth: float | None = None,
    latency: float | None = None,
) -> MigrationEstimate:
    """Bytes and seconds to move from ``old_boundaries`` to ``new_boundaries``.

    Args:
        cost_model: per-unit parameter, gradient and optimizer-state bytes.
        old_boundaries: partition in use, over blocks.
        new_boundaries: partition to move to (same number of stages).
        stage_to_rank: rank of every stage (``Program.stage_to_rank``); default one stage per rank.
        include_gradients: also move gradients (when they are accumulated across optimizer steps;
            after an optimizer step they are zero and need not travel).
        bandwidth: bytes per second of a link; default the cost model's.
        latency: seconds per migration; default the cost model's point-to-point latency.

    Returns:
        The :class:`MigrationEstimate`.

    Raises:
        ValueError: if the partitions are invalid or have different numbers of stages.
    """
    num_stages = len(old_boundaries) - 1
    if len(new_boundaries) - 1 != num_stages:
        raise ValueError(
            f"`old_boundaries` {list(old_boundaries)} and `new_boundaries` {list(new_boundaries)} have different "
            "numbers of stages; migration keeps the number of stages."
        )
    placement = list(range(num_stages)) if stage_to_rank is None else list(stage_to_rank)
    old = _unit_ranks(cost_model, old_boundaries, placement)
    new = _unit_ranks(cost_model, new_boundaries, placement)
    num_ranks = max(placement) + 1
    sent = [0.0] * num_ranks
    received = [0.0] * num_ranks
    moved = []
    for index, unit in enumerate(cost_model.units):
        if old[index] == new[index]:
            continue
        size = unit.parameter_bytes + unit.optimizer_bytes + (unit.gradient_bytes if include_gradients else 0.0)
        sent[old[index]] += size
        received[new[index]] += size
        moved.append(index)
    link = cost_model.bandwidth if bandwidth is None else bandwidth
    if not link > 0:
        raise ValueError(f"`bandwidth` must be > 0 bytes per second, got {link}.")
    busiest = max(max(sent), max(received))
    seconds = 0.0
    if moved:
        seconds = (cost_model.latency if latency is None else latency) + (0.0 if math.isinf(link) else busiest / link)
    return MigrationEstimate(tuple(moved), float(sum(sent)), float(busiest), float(seconds))


@dataclass(frozen=True)
class MigrationCalibration:
    """Running correction of predicted migration seconds by measured ones.

    Keeps an exponential moving average of ``measured / predicted``; :meth:`predict` scales a
    fresh :class:`MigrationEstimate` by it. Immutable: :meth:`update` returns a new calibration.

    Attributes:
        ratio: current average of measured over predicted seconds (1.0 before any measurement).
        count: number of migrations measured.
        momentum: weight of the past in the average (0: only the last measurement counts).
    """

    ratio: float = 1.0
    count: int = 0
    momentum: float = 0.8

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1), got {self.momentum}.")

    def update(self, predicted_seconds: float, measured_seconds: float) -> MigrationCalibration:
        """Fold in one measured migration (ignored when nothing was predicted to move)."""
        if measured_seconds < 0:
            raise ValueError(f"`measured_seconds` must be >= 0, got {measured_seconds}.")
        if not predicted_seconds > 0:
            return self
        sample = measured_seconds / predicted_seconds
        ratio = sample if self.count == 0 else self.momentum * self.ratio + (1 - self.momentum) * sample
        return MigrationCalibration(ratio, self.count + 1, self.momentum)

    def predict(self, estimate: MigrationEstimate) -> float:
        """Calibrated seconds for ``estimate``."""
        return estimate.seconds * self.ratio
