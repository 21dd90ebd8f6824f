"""Layouts of elastic depth: stage boundaries plus a data-parallel width per stage (FlexPipe).

A :class:`Layout` puts ``num_stages`` contiguous block ranges on ``sum(widths)`` devices: stage ``s``
owns blocks ``boundaries[s] .. boundaries[s + 1] - 1`` (``pre`` with stage 0, ``post`` with the last)
and runs on ``widths[s]`` replicas. Devices are taken in order (the paper's ``Partition(D, j)`` takes
a prefix of the remaining devices; in rank order that keeps a stage's replicas on neighbouring,
usually same-node, devices): stage ``s`` gets devices ``offset_s .. offset_s + widths[s] - 1``.
``(4, 4)`` is two stages of four replicas on 8 devices, ``(1, 1, 2, 1, 1, 1, 1)`` seven stages
where the third has two replicas (FlexPipe, Table 2).

A width-``w`` stage splits the microbatches it receives between its replicas, microbatch ``m`` to
replica ``m % w`` (:meth:`Layout.replica_of`), and joins their gradients with an all-reduce.

Also here: what moving from one layout to another costs (:func:`estimate_layout_migration`): every
device receives the units it will hold and does not hold yet (parameters and optimizer state, and
gradients inside an accumulation window) from a device that holds them now.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.planning.boundaries import check_boundaries, unit_ranges
from lightning_pipe.planning.cost_model import CostModel


@dataclass(frozen=True)
class Layout:
    """Stage boundaries over blocks and the data-parallel width of every stage.

    Attributes:
        boundaries: ``0 = b_0 < ... < b_S = num_blocks`` (see :mod:`.boundaries`).
        widths: replicas of every stage, each >= 1; ``sum(widths)`` devices in all.
    """

    boundaries: tuple[int, ...]
    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if len(self.widths) != len(self.boundaries) - 1:
            raise ValueError(
                f"`widths` {list(self.widths)} must have one entry per stage of `boundaries` "
                f"{list(self.boundaries)} ({len(self.boundaries) - 1} stages)."
            )
        if min(self.widths, default=0) < 1:
            raise ValueError(f"`widths` must all be >= 1, got {list(self.widths)}.")
        check_boundaries(self.boundaries, self.boundaries[-1] if self.boundaries else 0)

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages (the depth)."""
        return len(self.widths)

    @property
    def num_devices(self) -> int:
        """Devices the layout uses: the sum of the widths."""
        return sum(self.widths)

    @property
    def num_blocks(self) -> int:
        """Blocks the boundaries cover."""
        return self.boundaries[-1]

    def blocks_per_stage(self) -> tuple[int, ...]:
        """Number of blocks of every stage."""
        return tuple(b - a for a, b in zip(self.boundaries, self.boundaries[1:], strict=False))

    def devices_of_stage(self, stage: int) -> tuple[int, ...]:
        """Devices (ranks) running ``stage``, in replica order."""
        start = sum(self.widths[:stage])
        return tuple(range(start, start + self.widths[stage]))

    def stage_of_device(self, device: int) -> tuple[int, int]:
        """``(stage, replica)`` of ``device``.

        Raises:
            ValueError: if the layout has no such device.
        """
        start = 0
        for stage, width in enumerate(self.widths):
            if device < start + width:
                return stage, device - start
            start += width
        raise ValueError(f"device {device} is not in a layout of {self.num_devices} devices.")

    def replica_of(self, stage: int, microbatch: int) -> int:
        """Replica of ``stage`` that runs ``microbatch`` (round robin)."""
        return microbatch % self.widths[stage]

    def describe(self) -> str:
        """Short text form, e.g. ``"3 stages (3,3,2) [0, 32, 64, 96]"``."""
        return f"{self.num_stages} stages ({','.join(map(str, self.widths))}) {list(self.boundaries)}"


def even_widths(num_devices: int, num_stages: int) -> tuple[int, ...]:
    """Widths as equal as possible, the wider stages first: ``even_widths(8, 3) == (3, 3, 2)``.

    Raises:
        ValueError: if ``num_stages`` is not in ``1 .. num_devices``.
    """
    if not 1 <= num_stages <= num_devices:
        raise ValueError(f"`num_stages` must be in 1..{num_devices} (the devices), got {num_stages}.")
    base, extra = divmod(num_devices, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


def uniform_layout(num_blocks: int, num_devices: int, num_stages: int) -> Layout:
    """Blocks and devices spread as evenly as possible over ``num_stages`` stages."""
    from lightning_pipe.planning.boundaries import uniform_partition

    return Layout(uniform_partition(num_blocks, num_stages), even_widths(num_devices, num_stages))


def unit_holders(layout: Layout, num_blocks: int) -> list[tuple[int, ...]]:
    """Devices holding every unit (``pre`` is unit 0, ``post`` the last) under ``layout``."""
    holders: list[tuple[int, ...]] = [()] * (num_blocks + 2)
    for stage, (start, stop) in enumerate(unit_ranges(layout.boundaries, num_blocks)):
        for unit in range(start, stop):
            holders[unit] = layout.devices_of_stage(stage)
    return holders


@dataclass(frozen=True)
class LayoutMigration:
    """Predicted cost of moving between two layouts.

    Attributes:
        bytes_moved: total bytes sent over all devices.
        busiest_device_bytes: the largest bytes any device sends or receives.
        seconds: ``latency + busiest_device_bytes / bandwidth`` (0 when nothing moves).
    """

    bytes_moved: float
    busiest_device_bytes: float
    seconds: float


def estimate_layout_migration(
    cost_model: CostModel,
    old: Layout,
    new: Layout,
    *,
    include_gradients: bool = False,
    bandwidth: float | None = None,
    latency: float | None = None,
) -> LayoutMigration:
    """Bytes and seconds to move from layout ``old`` to layout ``new`` (same devices).

    Every device that will hold a unit it does not hold now receives it (parameters and optimizer
    state; gradients too with ``include_gradients``). The senders are the old holders, taken in
    turn so that the load spreads over the replicas (replicas hold identical copies). Transfers
    between different pairs run in parallel over full-duplex links, so the busiest device sets the
    time. Devices that drop a unit send nothing (a shrinking data-parallel group frees memory).

    Raises:
        ValueError: if the layouts cover different blocks or devices.
    """
    if old.num_blocks != new.num_blocks or old.num_blocks != cost_model.num_blocks:
        raise ValueError(
            f"layouts over {old.num_blocks} and {new.num_blocks} blocks for a model of {cost_model.num_blocks} blocks."
        )
    if old.num_devices != new.num_devices:
        raise ValueError(f"layouts on {old.num_devices} and {new.num_devices} devices; regrouping keeps the devices.")
    num_blocks = cost_model.num_blocks
    before, after = unit_holders(old, num_blocks), unit_holders(new, num_blocks)
    sent = [0.0] * old.num_devices
    received = [0.0] * old.num_devices
    for index, unit in enumerate(cost_model.units):
        size = unit.parameter_bytes + unit.optimizer_bytes + (unit.gradient_bytes if include_gradients else 0.0)
        sources = before[index]
        targets = [device for device in after[index] if device not in sources]
        for turn, device in enumerate(targets):
            sent[sources[turn % len(sources)]] += size
            received[device] += size
    busiest = max(max(sent), max(received))
    link = cost_model.bandwidth if bandwidth is None else bandwidth
    if not link > 0:
        raise ValueError(f"`bandwidth` must be > 0 bytes per second, got {link}.")
    seconds = 0.0
    if busiest > 0:
        seconds = (cost_model.latency if latency is None else latency) + (0.0 if math.isinf(link) else busiest / link)
    return LayoutMigration(float(sum(sent)), float(busiest), float(seconds))


def check_layouts(layouts: Sequence[Layout], num_blocks: int, num_devices: int) -> None:
    """Raise ``ValueError`` naming the first layout that does not cover ``num_blocks`` on ``num_devices``."""
    for layout in layouts:
        if layout.num_blocks != num_blocks or layout.num_devices != num_devices:
            raise ValueError(
                f"layout {layout.describe()} covers {layout.num_blocks} blocks on {layout.num_devices} devices, "
                f"expected {num_blocks} blocks on {num_devices} devices."
            )
