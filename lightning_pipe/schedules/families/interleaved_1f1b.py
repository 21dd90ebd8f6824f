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

Defined once, as the DSL preset ``interleaved_1f1b`` (circular placement, ``priority=interleaved``,
forwards breadth-first and backwards depth-first in groups, ``max_in_flight=auto``: the warm-up above
plus one, at most ``2g``); this module registers the family name and turns
``microbatch_group_size`` into the preset's fixed intervals and in-flight limits.
"""

from __future__ import annotations

from ..dsl import build_preset, microbatch_groups
from ..ir import Program
from ..registry import register_schedule
from ._common import check_sizes


def interleaved_1f1b(
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 2,
    microbatch_group_size: int | None = None,
) -> Program:
    """Build Megatron's interleaved 1F1B program (the ``interleaved_1f1b`` preset).

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``.
        stages_per_rank: chunks per rank ``v`` (>= 1; 1 gives a 1F1B-like order with a longer warm-up).
        microbatch_group_size: microbatches per chunk round ``g``; None: ``p`` when ``p`` divides
            ``m`` (Megatron's default), balanced groups of at least ``p`` otherwise.

    Returns:
        The program, communication included, validated.

    Raises:
        ValueError: for non-positive sizes, or a ``microbatch_group_size`` below ``num_ranks`` or
            not dividing ``num_microbatches``.
    """
    check_sizes("interleaved_1f1b", num_ranks, num_microbatches)
    v = stages_per_rank
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"interleaved_1f1b: stages_per_rank must be a positive integer, got stages_per_rank={v!r}")
    if microbatch_group_size is None:
        return build_preset("interleaved_1f1b", num_ranks, num_microbatches, stages_per_rank=v)
    group = microbatch_groups(num_ranks, num_microbatches, microbatch_group_size)[0]  # checks the size
    limits = tuple(min(2 * (num_ranks - 1 - r) + (v - 1) * group + 1, 2 * group) for r in range(num_ranks))
    return build_preset(
        "interleaved_1f1b", num_ranks, num_microbatches,
        stages_per_rank=v, forward_interval=group, backward_interval=group, max_in_flight=limits,
    )


register_schedule("interleaved_1f1b", interleaved_1f1b)
