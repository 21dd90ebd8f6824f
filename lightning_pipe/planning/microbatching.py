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

import functools
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape

__all__ = [
    "balance_microbatch_sizes",
    "even_microbatch_sizes",
    "microbatch_shapes",
    "padded_cost",
    "padded_microbatch_sizes",
    "sample_costs",
]

PaddedCost = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""``cost(samples, longest)``, elementwise: the work of microbatches of ``samples`` sequences cut to ``longest`` positions."""

_EXACT_UP_TO = 32  # samples: a larger batch is cut at this many evenly spaced places (padded_microbatch_sizes)


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


def padded_cost(cost_model: CostModel | None = None, length_offset: int = 0) -> PaddedCost:
    """The work of padded microbatches, elementwise over arrays of ``samples`` and ``longest``: their
    positions (``samples x longest``), or with ``cost_model`` their forward plus backward seconds over
    all units at that shape (per-microbatch constants are the same for every split of a fixed count
    and are left out)."""
    if cost_model is None:
        return lambda samples, longest: samples * longest
    per_token = sum(u.forward.per_token + u.backward.per_token for u in cost_model.units)
    per_square = sum(u.forward.per_squared_length + u.backward.per_squared_length for u in cost_model.units)

    def cost(samples: np.ndarray, longest: np.ndarray) -> np.ndarray:
        n = np.maximum(1, longest - length_offset)
        return samples * (per_token * n + per_square * n * n)

    return cost


def padded_microbatch_sizes(
    lengths: Sequence[int], num_microbatches: int, num_stages: int, cost: PaddedCost | None = None
) -> tuple[int, ...]:
    """Consecutive sizes for samples ordered longest first, each microbatch cut to its own longest.

    A microbatch of sorted sequences runs at its first sample's length, so equal sample counts put the
    longest few together in one heavy microbatch and the pipeline runs at its pace. The sizes chosen
    here minimize a 1F1B pipeline's step estimate over contiguous splits,
    ``sum(c_m) + (num_stages - 1) * max(c_m)`` with ``c_m = cost(samples_m, longest_m)`` (the steady
    phase runs every microbatch once per stage; warm-up and cool-down add the heaviest one per extra
    stage), as DynaPipe sizes microbatches by a cost model: when there are at most 5,000 splits (16
    samples in 4 microbatches: 455) every one is tried at once in numpy (about 0.1 ms); otherwise
    every possible heaviest part is tried, with a dynamic program for the least sum under it (0.5 ms
    for those 16 samples). Exact up to 32 samples; a larger batch is cut only at 32 evenly spaced
    places (sizes then come in steps of about ``len(lengths) / 32`` samples), to keep planning within
    milliseconds.

    Args:
        lengths: real lengths of the samples, longest first.
        num_microbatches: microbatches wanted (``min(num_microbatches, len(lengths))`` are made).
        num_stages: pipeline stages the microbatches flow through.
        cost: the work of microbatches, elementwise over arrays (default :func:`padded_cost`: positions).

    Returns:
        Samples of each microbatch, in order.

    Raises:
        ValueError: for no samples, ``num_microbatches < 1`` or lengths not longest first.
    """
    key = tuple(int(n) for n in lengths)
    if cost is None:  # cached: a batch is sized by its planners (as the next batch, then as the current one) and its step
        return _padded_sizes_cached(key, num_microbatches, num_stages)
    return _padded_sizes(key, num_microbatches, num_stages, cost)


@functools.lru_cache(maxsize=256)
def _padded_sizes_cached(lengths: tuple[int, ...], num_microbatches: int, num_stages: int) -> tuple[int, ...]:
    return _padded_sizes(lengths, num_microbatches, num_stages, None)


def _padded_sizes(
    lengths: tuple[int, ...], num_microbatches: int, num_stages: int, cost: PaddedCost | None
) -> tuple[int, ...]:
    values = np.asarray(lengths, dtype=float)
    if values.size == 0 or num_microbatches < 1:
        raise ValueError(f"Need at least one sample and one microbatch, got {values.size} and {num_microbatches}.")
    if np.any(values[1:] > values[:-1]):
        raise ValueError("`lengths` must be ordered longest first (the order the microbatches are cut in).")
    cost = cost or padded_cost()
    count = min(num_microbatches, values.size)
    cuts = np.unique(np.round(np.linspace(0, values.size, min(values.size, max(_EXACT_UP_TO, 2 * count)) + 1)).astype(int))
    start, end = np.meshgrid(cuts, cuts, indexing="ij")  # part[a, b]: samples cuts[a]..cuts[b]-1
    part = np.full(start.shape, np.inf)
    valid = end > start
    part[valid] = cost(end[valid] - start[valid], values[start[valid]])
    splits = _splits_of(cuts.size - 1, count)
    if splits is not None:
        return _best_enumerated(part, cuts, splits, num_stages)
    caps = np.unique(part[valid])
    least_sum = _least_sums(part, count, caps[-1:])[0][0]  # no split under any heaviest part sums to less
    best, best_parts = np.inf, None
    for block in range(0, caps.size, _CAPS_PER_BLOCK):  # ascending: stop once the bound reaches the best
        block_caps = caps[block : block + _CAPS_PER_BLOCK]
        if least_sum + (num_stages - 1) * block_caps[0] >= best:
            break
        totals, parts_of = _least_sums(part, count, block_caps)
        values_ = totals + (num_stages - 1) * block_caps
        index = int(np.argmin(values_))
        if values_[index] < best:
            best, best_parts = float(values_[index]), parts_of(index)
    if best_parts is None:  # fewer cut places than microbatches
        return even_microbatch_sizes(values.size, count)
    return tuple(int(cuts[b] - cuts[a]) for a, b in best_parts)


_CAPS_PER_BLOCK = 32
_ENUMERATE_UP_TO = 5000  # splits: up to this many, trying them all beats the dynamic program (455: 0.1 against 0.5 ms)


@functools.lru_cache(maxsize=64)
def _splits_of(places: int, count: int) -> np.ndarray | None:
    """Every split of ``places`` consecutive positions into ``count`` non-empty parts, as bounds
    ``[split, count + 1]`` (first 0, last ``places``), in lexicographic order; None if there are
    none or more than ``_ENUMERATE_UP_TO``."""
    splits = math.comb(places - 1, count - 1)
    if not 0 < splits <= _ENUMERATE_UP_TO:
        return None
    inner = np.array(list(itertools.combinations(range(1, places), count - 1)), dtype=int).reshape(splits, count - 1)
    return np.concatenate([np.zeros((len(inner), 1), int), inner, np.full((len(inner), 1), places)], axis=1)


def _best_enumerated(part: np.ndarray, cuts: np.ndarray, bounds: np.ndarray, num_stages: int) -> tuple[int, ...]:
    """Of the splits ``bounds`` (:func:`_splits_of`), the one minimizing ``sum + (num_stages - 1) * max``
    of its parts' costs."""
    costs = part[bounds[:, :-1], bounds[:, 1:]]  # [split, part]
    best = bounds[int(np.argmin(costs.sum(axis=1) + (num_stages - 1) * costs.max(axis=1)))]
    return tuple(int(cuts[b] - cuts[a]) for a, b in zip(best[:-1], best[1:]))


def _least_sums(part: np.ndarray, count: int, caps: np.ndarray) -> tuple[np.ndarray, Callable[[int], list]]:
    """Per cap: the least total cost of ``count`` consecutive non-empty parts none above it; and a
    function giving cap ``k``'s parts (index pairs into ``part``)."""
    places = part.shape[0]
    allowed = np.where(part[None] <= caps[:, None, None] * (1 + 1e-12), part[None], np.inf)
    total = np.full((caps.size, places), np.inf)
    total[:, 0] = 0.0
    choices = []
    for _ in range(count):
        candidates = total[:, :, None] + allowed  # [cap, from, to]
        choice = np.argmin(candidates, axis=1)
        total = np.take_along_axis(candidates, choice[:, None, :], axis=1)[:, 0, :]
        choices.append(choice)

    def parts_of(k: int) -> list[tuple[int, int]]:
        parts, end = [], places - 1
        for choice in reversed(choices):
            begin = int(choice[k, end])
            parts.append((begin, end))
            end = begin
        return parts[::-1]

    return total[:, places - 1], parts_of
