"""Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM): 1F1B over ``v`` circularly placed chunks.

Rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) p``. Microbatches go through a rank's chunks in
groups of ``g`` (``microbatch_group_size``, default ``p``): forwards follow Megatron's schedule
table (chunk 0 for microbatches ``0..g-1``, chunk 1 for the same group, ..., then the next group);
backwards follow the same table with chunks in reverse order. Rank ``r`` runs
``2 (p - 1 - r) + (v - 1) g`` warm-up forwards (capped at ``v m``), then alternates one forward and
one backward, then drains the backwards. With per-chunk costs ``1/v`` of a full stage the bubble is
``(p - 1) / (v m + p - 1)``.

By default ``m`` need not be a multiple of ``p``: the microbatches are split into ``max(1, m // p)``
groups of nearly equal size (each at least ``p``, larger ones first), which equals Megatron's groups
of ``p`` when ``p`` divides ``m`` and stays deadlock free otherwise (Megatron-Core's remainder group
smaller than ``p`` deadlocks with this warm-up). ``m < p`` gives one group of ``m`` (extra bubbles).
"""

from __future__ import annotations

from ..ir import Action, B, F, Program
from ..lowering import build_program, place_stages
from ..registry import register_schedule
from ._common import check_sizes


def microbatch_groups(num_ranks: int, num_microbatches: int, group_size: int | None = None) -> list[int]:
    """Sizes of the microbatch groups that go through one chunk before the next chunk.

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``.
        group_size: fixed group size (must divide ``m`` and be >= ``p``); None: balanced groups.

    Returns:
        Group sizes summing to ``m``.

    Raises:
        ValueError: if ``group_size`` is smaller than ``num_ranks`` or does not divide ``m``.
    """
    if group_size is None:
        count = max(1, num_microbatches // num_ranks)
        return [num_microbatches // count + (1 if i < num_microbatches % count else 0) for i in range(count)]
    if group_size < num_ranks or num_microbatches % group_size:
        raise ValueError(
            f"interleaved_1f1b: microbatch_group_size={group_size} must be >= num_ranks={num_ranks} and divide "
            f"num_microbatches={num_microbatches}; leave it None for balanced groups"
        )
    return [group_size] * (num_microbatches // group_size)


def schedule_table(groups: list[int], stages_per_rank: int) -> list[tuple[int, int]]:
    """Megatron's ``(microbatch, chunk)`` forward order for one rank.

    Args:
        groups: microbatch group sizes (:func:`microbatch_groups`).
        stages_per_rank: chunks per rank ``v``.

    Returns:
        ``v * m`` pairs ``(microbatch, chunk)`` in forward order.
    """
    table, start = [], 0
    for size in groups:
        table += [(mb, chunk) for chunk in range(stages_per_rank) for mb in range(start, start + size)]
        start += size
    return table


def interleaved_1f1b(
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 2,
    microbatch_group_size: int | None = None,
) -> Program:
    """Build Megatron's interleaved 1F1B program.

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``.
        stages_per_rank: chunks per rank ``v`` (>= 1; 1 gives a 1F1B-like order with a longer warm-up).
        microbatch_group_size: microbatches per chunk round ``g``; None: ``p`` when ``p`` divides
            ``m`` (Megatron's default), balanced groups of at least ``p`` otherwise.

    Returns:
        The program, communication included.

    Raises:
        ValueError: for non-positive sizes, or a ``microbatch_group_size`` below ``num_ranks`` or
            not dividing ``num_microbatches``.
    """
    check_sizes("interleaved_1f1b", num_ranks, num_microbatches)
    v = stages_per_rank
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"interleaved_1f1b: stages_per_rank must be a positive integer, got stages_per_rank={v!r}")
    groups = microbatch_groups(num_ranks, num_microbatches, microbatch_group_size)
    table = schedule_table(groups, v)
    total = len(table)
    orders: list[list[Action]] = []
    for rank in range(num_ranks):
        forwards = [F(chunk * num_ranks + rank, mb) for mb, chunk in table]
        backwards = [B((v - 1 - chunk) * num_ranks + rank, mb) for mb, chunk in table]
        warmup = min(2 * (num_ranks - 1 - rank) + (v - 1) * groups[0], total)
        order = forwards[:warmup]
        for k in range(total - warmup):
            order += [forwards[warmup + k], backwards[k]]
        order += backwards[total - warmup :]
        orders.append(order)
    return build_program("interleaved_1f1b", num_microbatches, place_stages("circular", num_ranks, v), orders)


register_schedule("interleaved_1f1b", interleaved_1f1b)
