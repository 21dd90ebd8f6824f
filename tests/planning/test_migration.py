import math

import pytest

from lightning_pipe.planning import MigrationCalibration, estimate_migration, gpt_cost_model


def test_nothing_moves_for_the_same_partition():
    model = gpt_cost_model(8, hidden=64, heads=4, vocab=100)
    estimate = estimate_migration(model, [0, 4, 8], [0, 4, 8])
    assert estimate.moved_units == () and estimate.seconds == 0.0 and estimate.bytes_moved == 0.0


def test_one_block_moving_costs_its_parameters_and_optimizer_state():
    model = gpt_cost_model(8, hidden=64, heads=4, vocab=100, latency=1e-3, bandwidth=1e6)
    estimate = estimate_migration(model, [0, 4, 8], [0, 5, 8])
    block = model.units[5]  # block 4 (unit 5) moves from stage 1 to stage 0
    assert estimate.moved_units == (5,)
    assert estimate.bytes_moved == pytest.approx(block.parameter_bytes + block.optimizer_bytes)
    assert estimate.seconds == pytest.approx(1e-3 + estimate.busiest_rank_bytes / 1e6)
    with_gradients = estimate_migration(model, [0, 4, 8], [0, 5, 8], include_gradients=True)
    assert with_gradients.bytes_moved == pytest.approx(block.static_bytes)


def test_parallel_moves_are_timed_by_the_busiest_rank():
    model = gpt_cost_model(12, hidden=64, heads=4, vocab=100, bandwidth=1e6)
    # Stage 0 gives one block to stage 1 while stage 2 gives one to stage 3: two links in parallel.
    estimate = estimate_migration(model, [0, 3, 6, 9, 12], [0, 2, 6, 8, 12])
    per_block = model.units[1].parameter_bytes + model.units[1].optimizer_bytes
    assert estimate.bytes_moved == pytest.approx(2 * per_block)
    assert estimate.busiest_rank_bytes == pytest.approx(per_block)


def test_interleaved_placement_and_free_links():
    model = gpt_cost_model(8, hidden=64, heads=4, vocab=100, bandwidth=math.inf, latency=0.0)
    # Stages 0 and 2 live on rank 0: moving a block between them moves nothing between ranks.
    estimate = estimate_migration(model, [0, 2, 4, 6, 8], [0, 2, 3, 6, 8], stage_to_rank=[0, 1, 0, 1])
    assert estimate.moved_units == (4,) and estimate.seconds == 0.0
    with pytest.raises(ValueError, match="different numbers of stages"):
        estimate_migration(model, [0, 4, 8], [0, 2, 4, 8])


def test_calibration_learns_the_measured_ratio():
    model = gpt_cost_model(8, hidden=64, heads=4, vocab=100, bandwidth=1e6)
    estimate = estimate_migration(model, [0, 4, 8], [0, 5, 8])
    calibration = MigrationCalibration(momentum=0.5)
    assert calibration.predict(estimate) == estimate.seconds
    calibration = calibration.update(1.0, 3.0).update(1.0, 1.0)
    assert calibration.ratio == pytest.approx(2.0) and calibration.count == 2
    assert calibration.update(0.0, 5.0) == calibration
    with pytest.raises(ValueError, match="momentum"):
        MigrationCalibration(momentum=1.0)
