"""Sliced 1F1B (Seq1F1B / InfiniPipe's token-level 1F1B): slices of one sequence, backward last slice first.

A long sequence cut into ``n`` slices becomes ``n`` consecutive microbatches. Slice ``j`` attends to
the keys and values of slices ``0 .. j-1``, so the gradients of those keys and values are complete
only after every later slice's backward: the backwards of a sequence run **last slice first**.
``slices`` gives the number of slices of each sequence, in microbatch order (``(1, 1, 3, 1)``: two
whole microbatches, a sequence in three slices, one more whole microbatch).

Rank ``r`` runs 1F1B counted in slices: ``p - 1 - r + N - 1`` warm-up forwards (``N``: slices of
the longest sequence), then one forward per backward, and more where the ``k``-th backward belongs
to a sequence whose later slices have not run forward yet (before the backward of any slice of a
sequence, every forward up to its last slice plus ``p - 1 - r`` more, so that upstream ranks keep
working while the last rank turns around). So in the steady state stage ``p`` (1-indexed) holds
``d_p - p + N`` microbatches in flight with ``N`` slices per sequence (InfiniPipe Eq. 7); with one
slice per sequence this is 1F1B.

With ``pipelines`` (InfiniPipe's sequence grouping, §3.3.2) the sequences form several consecutive
1F1B pipelines, each rank running one after the other, so each pipeline has its own window.

Not registered as a family name: the strategy runs it for a packed batch that slices (``schedule="1f1b"``,
docs/long_sequences.md); the planners and the simulated benchmarks use it too.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ir import Action, B, F, Program
from ..lowering import build_program, place_stages
from ._common import check_sizes


def backward_order(slices: Sequence[int]) -> list[int]:
    """Microbatches in backward order: sequences in order, each sequence's slices last first."""
    order, start = [], 0
    for count in slices:
        order += list(range(start + count - 1, start - 1, -1))
        start += count
    return order


def rank_order_sliced_1f1b(
    stage: int, num_ranks: int, slices: Sequence[int], rank: int, offset: int = 0
) -> list[Action]:
    """Compute order of one rank of sliced 1F1B for ``stage`` (microbatches numbered from ``offset``)."""
    num_microbatches = sum(slices)
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    last_of = {}
    start = 0
    for count in slices:
        for mb in range(start, start + count):
            last_of[mb] = start + count - 1
        start += count
    lead = warmup + max(slices, default=1) - 1  # 1F1B's warm-up counted in slices of the longest sequence
    order: list[Action] = []
    forwards = 0
    for k, mb in enumerate(backward_order(slices)):
        needed = min(num_microbatches, max(lead + k + 1, last_of[mb] + 1 + warmup))
        while forwards < needed:
            order.append(F(stage, offset + forwards))
            forwards += 1
        order.append(B(stage, offset + mb))
    return order


def sliced_1f1b(
    num_ranks: int,
    num_microbatches: int,
    slices: Sequence[int] | None = None,
    pipelines: Sequence[int] | None = None,
) -> Program:
    """Build the sliced 1F1B program.

    Args:
        num_ranks: pipeline ranks (= stages).
        num_microbatches: microbatches per step (slices included).
        slices: slices of each sequence in microbatch order, summing to ``num_microbatches``;
            None: every microbatch is a whole sequence (1F1B).
        pipelines: InfiniPipe's sequence grouping (§3.3.2): entries of ``slices`` per consecutive 1F1B
            pipeline, in order; each rank runs the pipelines one after the other (its own warm-up,
            steady phase and cool-down each: a flush between them, gradients accumulating across them).
            None: one pipeline.

    Raises:
        ValueError: ``slices`` does not sum to ``num_microbatches`` or holds a count below 1, or
            ``pipelines`` does not split ``slices``.
    """
    check_sizes("sliced_1f1b", num_ranks, num_microbatches)
    slices = tuple(slices) if slices is not None else (1,) * num_microbatches
    if sum(slices) != num_microbatches or min(slices, default=1) < 1:
        raise ValueError(
            f"sliced_1f1b: `slices={slices}` must be positive counts summing to num_microbatches={num_microbatches}."
        )
    pipelines = tuple(pipelines) if pipelines is not None else (len(slices),)
    if sum(pipelines) != len(slices) or min(pipelines, default=1) < 1:
        raise ValueError(
            f"sliced_1f1b: `pipelines={pipelines}` must be positive counts of sequences summing to the {len(slices)} "
            "entries of `slices`."
        )
    orders: list[list[Action]] = [[] for _ in range(num_ranks)]
    first_group = offset = 0
    for count in pipelines:
        group = slices[first_group : first_group + count]
        for r in range(num_ranks):
            orders[r] += rank_order_sliced_1f1b(r, num_ranks, group, r, offset)
        first_group += count
        offset += sum(group)
    return build_program("sliced_1f1b", num_microbatches, place_stages("one_to_one", num_ranks), orders)

