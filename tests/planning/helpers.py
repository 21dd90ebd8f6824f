"""Small random models and batches for the planning tests (plain numbers, milliseconds each)."""

from __future__ import annotations

import numpy as np

from lightning_pipe.planning import CostModel, LinearCost, MicrobatchShape, UnitCost


def random_cost_model(
    rng: np.random.Generator, num_blocks: int, latency: float = 1e-5, bandwidth: float = 1e9
) -> CostModel:
    """A model whose units all cost differently (so partitions are not interchangeable)."""
    units = []
    for index in range(num_blocks + 2):
        forward = rng.uniform(0.0, 1.0, 3) * [1e-3, 1e-6, 1e-10]
        units.append(
            UnitCost(
                name=f"unit.{index}",
                forward=LinearCost(*forward),
                backward=LinearCost(*(2 * forward * rng.uniform(0.8, 1.2, 3))),
                saved_bytes=LinearCost(0.0, rng.uniform(1e3, 1e4), rng.uniform(0.0, 1.0)),
                output_bytes_per_token=rng.uniform(1e3, 1e4),
                parameter_bytes=rng.uniform(1e6, 1e8),
                gradient_bytes=rng.uniform(1e6, 1e8),
                optimizer_bytes=rng.uniform(1e6, 1e8),
            )
        )
    return CostModel(tuple(units), latency=latency, bandwidth=bandwidth)


def random_microbatches(rng: np.random.Generator, count: int, max_length: int = 4000) -> list[MicrobatchShape]:
    """``count`` microbatches of 1 to 4 sequences of random lengths."""
    return [
        MicrobatchShape.from_lengths(rng.integers(1, max_length, size=int(rng.integers(1, 5)))) for _ in range(count)
    ]
