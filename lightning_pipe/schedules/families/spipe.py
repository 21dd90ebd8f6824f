"""SPipe (GPU-CPU hybrid pipeline): decoupled backward assignment and finer backward stages.

The model is cut into ``I = p * stages_per_rank`` forward stages; forward stage ``i`` runs on rank
``i mod p`` and its backward is split into ``d = backward_split`` finer backward stages. The program's
global stages are these finer stages: ``q = d * i + k`` (``k < d``), so the forward of forward stage
``i`` is the ``d`` consecutive ``F`` of its finer stages on one rank. The backward of finer stage ``q``
runs on rank ``(I*d - 1 - q) mod p``: backward stages in execution order assigned round-robin from
rank 0 (the reading notes' rule, which reproduces the paper's Figures 5(c) and 8; the paper states no
general rule). Every backward recomputes its stage (``RECOMPUTE``) from a checkpoint: the stage's input,
sent (``SEND_C``/``RECV_C``) right after the forward to the rank of the backward when that is another
rank.

Order: forward stages in ascending order, all microbatches of one before the next (interleaved
all-forward-all-backward, like Mobius), then the rank's backward stages in descending order, all
microbatches each. ``decoupled=False`` runs every backward on its forward's rank (Mobius' coupled
assignment): a forward stage's whole backward (its finer stages back to back) per microbatch. Run on real ranks by
``runtime/split_executor.py`` (``runtime/spipe.py``), not by the strategy (``check_executable``
refuses split placement there).
"""

from __future__ import annotations

from ..ir import Action, ActionType, B, F, Program
from ..lowering import build_program
from ..split_placement import build_split_program
from ._common import check_sizes

__all__ = ["spipe"]


def spipe(
    num_ranks: int,
    num_microbatches: int,
    *,
    stages_per_rank: int = 2,
    backward_split: int = 2,
    decoupled: bool = True,
    recompute_in_backward: bool = False,
) -> Program:
    """Build the SPipe program.

    Args:
        num_ranks: pipeline ranks ``p`` (GPUs).
        num_microbatches: microbatches per step.
        stages_per_rank: forward stages per rank (the paper's default 2).
        backward_split: finer backward stages per forward stage ``d`` (Figure 8: 2; the paper's
            evaluation: 3).
        decoupled: SPipe's decoupled assignment (True) or Mobius' coupled one (False).
        recompute_in_backward: emit no ``RECOMPUTE`` action: every ``B`` includes its stage's
            recomputation (the costs must charge it; the paper's figures draw it so). A separate
            action may run before the gradient arrives.

    Returns:
        The program: ``p * stages_per_rank * backward_split`` stages.
    """
    check_sizes("spipe", num_ranks, num_microbatches)
    for argument, value in (("stages_per_rank", stages_per_rank), ("backward_split", backward_split)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"spipe: {argument} must be a positive integer, got {argument}={value!r}")
    p, m, d = num_ranks, num_microbatches, backward_split
    forward_stages = p * stages_per_rank
    num_stages = forward_stages * d

    def forward_rank(q: int) -> int:
        return (q // d) % p

    def backward_rank(q: int) -> int:
        return (num_stages - 1 - q) % p if decoupled else forward_rank(q)

    orders: list[list[Action]] = []
    for rank in range(p):
        order = [
            F(d * i + k, mb)
            for i in range(rank, forward_stages, p)
            for mb in range(m)
            for k in range(d)
        ]
        if decoupled:  # every finer backward stage is a stage of its own: all microbatches each
            groups = [[q] for q in sorted((q for q in range(num_stages) if backward_rank(q) == rank), reverse=True)]
        else:  # Mobius: a forward stage's whole backward per microbatch
            groups = [[d * i + k for k in reversed(range(d))] for i in reversed(range(rank, forward_stages, p))]
        for group in groups:
            for mb in range(m):
                for q in group:
                    if not recompute_in_backward:
                        order.append(Action(q, ActionType.RECOMPUTE, mb))
                    order.append(B(q, mb))
        orders.append(order)
    name = f"spipe(d={d}{'' if decoupled else ', coupled'})"
    if not decoupled:
        return build_program(name, m, tuple(forward_rank(q) for q in range(num_stages)), orders)
    pair_ranks = tuple(tuple((forward_rank(q), backward_rank(q)) for _ in range(m)) for q in range(num_stages))
    return build_split_program(name, m, tuple(backward_rank(q) for q in range(num_stages)), pair_ranks, orders)
