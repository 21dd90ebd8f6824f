import numpy as np
import pytest

from lightning_pipe.planning import LinearCost, MicrobatchShape, TimingSample, UnitCost, fit_linear_cost, fit_unit_cost

TRUE = LinearCost(2e-4, 3e-7, 4e-11)


def synthetic_shapes(rng, count):
    return [MicrobatchShape.from_lengths(rng.integers(16, 8192, size=int(rng.integers(1, 9)))) for _ in range(count)]


def test_fit_recovers_coefficients_without_noise():
    rng = np.random.default_rng(0)
    shapes = synthetic_shapes(rng, 20)
    fit = fit_linear_cost(shapes, [TRUE.evaluate(s) for s in shapes])
    assert fit.cost.as_array() == pytest.approx(TRUE.as_array(), rel=1e-6)
    assert fit.relative_error < 1e-9
    assert (fit.num_samples, fit.num_held_out) == (20, 5)


def test_fit_recovers_coefficients_under_noise_and_reports_held_out_error():
    rng = np.random.default_rng(1)
    shapes = synthetic_shapes(rng, 400)
    noisy = [TRUE.evaluate(s) * rng.normal(1.0, 0.02) for s in shapes]
    fit = fit_linear_cost(shapes, noisy, holdout_fraction=0.25, seed=3)
    assert fit.cost.as_array() == pytest.approx(TRUE.as_array(), rel=0.1)
    assert 0.005 < fit.relative_error < 0.03  # about the noise: 2% normal has mean |error| 1.6%


def test_fit_unit_cost_keeps_the_template_and_fits_saved_bytes():
    rng = np.random.default_rng(2)
    shapes = synthetic_shapes(rng, 40)
    saved = LinearCost(0.0, 4096.0, 0.0)
    samples = [TimingSample(s, TRUE.evaluate(s), 2 * TRUE.evaluate(s), saved.evaluate(s)) for s in shapes]
    template = UnitCost("block.0", LinearCost(), LinearCost(), output_bytes_per_token=8.0, parameter_bytes=100.0)
    fit = fit_unit_cost(samples, template)
    assert fit.unit.name == "block.0" and fit.unit.parameter_bytes == 100.0 and fit.unit.output_bytes_per_token == 8.0
    assert fit.unit.backward.as_array() == pytest.approx(2 * TRUE.as_array(), rel=1e-6)
    assert fit.unit.saved_bytes.per_token == pytest.approx(4096.0)
    assert fit.saved_bytes is not None and fit.saved_bytes.relative_error < 1e-9


def test_fit_without_saved_bytes_keeps_the_templates():
    rng = np.random.default_rng(3)
    shapes = synthetic_shapes(rng, 8)
    template = UnitCost("pre", LinearCost(), LinearCost(), saved_bytes=LinearCost(1.0))
    fit = fit_unit_cost([TimingSample(s, 1e-3, 2e-3) for s in shapes], template)
    assert fit.saved_bytes is None and fit.unit.saved_bytes == LinearCost(1.0)
    zero = fit_linear_cost(shapes, [0.0] * 8)
    assert zero.cost == LinearCost() and zero.relative_error == 0.0


def test_fit_rejects_bad_samples():
    shapes = [MicrobatchShape.from_lengths([n]) for n in (10, 20, 30, 40)]
    with pytest.raises(ValueError, match="at least 3 samples"):
        fit_linear_cost(shapes[:3], [1.0, 2.0, 3.0], holdout_fraction=0.5)
    with pytest.raises(ValueError, match="has 4 samples but `values` has 3"):
        fit_linear_cost(shapes, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="must all be > 0"):
        fit_linear_cost(shapes, [1.0, 2.0, -3.0, 4.0])
    samples = [TimingSample(s, 1.0, 1.0, None if i else 5.0) for i, s in enumerate(shapes)]
    with pytest.raises(ValueError, match="3 of 4 lack `saved_bytes`"):
        fit_unit_cost(samples, UnitCost("u", LinearCost(), LinearCost()))
