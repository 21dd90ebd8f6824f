"""Fit a unit's cost coefficients from measured samples (what the profiler callback records).

Each sample is one microbatch's shape and the seconds (and optionally the saved bytes) one unit took
on it. The model is linear in ``[1, tokens, sum_squared_lengths]``; it is fitted by non-negative
least squares on *relative* residuals (each row divided by its measured value), because timing
noise is multiplicative and short microbatches must be predicted as well as long ones. The error
reported is the mean relative error on samples held out of the fit; the returned coefficients are
then refitted on all samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from lightning_pipe.planning.cost_model import LinearCost, MicrobatchShape, UnitCost

MIN_FIT_SAMPLES = 3  # one per coefficient


@dataclass(frozen=True)
class TimingSample:
    """One measurement of one unit on one microbatch.

    Attributes:
        shape: the microbatch.
        forward_seconds: measured forward seconds.
        backward_seconds: measured backward seconds.
        saved_bytes: measured bytes kept for backward, or None if not measured.
    """

    shape: MicrobatchShape
    forward_seconds: float
    backward_seconds: float
    saved_bytes: float | None = None


@dataclass(frozen=True)
class LinearFit:
    """A fitted :class:`LinearCost` and how well it predicts unseen samples.

    Attributes:
        cost: coefficients fitted on all samples.
        relative_error: mean ``|predicted - measured| / measured`` on the held-out samples (of a
            fit on the others); on the fitted samples themselves when nothing was held out.
        num_samples: samples used.
        num_held_out: samples held out to measure ``relative_error``.
    """

    cost: LinearCost
    relative_error: float
    num_samples: int
    num_held_out: int


@dataclass(frozen=True)
class UnitFit:
    """A unit with fitted coefficients, and the fits behind them.

    Attributes:
        unit: the template unit with ``forward``, ``backward`` (and ``saved_bytes`` when measured)
            replaced by the fitted ones.
        forward: fit of the forward seconds.
        backward: fit of the backward seconds.
        saved_bytes: fit of the saved bytes, or None when the samples did not measure them.
    """

    unit: UnitCost
    forward: LinearFit
    backward: LinearFit
    saved_bytes: LinearFit | None


def _features(shapes: Sequence[MicrobatchShape]) -> np.ndarray:
    return np.array([[1.0, s.tokens, s.sum_squared_lengths] for s in shapes], dtype=float)


def _solve(features: np.ndarray, values: np.ndarray) -> np.ndarray:
    rows = features / values[:, None]  # relative residuals
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(rows / scale, np.ones(len(values)))
    return solution / scale


def _relative_error(coefficients: np.ndarray, features: np.ndarray, values: np.ndarray) -> float:
    return float(np.mean(np.abs(features @ coefficients - values) / values))


def fit_linear_cost(
    shapes: Sequence[MicrobatchShape],
    values: Sequence[float],
    *,
    holdout_fraction: float = 0.25,
    seed: int = 0,
) -> LinearFit:
    """Fit ``constant + per_token * tokens + per_squared_length * sum_squared_lengths`` to ``values``.

    Args:
        shapes: the microbatch of every sample.
        values: the measured quantity (seconds or bytes) of every sample, all > 0 (or all 0).
        holdout_fraction: fraction of samples held out to measure the error (0 to hold none out).
        seed: seed of the held-out selection.

    Returns:
        The :class:`LinearFit`; coefficients are non-negative.

    Raises:
        ValueError: if lengths differ, a value is not positive, or too few samples remain to fit.
    """
    measured = np.asarray(values, dtype=float)
    if len(shapes) != len(measured):
        raise ValueError(f"`shapes` has {len(shapes)} samples but `values` has {len(measured)}.")
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"`holdout_fraction` must be in [0, 1), got {holdout_fraction}.")
    num_held_out = round(len(measured) * holdout_fraction)
    if holdout_fraction > 0 and len(measured) > MIN_FIT_SAMPLES:
        num_held_out = max(1, num_held_out)
    if len(measured) - num_held_out < MIN_FIT_SAMPLES:
        raise ValueError(
            f"Need at least {MIN_FIT_SAMPLES} samples to fit after holding out {num_held_out}, got {len(measured)} "
            "samples; profile more microbatches or lower `holdout_fraction`."
        )
    if (measured == 0).all():  # nothing measured (a unit that keeps no activations): an exact zero fit
        return LinearFit(LinearCost(), 0.0, len(measured), num_held_out)
    if not (measured > 0).all():
        raise ValueError(
            f"`values` must all be > 0 (or all 0), got minimum {measured.min()}: relative errors need positive values."
        )
    features = _features(shapes)
    if num_held_out:
        order = np.random.default_rng(seed).permutation(len(measured))
        held, kept = order[:num_held_out], order[num_held_out:]
        error = _relative_error(_solve(features[kept], measured[kept]), features[held], measured[held])
    coefficients = _solve(features, measured)
    if not num_held_out:
        error = _relative_error(coefficients, features, measured)
    return LinearFit(LinearCost(*(float(c) for c in coefficients)), error, len(measured), num_held_out)


def fit_unit_cost(
    samples: Sequence[TimingSample],
    template: UnitCost,
    *,
    holdout_fraction: float = 0.25,
    seed: int = 0,
) -> UnitFit:
    """Fit one unit's forward and backward seconds (and saved bytes, if measured) from samples.

    Args:
        samples: measurements of this unit on different microbatches.
        template: the unit as known so far (name, output bytes, parameter/gradient/optimizer bytes
            and, if the samples do not measure them, saved bytes); its fitted fields are replaced.
        holdout_fraction: fraction of samples held out to measure each fit's error.
        seed: seed of the held-out selection.

    Returns:
        The :class:`UnitFit`.

    Raises:
        ValueError: as :func:`fit_linear_cost`, or if only some samples measure saved bytes.
    """
    shapes = [s.shape for s in samples]
    forward = fit_linear_cost(
        shapes, [s.forward_seconds for s in samples], holdout_fraction=holdout_fraction, seed=seed
    )
    backward = fit_linear_cost(
        shapes, [s.backward_seconds for s in samples], holdout_fraction=holdout_fraction, seed=seed
    )
    measured = [s.saved_bytes for s in samples]
    saved = None
    if any(m is not None for m in measured):
        if any(m is None for m in measured):
            raise ValueError(
                f"`samples` of unit {template.name!r}: {sum(m is None for m in measured)} of {len(measured)} lack "
                "`saved_bytes`; measure it on every sample or on none."
            )
        saved = fit_linear_cost(shapes, measured, holdout_fraction=holdout_fraction, seed=seed)
    unit = dataclasses.replace(
        template,
        forward=forward.cost,
        backward=backward.cost,
        saved_bytes=template.saved_bytes if saved is None else saved.cost,
    )
    return UnitFit(unit, forward, backward, saved)
