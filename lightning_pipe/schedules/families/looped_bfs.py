"""Looped breadth-first pipeline (Lamy-Poirier, 2023): all microbatches through one chunk at a time.

Rank ``r`` holds stages ``r, r + p, ...`` (circular placement). It runs the forwards of every
microbatch on its first chunk, then its second chunk, ..., then the backwards chunk by chunk in
reverse. Like GPipe it keeps every microbatch in flight, but the pipeline fills once per step, not
once per chunk. Backwards run in ascending microbatch order (torch's ``ScheduleLoopedBFS`` runs them
descending; both are valid, ascending is the DSL's tie-break).

Defined once, as the DSL preset ``looped_bfs``; this module registers the family name.
"""

from __future__ import annotations

from ..dsl import build_preset
from ..ir import Program
from ..registry import register_schedule
from ._common import check_sizes


def looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Program:
    """Build the looped breadth-first program (the ``looped_bfs`` preset).

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``.
        stages_per_rank: chunks per rank ``v``.

    Returns:
        The program, communication included, validated.
    """
    check_sizes("looped_bfs", num_ranks, num_microbatches)
    if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(
            f"looped_bfs: stages_per_rank must be a positive integer, got stages_per_rank={stages_per_rank!r}"
        )
    return build_preset("looped_bfs", num_ranks, num_microbatches, stages_per_rank=stages_per_rank)


register_schedule("looped_bfs", looped_bfs)
