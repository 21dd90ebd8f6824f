"""ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split.

Each backward becomes ``I`` (input gradient, on the critical path: it is what the previous stage
waits for) and ``W`` (weight gradient, deferred). Rank ``r`` runs 1F1B's ``p - 1 - r`` warm-up
forwards, then steady ``F, I`` pairs, and starts emitting ``W`` (oldest first) only after its first
``r`` backwards: the deferred ``W`` fill the cool-down bubble. A microbatch's activations stay alive
until its ``W``, so every rank holds at most ``p`` microbatches: the peak of 1F1B's first rank.
With ``F = I = W`` the bubble is ``(p - 1)`` forward times instead of 1F1B's ``3 (p - 1)``.
"""

from __future__ import annotations

from ..ir import Action, F, I, Program, W
from ..lowering import build_program, place_stages
from ..registry import register_schedule
from ._common import check_sizes


def zb_h1(num_ranks: int, num_microbatches: int) -> Program:
    """Build the ZB-H1 program.

    Args:
        num_ranks: pipeline ranks (= stages) ``p``.
        num_microbatches: microbatches per step ``m``.

    Returns:
        The program, communication included (``I`` sends the gradient, ``W`` sends nothing).
    """
    check_sizes("zb_h1", num_ranks, num_microbatches)
    m = num_microbatches
    orders = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - 1 - rank, m)
        order: list[Action] = [F(rank, mb) for mb in range(warmup)]
        next_w = 0
        for k in range(m):
            if warmup + k < m:
                order.append(F(rank, warmup + k))
            order.append(I(rank, k))
            if k >= rank:
                order.append(W(rank, next_w))
                next_w += 1
        order += [W(rank, mb) for mb in range(next_w, m)]
        orders.append(order)
    return build_program("zb_h1", m, place_stages("one_to_one", num_ranks), orders)


register_schedule("zb_h1", zb_h1)
