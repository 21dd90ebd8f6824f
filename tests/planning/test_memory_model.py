"""Memory plans, sizes and the memory model (pure, milliseconds)."""

from __future__ import annotations

import pytest

from lightning_pipe.planning.cost_model import LinearCost, MicrobatchShape
from lightning_pipe.planning.memory_model import (
    MemoryPlan,
    MemoryProfile,
    StageMemory,
    UnitMemory,
    fit_linear,
    parse_size,
    predict_memory,
    stage_footprints,
)
from lightning_pipe.schedules import ActionCosts, resolve_schedule, simulate


def toy_profile(num_blocks: int = 8, none: float = 34.0, full: float = 2.0, keep: float = 4.0) -> MemoryProfile:
    """Blocks saving ``none``/``full``/``keep`` bytes per token, ``pre`` 1 and ``post`` 10 per token."""
    block = {"none": LinearCost(0, none), "full": LinearCost(0, full), "keep_attention": LinearCost(0, keep)}
    units = [UnitMemory("pre", {"none": LinearCost(0, 1.0)}, parameter_bytes=100, parameters=25, hidden=4)]
    units += [UnitMemory(f"block.{i}", block, parameter_bytes=100, parameters=25, hidden=4) for i in range(num_blocks)]
    units += [UnitMemory("post", {"none": LinearCost(0, 10.0)}, parameter_bytes=100, parameters=25, hidden=4)]
    return MemoryProfile(tuple(units), static_bytes_per_parameter_byte=4.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("40GiB", 40 * 2**30), ("1.5 GB", 1_500_000_000), ("512MiB", 512 * 2**20), (1024, 1024), ("7", 7), ("2kib", 2048)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["40 parsecs", "GiB", "-3GiB", "", float("inf")])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_block_modes_counts_every_and_offload():
    assert StageMemory(full=2).block_modes(4) == ("full", "full", "none", "none")
    assert StageMemory(full=1, keep_attention=1, offload=1).block_modes(4) == ("full", "keep_attention", "offload", "none")
    assert StageMemory(full=None, every=2).block_modes(5) == ("full", "none", "full", "none", "full")
    assert StageMemory(full=None, every=2, offload=None).block_modes(4) == ("full", "offload", "full", "offload")
    assert StageMemory(keep_attention=None).block_modes(3) == ("keep_attention",) * 3
    assert StageMemory(full=9).block_modes(2) == ("full", "full")  # clipped to what the stage has
    assert StageMemory().block_modes(3) == ("none",) * 3


def test_plan_lookup_and_round_trip():
    plan = MemoryPlan(StageMemory(full=1), {1: StageMemory(offload=2)}, {(1, 3): StageMemory(keep_attention=None, mlp_chunk_size=8)})
    assert plan.choice(0, 0) == StageMemory(full=1)
    assert plan.choice(1, 0) == StageMemory(offload=2)
    assert plan.choice(1, 3).keep_attention is None
    assert MemoryPlan.from_dict(plan.to_dict()) == plan
    assert MemoryPlan.from_dict({}) == MemoryPlan() and MemoryPlan().is_empty
    assert plan.uses("offload") and plan.uses("full") and plan.uses("keep_attention")


def test_plan_from_options():
    assert MemoryPlan.from_options("full").default == StageMemory(full=None)
    assert MemoryPlan.from_options(3).default == StageMemory(full=None, every=3)
    assert MemoryPlan.from_options("none", offload=True).default == StageMemory(offload=None)
    assert MemoryPlan.from_options("keep_attention", mlp_chunk_size=64).default.mlp_chunk_size == 64
    with pytest.raises(ValueError, match="recompute='bogus'"):
        MemoryPlan.from_options("bogus")
    with pytest.raises(ValueError, match="Unknown memory plan keys"):
        MemoryPlan.from_dict({"stage": {}})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"])
def test_prediction_without_transients_matches_the_simulator(schedule):
    """With no recompute or offload the predicted peak is the simulator's peak memory."""
    family = resolve_schedule(schedule)
    program = family.build(4, 8)
    num_stages = program.num_stages
    profile = toy_profile(num_blocks=num_stages * 2)
    boundaries = tuple(range(0, num_stages * 2 + 1, 2))
    shapes = [MicrobatchShape.from_lengths([10 * (m + 1)]) for m in range(8)]
    footprints = stage_footprints(profile, boundaries, shapes, MemoryPlan())
    costs = ActionCosts.uniform(num_stages, 8)
    costs = ActionCosts(
        forward=costs.forward, backward=costs.backward,
        saved_bytes=tuple(tuple(f.saved for f in row) for row in footprints),
        static_bytes=tuple(profile.static_bytes(boundaries)),
    )
    predicted = predict_memory(program, boundaries, shapes, MemoryPlan(), profile)
    assert predicted.peak_bytes == pytest.approx(simulate(program, costs).peak_memory)
    assert predicted.saved_peak_bytes == pytest.approx([p - s for p, s in zip(predicted.peak_bytes, predicted.static_bytes)])


def test_recompute_and_offload_lower_the_peak_by_the_model():
    program = resolve_schedule("1f1b").build(2, 4)
    profile = toy_profile(num_blocks=4)
    shapes = [MicrobatchShape.from_lengths([100])] * 4
    boundaries = (0, 2, 4)
    none = predict_memory(program, boundaries, shapes, MemoryPlan(), profile)
    full = predict_memory(program, boundaries, shapes, MemoryPlan.from_options("full"), profile)
    offload = predict_memory(program, boundaries, shapes, MemoryPlan.from_options("none", offload=True), profile)
    # rank 0 holds 2 microbatches in flight: pre (1/token) + 2 blocks, 100 tokens each
    assert none.saved_peak_bytes[0] == pytest.approx(2 * 100 * (1 + 2 * 34))
    assert full.saved_peak_bytes[0] == pytest.approx(2 * 100 * (1 + 2 * 2))
    assert full.peak_bytes[0] == pytest.approx(full.static_bytes[0] + full.saved_peak_bytes[0] + 100 * 32)  # one block rebuilt
    assert offload.saved_peak_bytes[0] == pytest.approx(2 * 100)
    assert offload.host_peak_bytes[0] == pytest.approx(2 * 100 * 2 * 34)
    assert full.static_bytes == none.static_bytes == (300 * 4, 300 * 4)


def test_fit_linear_recovers_coefficients():
    truth = LinearCost(16.0, 2096.0, 0.5)
    points = [(s, truth.evaluate(s)) for s in (MicrobatchShape.from_lengths(x) for x in ([16], [8], [16, 16], [5]))]
    fitted = fit_linear(points)
    assert fitted.per_token == pytest.approx(2096.0, rel=1e-6)
    assert fitted.per_squared_length == pytest.approx(0.5, rel=1e-6)
    assert fitted.constant == pytest.approx(16.0, rel=1e-4)
    # one point: a pure per-token rate
    assert fit_linear([(MicrobatchShape.from_lengths([10]), 100.0)]).per_token == pytest.approx(10.0)


def test_profile_round_trip_and_offset():
    profile = MemoryProfile(toy_profile().units, 4.0, length_offset=1)
    assert MemoryProfile.from_dict(profile.to_dict()) == profile
    assert profile.shape([17, 9]) == MicrobatchShape.from_lengths([16, 8])
