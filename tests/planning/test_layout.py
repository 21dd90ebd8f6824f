"""Layouts with per-stage widths: validation, device numbering, migration, heterogeneous simulation."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_pipe.planning import MicrobatchShape, gpt_1_3b, random_partition
from lightning_pipe.planning.depth_estimators import CostModelDepthEstimator
from lightning_pipe.planning.layout import Layout, estimate_layout_migration, even_widths, uniform_layout
from lightning_pipe.planning.layout_simulation import (
    NodeTopology,
    allreduce_seconds,
    estimate_layout_memory,
    simulate_layout,
    stage_tables,
)
from tests.planning.helpers import random_cost_model, random_microbatches


def test_layout_devices_and_validation() -> None:
    layout = Layout((0, 3, 5, 8), (2, 1, 3))
    assert layout.num_stages == 3 and layout.num_devices == 6 and layout.num_blocks == 8
    assert layout.devices_of_stage(0) == (0, 1) and layout.devices_of_stage(2) == (3, 4, 5)
    assert [layout.stage_of_device(d) for d in range(6)] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert [layout.replica_of(2, m) for m in range(5)] == [0, 1, 2, 0, 1]
    assert layout.blocks_per_stage() == (3, 2, 3)
    with pytest.raises(ValueError, match="one entry per stage"):
        Layout((0, 4, 8), (1,))
    with pytest.raises(ValueError, match=">= 1"):
        Layout((0, 4, 8), (1, 0))
    with pytest.raises(ValueError, match="not in a layout of 6 devices"):
        layout.stage_of_device(6)
    assert even_widths(8, 3) == (3, 3, 2) and even_widths(16, 5) == (4, 3, 3, 3, 3)
    assert uniform_layout(24, 4, 2) == Layout((0, 12, 24), (2, 2))


def test_migration_moves_what_devices_newly_hold() -> None:
    model = gpt_1_3b()
    deep = uniform_layout(24, 4, 4)
    assert estimate_layout_migration(model, deep, deep).seconds == 0.0
    flat = Layout((0, 24), (4,))
    to_flat = estimate_layout_migration(model, deep, flat)
    state = [u.parameter_bytes + u.optimizer_bytes for u in model.units]
    # every device receives every unit it did not hold and sends its own to the 3 others
    held = [sum(state[0:7]), sum(state[7:13]), sum(state[13:19]), sum(state[19:26])]
    expected = max(max(sum(state) - h for h in held), max(3 * h for h in held))
    assert to_flat.busiest_device_bytes == pytest.approx(expected)
    assert to_flat.bytes_moved == pytest.approx(3 * sum(state))
    # shrinking a data-parallel group back to a deep pipeline moves nothing: replicas already hold it all
    assert estimate_layout_migration(model, flat, deep).bytes_moved == 0.0
    with_grads = estimate_layout_migration(model, deep, flat, include_gradients=True)
    assert with_grads.bytes_moved > to_flat.bytes_moved


def test_simulation_of_a_single_stage_and_of_pure_data_parallel(rng: np.random.Generator) -> None:
    model = random_cost_model(rng, 6)
    microbatches = random_microbatches(rng, 6)
    tables = stage_tables(model, microbatches, (0, 6))
    one = simulate_layout(model, microbatches, Layout((0, 6), (1,)))
    assert one.step_seconds == pytest.approx(float((tables.forward + tables.backward).sum()))
    three = simulate_layout(model, microbatches, Layout((0, 6), (3,)))
    per_replica = [(tables.forward[0, r::3] + tables.backward[0, r::3]).sum() for r in range(3)]
    reduce = allreduce_seconds(float(tables.gradient[0]), 3, model.bandwidth, model.latency)
    assert three.step_seconds == pytest.approx(max(per_replica) + reduce)
    assert [sum(b) for b in three.busy_seconds] == pytest.approx([sum(per_replica)])


def test_topology_gives_each_stage_its_servers_bandwidth(rng: np.random.Generator) -> None:
    """A stage inside one server all-reduces over NVLink, one across servers over InfiniBand; the
    simulation and the planner's estimate both use it."""
    topology = NodeTopology(devices_per_node=4, intra_bandwidth=300e9, inter_bandwidth=50e9)
    assert topology.stage_bandwidths((4, 4)) == (300e9, 300e9)
    assert topology.stage_bandwidths((2, 4, 2)) == (300e9, 50e9, 300e9)
    assert topology.stage_bandwidths((8,)) == (50e9,)
    with pytest.raises(ValueError, match="devices_per_node >= 1"):
        NodeTopology(devices_per_node=0)
    model = random_cost_model(rng, 6)
    microbatches = random_microbatches(rng, 6)
    tables = stage_tables(model, microbatches, (0, 6))
    work = max((tables.forward[0, r::4] + tables.backward[0, r::4]).sum() for r in range(4))
    for width, bandwidth in ((4, 300e9), (8, 50e9)):
        small = NodeTopology(4, bandwidth, bandwidth)
        simulated = simulate_layout(model, microbatches, Layout((0, 6), (width,)), topology=topology)
        expected = simulate_layout(model, microbatches, Layout((0, 6), (width,)), allreduce_bandwidth=bandwidth)
        assert simulated.step_seconds == pytest.approx(expected.step_seconds)
        estimator = CostModelDepthEstimator(model, microbatches, width, float("inf"), topology=topology)
        same = CostModelDepthEstimator(model, microbatches, width, float("inf"), topology=small)
        assert estimator.step_seconds(Layout((0, 6), (width,))) == pytest.approx(same.step_seconds(Layout((0, 6), (width,))))
    inside = simulate_layout(model, microbatches, Layout((0, 6), (4,)), topology=topology).step_seconds
    assert inside == pytest.approx(work + allreduce_seconds(float(tables.gradient[0]), 4, 300e9, model.latency))


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_uniform_costs_give_the_1f1b_makespan(num_stages: int) -> None:
    model = gpt_1_3b(latency=0.0, bandwidth=float("inf"))
    microbatches = [MicrobatchShape.from_lengths([512] * 2)] * 8
    layout = Layout((0, *(24 // num_stages * (s + 1) for s in range(num_stages))), (1,) * num_stages)
    tables = stage_tables(model, microbatches, layout.boundaries)
    # only uniform when the pre and post units are negligible: compare with the slowest stage
    per_stage = (tables.forward[:, 0] + tables.backward[:, 0]).max()
    result = simulate_layout(model, microbatches, layout)
    assert result.step_seconds <= (8 + num_stages - 1) * per_stage * (1 + 1e-9)
    assert result.step_seconds >= 8 * per_stage * (1 - 1e-9)


def test_random_layouts_never_stall_and_respect_bounds(rng: np.random.Generator) -> None:
    for _ in range(20):
        num_blocks = int(rng.integers(3, 10))
        num_stages = int(rng.integers(1, min(num_blocks, 4) + 1))
        widths = tuple(int(w) for w in rng.integers(1, 4, num_stages))
        model = random_cost_model(rng, num_blocks)
        microbatches = random_microbatches(rng, int(rng.integers(1, 9)))
        layout = Layout(random_partition(num_blocks, num_stages, rng), widths)
        result = simulate_layout(model, microbatches, layout)
        tables = stage_tables(model, microbatches, layout.boundaries)
        # no replica can finish before its own work, no microbatch before its path through every stage
        assert result.step_seconds >= max(max(b) for b in result.busy_seconds) * (1 - 1e-9)
        path = (tables.forward + tables.backward).sum(axis=0) + 2 * tables.transfer.sum(axis=0)
        assert result.step_seconds >= path.max() * (1 - 1e-9)
        # the planner's memory estimate is an upper bound of the simulated peak
        assert all(
            e >= s * (1 - 1e-9) for e, s in zip(estimate_layout_memory(tables, layout), result.peak_memory, strict=True)
        )


def test_a_wider_stage_holds_fewer_activations(rng: np.random.Generator) -> None:
    model = random_cost_model(rng, 8, bandwidth=float("inf"))  # all-reduce nearly free: widths pay off
    microbatches = random_microbatches(rng, 8)
    narrow = simulate_layout(model, microbatches, Layout((0, 4, 8), (1, 1)))
    wide = simulate_layout(model, microbatches, Layout((0, 4, 8), (2, 2)))
    assert wide.peak_memory[0] <= narrow.peak_memory[0]
    assert wide.step_seconds < narrow.step_seconds


def test_plot_layouts_draws_stages_and_widths(tmp_path):
    from lightning_pipe.planning.render import plot_layouts

    path = plot_layouts([0, 1, 2], [(0, 6), (0, 3, 6), (0, 2, 4, 6)], [(4,), (2, 2), (2, 1, 1)], tmp_path / "l.png")
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="one width per stage"):
        plot_layouts([0], [(0, 3, 6)], [(4,)], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="one layout per step"):
        plot_layouts([0, 1], [(0, 6)], [(4,)], tmp_path / "bad.png")
