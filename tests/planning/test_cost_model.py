import json
import math

import numpy as np
import pytest

from lightning_pipe.planning import CostModel, LinearCost, MicrobatchShape, UnitCost, gpt_1_3b, gpt_7b, gpt_cost_model
from tests.planning.helpers import random_cost_model, random_microbatches


def test_shape_from_lengths():
    shape = MicrobatchShape.from_lengths([3, 4])
    assert shape == MicrobatchShape(num_sequences=2, tokens=7, sum_squared_lengths=25.0)


@pytest.mark.parametrize(("lengths", "match"), [([], "empty"), ([3, 0], "must all be >= 1")])
def test_shape_from_lengths_rejects(lengths, match):
    with pytest.raises(ValueError, match=match):
        MicrobatchShape.from_lengths(lengths)


def test_linear_cost_evaluate_and_validation():
    cost = LinearCost(1.0, 2.0, 3.0)
    assert cost.evaluate(MicrobatchShape(1, 10, 100.0)) == 1.0 + 20.0 + 300.0
    with pytest.raises(ValueError, match="per_token"):
        LinearCost(0.0, -1.0)


def test_cost_model_needs_pre_block_post():
    unit = UnitCost("u", LinearCost(), LinearCost())
    with pytest.raises(ValueError, match="3 or more units"):
        CostModel((unit, unit))


def test_stage_costs_sum_units_with_pre_on_first_and_post_on_last(rng):
    model = random_cost_model(rng, num_blocks=5)
    batch = random_microbatches(rng, 3)
    costs = model.stage_costs([0, 2, 5], batch)
    units = model.units
    for mb, shape in enumerate(batch):
        first = sum(u.forward.evaluate(shape) for u in units[0:3])  # pre, block 0, block 1
        last = sum(u.forward.evaluate(shape) for u in units[3:7])  # blocks 2..4, post
        assert costs.forward[0][mb] == pytest.approx(first)
        assert costs.forward[1][mb] == pytest.approx(last)
        assert costs.backward[1][mb] == pytest.approx(sum(u.backward.evaluate(shape) for u in units[3:7]))
        assert costs.saved_bytes[0][mb] == pytest.approx(sum(u.saved_bytes.evaluate(shape) for u in units[0:3]))
        # Stage 0 sends the output of block 1 (unit 2); the last stage sends nothing.
        assert costs.activation_bytes[0][mb] == pytest.approx(units[2].output_bytes_per_token * shape.tokens)
        assert costs.activation_bytes[1][mb] == 0.0
    assert costs.static_bytes == pytest.approx(
        (sum(u.static_bytes for u in units[0:3]), sum(u.static_bytes for u in units[3:]))
    )
    assert (costs.latency, costs.bandwidth) == (model.latency, model.bandwidth)


@pytest.mark.parametrize(
    ("boundaries", "match"), [([0, 3], "end at num_blocks=5"), ([0, 3, 3, 5], "strictly increasing")]
)
def test_stage_costs_rejects_bad_partitions(rng, boundaries, match):
    model = random_cost_model(rng, num_blocks=5)
    with pytest.raises(ValueError, match=match):
        model.stage_costs(boundaries, random_microbatches(rng, 1))


def test_json_round_trip(tmp_path, rng):
    model = random_cost_model(rng, num_blocks=4)
    path = tmp_path / "profile.json"
    model.save(path)
    assert CostModel.load(path) == model
    free = CostModel(model.units, latency=0.0, bandwidth=math.inf)
    free.save(path)
    assert json.loads(path.read_text())["bandwidth"] is None
    assert CostModel.load(path).bandwidth == math.inf


def test_json_rejects_other_files(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="Not a cost-model profile"):
        CostModel.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CostModel.load(path)
    path.write_text(json.dumps({"format": "lightning_pipe.cost_model", "version": 99}))
    with pytest.raises(ValueError, match="version"):
        CostModel.load(path)


def test_gpt_sizes_match_the_named_models():
    def parameters(model: CostModel) -> float:
        return sum(u.parameter_bytes for u in model.units) / 2  # bf16

    assert 1.3e9 < parameters(gpt_1_3b()) < 1.45e9
    assert 6.5e9 < parameters(gpt_7b()) < 7.0e9
    assert gpt_1_3b().num_blocks == 24 and gpt_7b().num_blocks == 32


def test_gpt_block_time_is_the_standard_flop_count():
    model = gpt_cost_model(2, hidden=64, heads=4, vocab=100, device_flops=1e12, efficiency=0.5)
    shape = MicrobatchShape.from_lengths([10, 30])
    block = model.units[1]
    flops = 24 * 64**2 * 40 + 4 * 64 * (100 + 900)
    assert block.forward.evaluate(shape) == pytest.approx(flops / 0.5e12)
    assert block.backward.evaluate(shape) == pytest.approx(2 * flops / 0.5e12)
    assert block.saved_bytes.evaluate(shape) == pytest.approx(34 * 64 * 40)  # flash attention: no quadratic term
    no_flash = gpt_cost_model(2, hidden=64, heads=4, vocab=100, flash_attention=False)
    assert no_flash.units[1].saved_bytes.per_squared_length == 5 * 4
    # 12 bytes of Adam state plus bf16 parameters and gradients: 16 bytes per parameter.
    assert block.static_bytes == pytest.approx(16 * (12 * 64**2 + 13 * 64))


def test_gpt_rejects_bad_sizes():
    with pytest.raises(ValueError, match="`hidden` must be >= 1"):
        gpt_cost_model(2, hidden=0, heads=1, vocab=10)
    with pytest.raises(ValueError, match="efficiency"):
        gpt_cost_model(2, hidden=8, heads=1, vocab=10, efficiency=1.5)


def test_tables_match_unit_evaluation(rng):
    model = random_cost_model(rng, num_blocks=3)
    batch = random_microbatches(rng, 4)
    tables = model.tables(batch)
    expected = np.array([[u.forward.evaluate(s) for s in batch] for u in model.units])
    np.testing.assert_allclose(tables.forward, expected)
    with pytest.raises(ValueError, match="empty"):
        model.tables([])


def test_gpt_full_recompute_trades_memory_for_a_forward():
    plain = gpt_cost_model(2, hidden=64, heads=4, vocab=100, flash_attention=False)
    recompute = gpt_cost_model(2, hidden=64, heads=4, vocab=100, flash_attention=False, full_recompute=True)
    block, cheap = plain.units[1], recompute.units[1]
    assert cheap.saved_bytes == LinearCost(0.0, 2 * 64, 0.0)
    assert cheap.backward.per_token == pytest.approx(1.5 * block.backward.per_token)
    assert cheap.forward == block.forward


def test_full_recompute_of_a_model_equals_the_analytic_option():
    """A measured model gets recompute the way the analytic GPT model prices it."""
    from lightning_pipe.planning.gpt import gpt_1_3b

    derived, analytic = gpt_1_3b().with_full_recompute(), gpt_1_3b(full_recompute=True)
    shape = MicrobatchShape.from_lengths([4096, 1024])
    for mine, theirs in zip(derived.units, analytic.units, strict=True):
        assert mine.saved_bytes.evaluate(shape) == pytest.approx(theirs.saved_bytes.evaluate(shape))
        assert mine.backward.evaluate(shape) == pytest.approx(theirs.backward.evaluate(shape))
    assert derived.units[1].saved_bytes.evaluate(shape) < gpt_1_3b().units[1].saved_bytes.evaluate(shape)
