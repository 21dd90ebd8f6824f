"""Looped breadth-first pipeline (Lamy-Poirier, 2023): all microbatches through one chunk at a time.

Rank ``r`` holds stages ``r, r + p, ...`` (circular placement). It runs the forwards of every
microbatch on its first chunk, then its second chunk, ..., then the backwards chunk by chunk in
reverse. Like GPipe it keeps every microbatch in flight, but the pipeline fills once per step, not
once per chunk. Backwards run in ascending microbatch order (torch's ``ScheduleLoopedBFS`` runs them
descending; both are valid, ascending matches the DSL's default tie-break).
"""

from __future__ import annotations

from ..ir import B, F, Program
from ..lowering import build_program, place_stages
from ..registry import register_schedule
from ._common import check_sizes


def looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Program:
    """Build the looped breadth-first program.

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``.
        stages_per_rank: chunks per rank ``v``.

    Returns:
        The program, communication included.
    """
    check_sizes("looped_bfs", num_ranks, num_microbatches)
    if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(
            f"looped_bfs: stages_per_rank must be a positive integer, got stages_per_rank={stages_per_rank!r}"
        )
    orders = []
    for rank in range(num_ranks):
        stages = [chunk * num_ranks + rank for chunk in range(stages_per_rank)]
        order = [F(s, mb) for s in stages for mb in range(num_microbatches)]
        order += [B(s, mb) for s in reversed(stages) for mb in range(num_microbatches)]
        orders.append(order)
    placement = place_stages("circular", num_ranks, stages_per_rank)
    return build_program("looped_bfs", num_microbatches, placement, orders)


register_schedule("looped_bfs", looped_bfs)
