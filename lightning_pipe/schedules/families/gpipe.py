"""GPipe (Huang et al., 2019): every forward, then every backward.

Rank ``r`` holds stage ``r``. It runs ``F`` of all microbatches, then ``B`` of all microbatches in the
same (ascending) order, as torch's ``ScheduleGPipe`` does. With uniform costs the bubble is
``(p - 1) / (m + p - 1)``; every rank keeps all ``m`` microbatches' activations alive at its peak.
"""

from __future__ import annotations

from ..ir import B, F, Program
from ..lowering import build_program, place_stages
from ..registry import register_schedule
from ._common import check_sizes


def gpipe(num_ranks: int, num_microbatches: int) -> Program:
    """Build the GPipe program.

    Args:
        num_ranks: pipeline ranks (= stages).
        num_microbatches: microbatches per step.

    Returns:
        The program, communication included.
    """
    check_sizes("gpipe", num_ranks, num_microbatches)
    orders = [
        [F(r, mb) for mb in range(num_microbatches)] + [B(r, mb) for mb in range(num_microbatches)]
        for r in range(num_ranks)
    ]
    return build_program("gpipe", num_microbatches, place_stages("one_to_one", num_ranks), orders)


register_schedule("gpipe", gpipe)
