"""Step time and memory of a heterogeneous layout (stages of different data-parallel widths).

Two estimates of one batch on a :class:`~lightning_pipe.planning.layout.Layout`:

- :func:`simulate_layout`, the judge: an event simulation of every replica. A width-``w`` stage
  hands microbatch ``m`` to replica ``m % w``; each replica runs one action at a time, picking the
  action that can start first among its ready ones (a backward before a forward on ties; at most
  ``num_stages - s`` microbatches in flight on a replica of stage ``s``, 1F1B's limit). A forward waits for the previous stage's forward of the microbatch
  plus the transfer, a backward for the next stage's backward plus the transfer. When all replicas
  of a stage are done, their gradients are joined by a ring all-reduce
  (``2 (w - 1) / w * gradient_bytes / bandwidth + 2 (w - 1) * latency``); the step ends when the
  last stage's all-reduce ends. Memory per replica: the stage's static bytes plus the most saved
  activations alive at once.
- :func:`estimate_layout_seconds`, the planner's closed form (FlexPipe's Eq. 1, made explicit for
  whole microbatches per replica): ``max_j (busiest_j + sum_{i != j} t_i) + max_j allreduce_j``
  where ``t_i`` is stage ``i``'s largest forward + backward + transfer seconds of a microbatch and
  ``busiest_j`` the work of stage ``j``'s busiest replica (its share of the microbatches): the
  bottleneck replica's microbatches plus one microbatch's trip through the other stages. With
  widths 1 and equal microbatches it is the standard 1F1B/GPipe ``sum t + (n - 1) max t``; the
  paper writes ``(n - |S| + 1)`` (a zero-bubble-style approximation), which would make depth free
  for 1F1B-like schedules, whose fill and drain cost ``|S| - 1`` microbatch times. Cheap enough for
  HBSA to price every candidate; its error against the simulation is reported by the benchmark.

Neither models overlap of the all-reduce with backward, nor contention between transfers.

All-reduce links follow an optional :class:`NodeTopology` (the paper's testbed, Sec. 7.1: 4 A100
per server on NVLink at 300 GB/s, servers on InfiniBand at 50 GB/s): a stage whose replicas sit on
consecutive devices of one server all-reduces at the server's bandwidth, one spanning servers at
the inter-server bandwidth (a flat ring is as slow as its slowest link). Without it, every
all-reduce runs at the cost model's bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_pipe.planning.boundaries import unit_ranges
from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.planning.layout import Layout


@dataclass(frozen=True)
class StageTables:
    """Per stage and microbatch costs of a layout's partition for one batch.

    Attributes:
        forward: seconds ``[stage, microbatch]``.
        backward: seconds ``[stage, microbatch]`` (a recomputed stage includes the forward again).
        transfer: seconds to send the stage's output (and back its gradient) ``[stage, microbatch]``.
        saved: bytes kept from forward to backward ``[stage, microbatch]``.
        static: parameter, gradient and optimizer bytes ``[stage]``.
        gradient: gradient bytes all-reduced among the stage's replicas ``[stage]``.
    """

    forward: np.ndarray
    backward: np.ndarray
    transfer: np.ndarray
    saved: np.ndarray
    static: np.ndarray
    gradient: np.ndarray


def stage_tables(
    cost_model: CostModel,
    microbatches: Sequence[MicrobatchShape],
    boundaries: Sequence[int],
    recompute: Sequence[bool] | None = None,
) -> StageTables:
    """Costs of every stage of ``boundaries`` for every microbatch.

    Args:
        cost_model: per-unit costs.
        microbatches: the batch's microbatch shapes.
        boundaries: stage boundaries over blocks.
        recompute: per stage, True to recompute the stage's activations in backward (it then keeps
            only its input: the previous unit's output bytes).
    """
    tables = cost_model.tables(microbatches)
    ranges = unit_ranges(boundaries, cost_model.num_blocks)
    num_stages = len(ranges)
    flags = [False] * num_stages if recompute is None else list(recompute)
    tokens = np.array([mb.tokens for mb in microbatches], dtype=float)
    link = 0.0 if math.isinf(cost_model.bandwidth) else 1.0 / cost_model.bandwidth
    forward, backward, transfer, saved = [], [], [], []
    for stage, (start, stop) in enumerate(ranges):
        f = tables.forward[start:stop].sum(axis=0)
        b = tables.backward[start:stop].sum(axis=0)
        s = tables.saved_bytes[start:stop].sum(axis=0)
        if flags[stage]:
            b = b + f
            s = (cost_model.units[start - 1].output_bytes_per_token * tokens) if start > 0 else np.zeros_like(f)
        out = tables.output_bytes[stop - 1] if stage < num_stages - 1 else np.zeros_like(f)
        forward.append(f)
        backward.append(b)
        saved.append(s)
        transfer.append(np.where(out > 0, cost_model.latency + out * link, 0.0))
    static = np.array([tables.static_bytes[a:b].sum() for a, b in ranges])
    gradient = np.array([sum(u.gradient_bytes for u in cost_model.units[a:b]) for a, b in ranges])
    return StageTables(np.array(forward), np.array(backward), np.array(transfer), np.array(saved), static, gradient)


@dataclass(frozen=True)
class NodeTopology:
    """Devices grouped into servers: all-reduce bandwidth inside one server and across servers.

    Attributes:
        devices_per_node: devices of one server (consecutive device indices).
        intra_bandwidth: bytes per second among devices of one server (NVLink: 300e9).
        inter_bandwidth: bytes per second between servers (InfiniBand: 50e9).
    """

    devices_per_node: int = 4
    intra_bandwidth: float = 300e9
    inter_bandwidth: float = 50e9

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or not self.intra_bandwidth > 0 or not self.inter_bandwidth > 0:
            raise ValueError(
                f"`NodeTopology` needs devices_per_node >= 1 and positive bandwidths, got {self.devices_per_node}, "
                f"{self.intra_bandwidth}, {self.inter_bandwidth}."
            )

    def stage_bandwidths(self, widths: Sequence[int]) -> tuple[float, ...]:
        """All-reduce bandwidth of every stage of ``widths`` (stage ``s`` on the next ``widths[s]`` devices)."""
        bandwidths, first = [], 0
        for width in widths:
            last = first + int(width) - 1
            same = first // self.devices_per_node == last // self.devices_per_node
            bandwidths.append(self.intra_bandwidth if same else self.inter_bandwidth)
            first = last + 1
        return tuple(bandwidths)


def allreduce_seconds(num_bytes: float, width: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``num_bytes`` among ``width`` replicas (0 for one replica)."""
    if width <= 1:
        return 0.0
    volume = 0.0 if math.isinf(bandwidth) else 2.0 * (width - 1) / width * num_bytes / bandwidth
    return volume + 2.0 * (width - 1) * latency


def in_flight_limit(layout: Layout, stage: int) -> int:
    """Microbatches a replica of ``stage`` may hold between forward and backward: 1F1B's
    ``num_stages - stage`` (a replica's microbatch still makes the whole round trip through the
    later stages, however wide they are; it holds fewer only when it runs fewer)."""
    return layout.num_stages - stage


@dataclass(frozen=True)
class LayoutSimulation:
    """What :func:`simulate_layout` found for one batch.

    Attributes:
        step_seconds: end of the last all-reduce (the step's makespan).
        peak_memory: bytes of the fullest replica of every stage.
        busy_seconds: compute seconds of every replica, ``[stage][replica]``.
    """

    step_seconds: float
    peak_memory: tuple[float, ...]
    busy_seconds: tuple[tuple[float, ...], ...]


def simulate_layout(
    cost_model: CostModel,
    microbatches: Sequence[MicrobatchShape],
    layout: Layout,
    *,
    recompute: Sequence[bool] | None = None,
    allreduce_bandwidth: float | None = None,
    allreduce_latency: float | None = None,
    topology: NodeTopology | None = None,
) -> LayoutSimulation:
    """Event simulation of one batch on ``layout`` (see the module docstring).

    Args:
        cost_model: per-unit costs.
        microbatches: the batch's microbatch shapes, in order (microbatch ``m`` goes to replica
            ``m % width`` of every stage).
        layout: boundaries and widths.
        recompute: per stage, recompute activations in backward.
        allreduce_bandwidth: bytes per second of the all-reduce links; default the cost model's.
        allreduce_latency: seconds per all-reduce message; default the cost model's latency.
        topology: servers of the devices; when given, each stage's all-reduce runs at its
            :meth:`NodeTopology.stage_bandwidths` (``allreduce_bandwidth`` is then ignored).

    Raises:
        ValueError: if the layout does not match the model.
        RuntimeError: if the simulation stalls (a bug: the greedy order never deadlocks).
    """
    if layout.num_blocks != cost_model.num_blocks:
        raise ValueError(f"layout over {layout.num_blocks} blocks for a model of {cost_model.num_blocks} blocks.")
    tables = stage_tables(cost_model, microbatches, layout.boundaries, recompute)
    num_stages, count = layout.num_stages, len(microbatches)
    forward_end = np.full((num_stages, count), np.nan)
    backward_end = np.full((num_stages, count), np.nan)
    free_at = [[0.0] * w for w in layout.widths]
    busy = [[0.0] * w for w in layout.widths]
    alive = [[0.0] * w for w in layout.widths]
    peak = [[0.0] * w for w in layout.widths]
    pending_forward = [[[m for m in range(count) if m % w == r] for r in range(w)] for w in layout.widths]
    open_microbatches: list[list[list[int]]] = [[[] for _ in range(w)] for w in layout.widths]
    limits = [in_flight_limit(layout, s) for s in range(num_stages)]
    remaining = 2 * num_stages * count
    while remaining:
        best: tuple[float, int, int, int, int, int] | None = None  # (start, kind, stage, replica, mb, -)
        for stage in range(num_stages):
            for replica in range(layout.widths[stage]):
                free = free_at[stage][replica]
                for m in open_microbatches[stage][replica]:
                    if stage == num_stages - 1:
                        ready = forward_end[stage, m]
                    else:
                        after = backward_end[stage + 1, m]
                        if math.isnan(after):
                            continue
                        ready = after + tables.transfer[stage, m]
                    key = (max(free, ready), 0, stage, replica, m, 0)
                    if best is None or key < best:
                        best = key
                if len(open_microbatches[stage][replica]) < limits[stage]:
                    for m in pending_forward[stage][replica]:
                        if stage == 0:
                            ready = 0.0
                        else:
                            before = forward_end[stage - 1, m]
                            if math.isnan(before):
                                continue
                            ready = before + tables.transfer[stage - 1, m]
                        key = (max(free, ready), 1, stage, replica, m, 0)
                        if best is None or key < best:
                            best = key
        if best is None:
            raise RuntimeError(f"layout simulation stalled with {remaining} actions left on {layout.describe()}.")
        start, kind, stage, replica, m, _ = best
        if kind == 1:
            end = start + tables.forward[stage, m]
            forward_end[stage, m] = end
            pending_forward[stage][replica].remove(m)
            open_microbatches[stage][replica].append(m)
            alive[stage][replica] += tables.saved[stage, m]
            peak[stage][replica] = max(peak[stage][replica], alive[stage][replica])
            busy[stage][replica] += tables.forward[stage, m]
        else:
            end = start + tables.backward[stage, m]
            backward_end[stage, m] = end
            open_microbatches[stage][replica].remove(m)
            alive[stage][replica] -= tables.saved[stage, m]
            busy[stage][replica] += tables.backward[stage, m]
        free_at[stage][replica] = end
        remaining -= 1
    bandwidth = cost_model.bandwidth if allreduce_bandwidth is None else allreduce_bandwidth
    bandwidths = (bandwidth,) * num_stages if topology is None else topology.stage_bandwidths(layout.widths)
    latency = cost_model.latency if allreduce_latency is None else allreduce_latency
    step = 0.0
    for stage, width in enumerate(layout.widths):
        done = max(free_at[stage])
        step = max(step, done + allreduce_seconds(float(tables.gradient[stage]), width, bandwidths[stage], latency))
    return LayoutSimulation(
        float(step),
        tuple(float(tables.static[s] + max(peak[s])) for s in range(num_stages)),
        tuple(tuple(b) for b in busy),
    )


def estimate_layout_seconds(
    tables: StageTables,
    widths: Sequence[int],
    *,
    bandwidth: float | Sequence[float],
    latency: float,
) -> float:
    """FlexPipe's Eq. 1 for a heterogeneous layout (see the module docstring).

    Args:
        tables: :func:`stage_tables` of the layout's boundaries.
        widths: replicas per stage.
        bandwidth: bytes per second of the all-reduce links, one value or one per stage
            (:meth:`NodeTopology.stage_bandwidths`).
        latency: seconds per all-reduce message.
    """
    work = tables.forward + tables.backward + tables.transfer  # [stage, microbatch]
    per_microbatch = work.max(axis=1)  # [stage]: the longest microbatch's trip
    total = float(per_microbatch.sum())
    slowest = 0.0
    for stage, width in enumerate(widths):
        busiest = max(float(work[stage, replica::width].sum()) for replica in range(width))
        slowest = max(slowest, busiest + total - float(per_microbatch[stage]))
    bandwidths = (bandwidth,) * len(widths) if isinstance(bandwidth, (int, float)) else tuple(bandwidth)
    allreduce = max(
        allreduce_seconds(float(g), int(w), b, latency)
        for g, w, b in zip(tables.gradient, widths, bandwidths, strict=True)
    )
    return slowest + allreduce


def estimate_layout_memory(tables: StageTables, layout: Layout) -> tuple[float, ...]:
    """Predicted peak bytes of the fullest replica of every stage (static + saved activations).

    A replica holds at most :func:`in_flight_limit` microbatches at once; the estimate charges the
    largest ones among those it runs (an upper bound of :func:`simulate_layout`'s peak).
    """
    peaks = []
    for stage, width in enumerate(layout.widths):
        limit = in_flight_limit(layout, stage)
        worst = 0.0
        for replica in range(width):
            saved = sorted(tables.saved[stage, replica::width].tolist(), reverse=True)
            worst = max(worst, sum(saved[:limit]))
        peaks.append(float(tables.static[stage] + worst))
    return tuple(peaks)
