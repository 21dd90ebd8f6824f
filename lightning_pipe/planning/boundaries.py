"""Partitions as plain boundary lists, and the simple ways to make one.

A partition of ``num_blocks`` blocks into ``S`` stages is ``0 = b_0 < b_1 < ... < b_S = num_blocks``:
stage ``s`` owns blocks ``b_s .. b_{s+1} - 1`` and every stage owns at least one block. Boundaries are
over **blocks**, never over units: ``pre`` (embeddings) always belongs to the first stage and ``post``
(final norm, head, loss) to the last, so a partition means the same thing whatever ``pre`` and
``post`` cost. :func:`unit_ranges` translates to unit indices (``pre`` is unit 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def check_boundaries(boundaries: Sequence[int], num_blocks: int, num_stages: int | None = None) -> tuple[int, ...]:
    """Validate a partition and return it as a tuple of ints.

    Args:
        boundaries: ``0 = b_0 < b_1 < ... < b_S = num_blocks``.
        num_blocks: number of blocks the partition must cover.
        num_stages: if given, the number of stages the partition must have.

    Raises:
        ValueError: naming ``boundaries`` and its values when it is not a partition of the blocks.
    """
    bounds = tuple(int(b) for b in boundaries)
    if len(bounds) < 2:
        raise ValueError(f"`boundaries` needs at least 2 entries (one stage), got {list(bounds)}.")
    if bounds[0] != 0 or bounds[-1] != num_blocks:
        raise ValueError(f"`boundaries` must start at 0 and end at num_blocks={num_blocks}, got {list(bounds)}.")
    if any(b >= c for b, c in itertools.pairwise(bounds)):
        raise ValueError(
            f"`boundaries` must be strictly increasing (every stage owns at least one block), got {list(bounds)}."
        )
    if num_stages is not None and len(bounds) - 1 != num_stages:
        raise ValueError(f"`boundaries` {list(bounds)} has {len(bounds) - 1} stages, expected {num_stages}.")
    return bounds


def unit_ranges(boundaries: Sequence[int], num_blocks: int) -> list[tuple[int, int]]:
    """Unit index range ``[start, stop)`` of every stage; ``pre`` is unit 0, block ``i`` is unit ``i + 1``.

    Args:
        boundaries: a valid partition over blocks (see :func:`check_boundaries`).
        num_blocks: number of blocks.
    """
    last = len(boundaries) - 2
    return [
        (0 if s == 0 else boundaries[s] + 1, num_blocks + 2 if s == last else boundaries[s + 1] + 1)
        for s in range(last + 1)
    ]


def _check_counts(num_blocks: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"`num_stages` must be >= 1, got {num_stages}.")
    if num_blocks < num_stages:
        raise ValueError(
            f"Every stage must own at least one block: `num_blocks`={num_blocks} < `num_stages`={num_stages}. "
            "Use fewer stages."
        )


def uniform_partition(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Equal block counts per stage (differing by at most one), ignoring what blocks cost.

    Args:
        num_blocks: number of blocks (``pre`` and ``post`` are not counted; they go to the first and
            last stage).
        num_stages: number of stages.

    Returns:
        Boundaries over blocks, ``b_s = floor(s * num_blocks / num_stages)``.

    Raises:
        ValueError: if ``num_stages < 1`` or ``num_blocks < num_stages``.
    """
    _check_counts(num_blocks, num_stages)
    return tuple(s * num_blocks // num_stages for s in range(num_stages + 1))


def minimize_bottleneck(stage_cost: np.ndarray) -> tuple[tuple[int, ...], float]:
    """Exact min-max contiguous partition for an arbitrary per-stage cost table.

    Args:
        stage_cost: ``[S, L + 1, L + 1]`` array; ``stage_cost[s, a, b]`` is the cost of stage ``s``
            owning blocks ``a .. b - 1`` (``inf`` where not allowed).

    Returns:
        The boundaries minimizing the largest stage cost (ties: the first found, which puts later
        boundaries as early as possible) and that largest cost (``inf`` if nothing is allowed).
    """
    num_stages, size, _ = stage_cost.shape
    num_blocks = size - 1
    best = np.full((num_stages + 1, size), np.inf)
    choice = np.zeros((num_stages + 1, size), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        # candidates[a, b] = max(best[s-1, a], cost of stage s-1 on blocks a..b-1), only a < b.
        candidates = np.maximum(best[s - 1][:, None], stage_cost[s - 1])
        candidates = np.where(np.triu(np.ones((size, size), dtype=bool), k=1), candidates, np.inf)
        choice[s] = np.argmin(candidates, axis=0)
        best[s] = candidates[choice[s], np.arange(size)]
    if not np.isfinite(best[num_stages, num_blocks]):
        return (), float("inf")
    bounds = [num_blocks]
    for s in range(num_stages, 0, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    return tuple(reversed(bounds)), float(best[num_stages, num_blocks])


def balanced_partition(
    weights: Sequence[float], num_stages: int, first_weight: float = 0.0, last_weight: float = 0.0
) -> tuple[int, ...]:
    """Contiguous partition minimizing the heaviest stage (exact, by dynamic programming).

    The strategy uses it with parameter counts (``partition="balanced"``): stages then hold similar
    parameter memory. ``pre`` and ``post`` are not blocks: pass their weights as ``first_weight``
    and ``last_weight`` so the first and last stages are charged for them.

    Args:
        weights: one non-negative weight per block (for example parameters per block).
        num_stages: number of stages.
        first_weight: weight added to the first stage (``pre``).
        last_weight: weight added to the last stage (``post``).

    Returns:
        Boundaries over blocks.

    Raises:
        ValueError: if a weight is negative or there are fewer blocks than stages.
    """
    values = np.asarray(weights, dtype=float)
    _check_counts(len(values), num_stages)
    if (values < 0).any() or first_weight < 0 or last_weight < 0:
        raise ValueError(
            f"`weights` must be >= 0, got minimum {values.min()} (first_weight={first_weight}, last_weight={last_weight})."
        )
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    span = prefix[None, :] - prefix[:, None]  # span[a, b] = weight of blocks a..b-1
    cost = np.repeat(span[None], num_stages, axis=0)
    cost[0] += first_weight
    cost[-1] += last_weight
    bounds, _ = minimize_bottleneck(cost)
    return bounds


def random_partition(num_blocks: int, num_stages: int, rng: np.random.Generator | int | None = None) -> tuple[int, ...]:
    """A partition drawn uniformly among all partitions with at least one block per stage (for tests).

    Args:
        num_blocks: number of blocks.
        num_stages: number of stages.
        rng: numpy generator or seed.

    Raises:
        ValueError: if ``num_stages < 1`` or ``num_blocks < num_stages``.
    """
    _check_counts(num_blocks, num_stages)
    generator = np.random.default_rng(rng)
    cuts = generator.choice(np.arange(1, num_blocks), size=num_stages - 1, replace=False)
    return (0, *sorted(int(c) for c in cuts), num_blocks)
