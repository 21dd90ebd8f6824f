"""Estimators HBSA prices layouts with (:class:`~lightning_pipe.planning.hbsa.DepthEstimator`).

- :class:`AggregateDepthEstimator`: the paper's own model (FlexPipe Sec. 5.1): the batch needs
  ``M_peak`` bytes in aggregate and a layout of ``|S|`` stages holds ``M |S|`` (Eq. 3); a memory
  plan closes ``M_peak - M |S|`` exactly (Table 2: ``r + s = M_peak - 80 |S|``); homogeneous
  blocks of equal cost; Eq. 1 for time. Used to reproduce Table 2, where only ``M_peak`` is given.
- :class:`CostModelDepthEstimator`: a :class:`~lightning_pipe.planning.cost_model.CostModel` and
  one batch's microbatches: per-stage times and memory (static bytes plus in-flight activations per
  replica), memory plans that recompute whole stages, migration bytes of the units that change
  devices. Used by the simulated benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.planning.hbsa import NO_MEMORY_PLAN, MemoryPlanCost
from lightning_pipe.planning.layout import Layout, estimate_layout_migration
from lightning_pipe.planning.layout_simulation import (
    NodeTopology,
    StageTables,
    allreduce_seconds,
    estimate_layout_memory,
    estimate_layout_seconds,
    stage_tables,
)


@dataclass
class AggregateDepthEstimator:
    """FlexPipe's aggregate model of one batch (see the module docstring).

    Attributes:
        num_blocks: homogeneous blocks (``|L|``).
        num_devices: devices (``|D|``).
        device_memory: bytes per device (``M``).
        batch_peak_memory: ``M_peak(L, B, mu)`` of the batch, bytes.
        block_seconds: forward + backward seconds of one block for one microbatch.
        num_microbatches: microbatches of the batch (``n_micro``).
        block_gradient_bytes: gradient bytes of one block (all-reduced among a stage's replicas).
        block_state_bytes: parameter and optimizer bytes of one block (what a reconfiguration moves).
        boundary_seconds: seconds to send one microbatch's activation to the next stage.
        bandwidth: bytes per second of all-reduce and migration links.
        latency: seconds per message.
        reconfiguration_overhead: fixed seconds of any reconfiguration (groups, pipeline rewiring).
        static_bytes: ``M_{p,g,o}``, parameters, gradients and optimizer state of the whole model;
            the rest of ``M_peak`` is activations.
        recompute_overhead: extra compute of recomputing every activation, as a share of the step
            (Chen et al., quoted by the paper: full recomputation costs about 33% more computation).
        offload_bytes_per_second: host link bandwidth (PCIe 4.0: 64 GB/s); offloaded bytes go out
            and come back every step, not hidden.
        offload_fraction: share of a memory plan taken by offload (the rest is recomputation).
        max_plan_bytes_per_device: most bytes a memory plan may save per stage's device; beyond it
            the planner grows instead (the paper gives no rule; Table 2's choices put it between
            12.5 and 19.25 GB per 80 GB device, see docs/repartitioning.md).
    """

    num_blocks: int
    num_devices: int
    device_memory: float
    batch_peak_memory: float
    block_seconds: float
    num_microbatches: int
    block_gradient_bytes: float
    block_state_bytes: float
    boundary_seconds: float = 0.0
    bandwidth: float = 300e9
    latency: float = 10e-6
    reconfiguration_overhead: float = 0.0
    static_bytes: float = 0.0
    recompute_overhead: float = 1.0 / 3.0
    offload_bytes_per_second: float = 64e9
    offload_fraction: float = 1.0 / 3.0
    max_plan_bytes_per_device: float = 16e9

    def peak_memory(self) -> float:
        """``M_peak``."""
        return self.batch_peak_memory

    def max_blocks_per_device(self) -> int:
        """The aggregate model has no per-block memory: any stage may take every block."""
        return self.num_blocks

    def fits(self, layout: Layout) -> bool:
        """Eq. 3: ``M_peak <= M |S|``."""
        return self.batch_peak_memory <= self.device_memory * layout.num_stages

    def memory_plan(self, layout: Layout) -> MemoryPlanCost | None:
        """``r + s = M_peak - M |S|``, split by ``offload_fraction``; None beyond the per-device cap.

        Seconds: the recomputed share of the activations times ``recompute_overhead`` of the step,
        plus each stage's share of the offloaded bytes out and back over the host link.
        """
        gap = self.batch_peak_memory - self.device_memory * layout.num_stages
        if gap <= 0:
            return NO_MEMORY_PLAN
        if gap > self.max_plan_bytes_per_device * layout.num_stages:
            return None
        offload = self.offload_fraction * gap
        recompute = gap - offload
        activations = max(self.batch_peak_memory - self.static_bytes, recompute)
        seconds = recompute / activations * self.recompute_overhead * self.step_seconds(layout)
        seconds += 2.0 * offload / layout.num_stages / self.offload_bytes_per_second
        return MemoryPlanCost(recompute, offload, seconds)

    def step_seconds(self, layout: Layout) -> float:
        """Eq. 1 as printed: ``sum_i t_i + (n - |S| + 1) max_j t_j`` plus the slowest all-reduce.

        ``t_i = blocks_i * block_seconds / w_i + boundary_seconds``: a stage's replicas share each
        microbatch's work (the reading of the paper's notes); ``n - |S| + 1`` is clamped at 0 (fewer
        microbatches than stages leave no steady state).
        """
        blocks = layout.blocks_per_stage()
        t = [b * self.block_seconds / w + self.boundary_seconds for b, w in zip(blocks, layout.widths, strict=True)]
        allreduce = max(
            allreduce_seconds(b * self.block_gradient_bytes, w, self.bandwidth, self.latency)
            for b, w in zip(blocks, layout.widths, strict=True)
        )
        return sum(t) + max(self.num_microbatches - layout.num_stages + 1, 0) * max(t) + allreduce

    def migration_seconds(self, old: Layout, new: Layout) -> float:
        """Overhead plus the busiest device's new blocks over ``bandwidth`` (0 when equal)."""
        if old == new:
            return 0.0
        received = [0] * self.num_devices
        for block in range(self.num_blocks):
            before = _holders(old, block)
            for device in _holders(new, block):
                if device not in before:
                    received[device] += 1
        return self.reconfiguration_overhead + max(received) * self.block_state_bytes / self.bandwidth


def _holders(layout: Layout, block: int) -> tuple[int, ...]:
    for stage in range(layout.num_stages):
        if layout.boundaries[stage] <= block < layout.boundaries[stage + 1]:
            return layout.devices_of_stage(stage)
    raise ValueError(f"block {block} is outside {layout.describe()}.")


@dataclass
class CostModelDepthEstimator:
    """Estimators of one batch from a cost model (see the module docstring).

    Attributes:
        cost_model: per-unit costs.
        microbatches: the batch's microbatches (microbatch ``m`` runs on replica ``m % width``).
        num_devices: devices.
        device_memory: bytes per device.
        allow_recompute: memory plans may recompute whole stages.
        include_gradients: migrations move gradients too (inside an accumulation window).
        migration_overhead: fixed seconds of any reconfiguration.
        topology: servers of the devices for the all-reduce bandwidth of each stage
            (:class:`~lightning_pipe.planning.layout_simulation.NodeTopology`); None: the cost
            model's bandwidth everywhere.
    """

    cost_model: CostModel
    microbatches: Sequence[MicrobatchShape]
    num_devices: int
    device_memory: float
    allow_recompute: bool = True
    include_gradients: bool = False
    migration_overhead: float = 0.0
    topology: NodeTopology | None = None
    _tables: dict = field(default_factory=dict, repr=False)

    @property
    def num_blocks(self) -> int:
        """Blocks of the cost model."""
        return self.cost_model.num_blocks

    def tables(self, layout: Layout, recompute: tuple[bool, ...] | None = None) -> StageTables:
        """Stage tables of the layout's boundaries (cached)."""
        key = (layout.boundaries, recompute)
        if key not in self._tables:
            self._tables[key] = stage_tables(self.cost_model, self.microbatches, layout.boundaries, recompute)
        return self._tables[key]

    def peak_memory(self) -> float:
        """Static bytes of all units plus the largest microbatch's saved activations: a lower bound of
        what one pipeline replica needs (in-flight microbatches depend on the layout; ``fits`` is exact)."""
        tables = self.cost_model.tables(self.microbatches)
        return float(tables.static_bytes.sum() + tables.saved_bytes.sum(axis=0).max())

    def minimum_stages(self) -> int:
        """The fewest stages whose uniform layout (even blocks and widths) fits every replica.

        Replaces Algorithm 1's aggregate count (lines 3-6), which ignores that 1F1B's first stages
        hold more microbatches in flight; ``min(num_blocks, num_devices)`` when none fits.
        """
        from lightning_pipe.planning.layout import uniform_layout

        most = min(self.num_blocks, self.num_devices)
        for depth in range(1, most + 1):
            if self.fits(uniform_layout(self.num_blocks, self.num_devices, depth)):
                return depth
        return most

    def max_blocks_per_device(self) -> int:
        """Most blocks whose static bytes fit one device (activations aside)."""
        block_bytes = max(unit.static_bytes for unit in self.cost_model.units[1:-1])
        return max(1, min(self.num_blocks, int(self.device_memory // max(block_bytes, 1.0))))

    def memory(self, layout: Layout, recompute: tuple[bool, ...] | None = None) -> tuple[float, ...]:
        """Predicted peak bytes of the fullest replica of every stage."""
        return estimate_layout_memory(self.tables(layout, recompute), layout)

    def fits(self, layout: Layout) -> bool:
        """Every stage's fullest replica within ``device_memory``."""
        return max(self.memory(layout)) <= self.device_memory

    def step_seconds(self, layout: Layout, recompute: tuple[bool, ...] | None = None) -> float:
        """Eq. 1 estimate (:func:`~lightning_pipe.planning.layout_simulation.estimate_layout_seconds`)."""
        return estimate_layout_seconds(
            self.tables(layout, recompute),
            layout.widths,
            bandwidth=self.cost_model.bandwidth if self.topology is None else self.topology.stage_bandwidths(layout.widths),
            latency=self.cost_model.latency,
        )

    def memory_plan(self, layout: Layout) -> MemoryPlanCost | None:
        """Recompute every stage that does not fit; None if one still does not fit (or recompute is off)."""
        peaks = self.memory(layout)
        if max(peaks) <= self.device_memory:
            return NO_MEMORY_PLAN
        if not self.allow_recompute:
            return None
        flags = tuple(p > self.device_memory for p in peaks)
        planned = self.memory(layout, flags)
        if max(planned) > self.device_memory:
            return None
        saved = float(sum(a - b for a, b, f in zip(peaks, planned, flags, strict=True) if f))
        seconds = self.step_seconds(layout, flags) - self.step_seconds(layout)
        return MemoryPlanCost(saved, 0.0, seconds, tuple(s for s, f in enumerate(flags) if f))

    def migration_seconds(self, old: Layout, new: Layout) -> float:
        """Overhead plus :func:`~lightning_pipe.planning.layout.estimate_layout_migration` (0 when equal)."""
        if old == new:
            return 0.0
        moved = estimate_layout_migration(self.cost_model, old, new, include_gradients=self.include_gradients)
        return self.migration_overhead + moved.seconds
