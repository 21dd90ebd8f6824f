"""1F1B (PipeDream-Flush, Narayanan et al., 2019): one forward, one backward in the steady state.

Rank ``r`` holds stage ``r``. It runs ``min(p - 1 - r, m)`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. Same bubble as GPipe,
``(p - 1) / (m + p - 1)``, but rank ``r`` never holds more than ``p - r`` microbatches in flight.
"""

from __future__ import annotations

from ..ir import Action, B, F, Program
from ..lowering import build_program, place_stages
from ..registry import register_schedule
from ._common import check_sizes


def rank_order_1f1b(stage: int, num_ranks: int, num_microbatches: int, rank: int) -> list[Action]:
    """Compute order of one rank of 1F1B for ``stage`` (shared with the DSL tests)."""
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    order = [F(stage, mb) for mb in range(warmup)]
    for k in range(num_microbatches - warmup):
        order += [F(stage, warmup + k), B(stage, k)]
    order += [B(stage, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return order


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Program:
    """Build the 1F1B program.

    Args:
        num_ranks: pipeline ranks (= stages).
        num_microbatches: microbatches per step.

    Returns:
        The program, communication included.
    """
    check_sizes("1f1b", num_ranks, num_microbatches)
    orders = [rank_order_1f1b(r, num_ranks, num_microbatches, r) for r in range(num_ranks)]
    return build_program("1f1b", num_microbatches, place_stages("one_to_one", num_ranks), orders)


register_schedule("1f1b", one_f_one_b)
