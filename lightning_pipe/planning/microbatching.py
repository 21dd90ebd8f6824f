"""Microbatches sized by work: how many consecutive samples each microbatch takes.

A batch of variable-length sequences split into equal *sample counts* gives microbatches of very
unequal work; the pipeline then runs at the pace of the heaviest one (FlexPipe and InfiniPipe size
microbatches by tokens, DynaPipe by a cost model). :func:`balance_microbatch_sizes` chooses the
cut points of a batch's samples (kept in order, so the split stays a plain slice of every tensor)
that minimize the heaviest microbatch's work, exactly; :func:`sample_costs` gives each sample's work
from a cost model (or its tokens). The microbatch loss weights follow the step's loss (counted
targets or samples, ``runtime/loss_weights.py``), so any sizes give the same gradient.

Pure Python and numpy: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape

__all__ = ["balance_microbatch_sizes", "even_microbatch_sizes", "microbatch_shapes", "sample_costs"]


def even_microbatch_sizes(batch_size: int, num_microbatches: int) -> tuple[int, ...]:
    """Samples per microbatch of the even split (``torch.tensor_split``'s rule: the first
    ``batch_size % count`` one larger), ``min(num_microbatches, batch_size)`` microbatches."""
    if batch_size < 1 or num_microbatches < 1:
        raise ValueError(f"`batch_size` and `num_microbatches` must be >= 1, got {batch_size} and {num_microbatches}.")
    count = min(num_microbatches, batch_size)
    return tuple(batch_size // count + (1 if i < batch_size % count else 0) for i in range(count))


def sample_costs(lengths: Sequence[int], cost_model: CostModel | None = None) -> np.ndarray:
    """Work of each sample: its tokens, or with ``cost_model`` its forward plus backward seconds over
    all units (the per-token and squared-length terms; per-microbatch constants are the same for
    every split and do not matter)."""
    values = np.asarray([int(n) for n in lengths], dtype=float)
    if cost_model is None:
        return values
    per_token = sum(u.forward.per_token + u.backward.per_token for u in cost_model.units)
    per_square = sum(u.forward.per_squared_length + u.backward.per_squared_length for u in cost_model.units)
    return per_token * values + per_square * values**2


def balance_microbatch_sizes(costs: Sequence[float], num_microbatches: int) -> tuple[int, ...]:
    """Consecutive sizes whose heaviest microbatch has the least total cost (exact).

    Samples stay in order; ``min(num_microbatches, len(costs))`` microbatches, each non-empty. The
    minimum of the largest part over contiguous splits is found by bisection on the value with a
    greedy feasibility check (exact for non-negative costs: the optimum is the smallest value the
    greedy check accepts, which is one of the contiguous sums, reached within floating-point
    resolution). Among optimal splits, the greedy one fills earlier microbatches first.

    Args:
        costs: non-negative work of each sample, in batch order.
        num_microbatches: microbatches wanted.

    Returns:
        Samples of each microbatch.

    Raises:
        ValueError: for no samples, negative or non-finite costs, or ``num_microbatches < 1``.
    """
    values = np.asarray(costs, dtype=float)
    if values.size == 0 or num_microbatches < 1:
        raise ValueError(f"Need at least one sample and one microbatch, got {values.size} and {num_microbatches}.")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError("Sample costs must be finite and >= 0.")
    count = min(num_microbatches, values.size)
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    candidates = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(values.size + 1, 1)])
    low, high = 0, len(candidates) - 1  # the optimum is one of the contiguous sums: bisect over them
    while low < high:
        middle = (low + high) // 2
        if _parts_needed(values, candidates[middle]) <= count:
            high = middle
        else:
            low = middle + 1
    return _split(values, candidates[low], count)


def _parts_needed(values: np.ndarray, limit: float) -> int:
    parts, total = 1, 0.0
    for v in values:
        if v > limit:
            return values.size + 1
        if total + v > limit:
            parts, total = parts + 1, v
        else:
            total += v
    return parts


def _split(values: np.ndarray, limit: float, count: int) -> tuple[int, ...]:
    """Greedy parts under ``limit``, then the largest parts split until there are ``count``."""
    sizes, size, total = [], 0, 0.0
    for v in values:
        if size and total + v > limit:
            sizes.append(size)
            size, total = 0, 0.0
        size += 1
        total += v
    sizes.append(size)
    while len(sizes) < count:  # splitting a part never raises the maximum
        index = max(range(len(sizes)), key=lambda i: (sizes[i], -i))
        first = sizes[index] // 2
        sizes[index : index + 1] = [first, sizes[index] - first]
    return tuple(sizes)


def microbatch_shapes(lengths: Sequence[int], sizes: Sequence[int]) -> list[MicrobatchShape]:
    """Shapes of consecutive microbatches of ``sizes`` samples of a batch of ``lengths``.

    Raises:
        ValueError: if the sizes do not sum to the number of samples.
    """
    if sum(sizes) != len(lengths):
        raise ValueError(f"Sizes {list(sizes)} sum to {sum(sizes)}, but the batch has {len(lengths)} samples.")
    shapes, start = [], 0
    for n in sizes:
        shapes.append(MicrobatchShape.from_lengths([int(v) for v in lengths[start : start + n]]))
        start += n
    return shapes
