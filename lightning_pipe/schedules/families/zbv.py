"""ZB-V (Qi et al., 2024, section 6): zero-bubble schedule on a V-shaped placement, 2 stages per rank.

Rank ``r`` holds stage ``r`` (chunk 0, going down the ranks) and stage ``2p - 1 - r`` (chunk 1,
coming back up), so the last stage and the first stage both live on rank 0 and the turn at rank
``p - 1`` needs no communication. The order is the paper's handcrafted one (as in torch's
``ScheduleZBVZeroBubble``): a warm-up of ``2 (p - r) - 1`` chunk-0 forwards, ``r`` pairs of
forwards on both chunks, ``p - r`` chunk-1 ``F I W`` triples, a steady state of
``F0 I0 W0 F1 I1 W1``, and a cool-down that interleaves the remaining ``I`` with deferred ``W``.
It is zero-bubble when ``F = I = W`` per chunk and ``m >= 2p - 1``; for smaller ``m`` it is built for
``2p - 1`` microbatches and the extra ones are dropped (valid, with bubbles).
"""

from __future__ import annotations

from ..ir import Action, F, I, Program, W
from ..lowering import build_program, place_stages
from ..registry import register_schedule
from ._common import check_sizes


def _rank_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    p = num_ranks
    n = max(2 * p - 1, num_microbatches)
    down, up = rank, 2 * p - 1 - rank
    count = {"f0": 0, "f1": 0, "i0": 0, "i1": 0, "w0": 0, "w1": 0}
    order: list[Action] = []

    def emit(kind: str) -> None:
        stage = down if kind.endswith("0") else up
        make = {"f": F, "i": I, "w": W}[kind[0]]
        order.append(make(stage, count[kind]))
        count[kind] += 1

    for _ in range(2 * (p - rank) - 1):
        emit("f0")
    for _ in range(rank):
        emit("f1")
        emit("f0")
    for _ in range(p - rank):
        emit("f1")
        emit("i1")
        emit("w1")
    while count["f1"] < count["f0"] or count["f0"] < n:
        if count["f0"] < n:
            emit("f0")
        emit("i0")
        emit("w0")
        emit("f1")
        emit("i1")
        emit("w1")
    for _ in range(rank):
        emit("i0")
        emit("i1")
    for _ in range(p - rank):
        emit("i0")
        emit("w0")
    while count["w1"] < count["i1"]:
        emit("w1")
    while count["w0"] < count["i0"]:
        emit("w0")
    assert all(count[k] == n for k in count), (rank, count)  # internal invariant of the construction
    return [a for a in order if a.microbatch is not None and a.microbatch < num_microbatches]


def zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Program:
    """Build the ZB-V program.

    Args:
        num_ranks: pipeline ranks ``p`` (the model is cut into ``2p`` stages).
        num_microbatches: microbatches per step ``m``.
        stages_per_rank: must be 2 (accepted so configs can state it).

    Returns:
        The program, communication included.

    Raises:
        ValueError: if ``stages_per_rank != 2``.
    """
    check_sizes("zbv", num_ranks, num_microbatches)
    if stages_per_rank != 2:
        raise ValueError(f"zbv needs exactly 2 stages per rank (V shape), got stages_per_rank={stages_per_rank}")
    orders = [_rank_order(r, num_ranks, num_microbatches) for r in range(num_ranks)]
    return build_program("zbv", num_microbatches, place_stages("v_shape", num_ranks, 2), orders)


register_schedule("zbv", zbv)
