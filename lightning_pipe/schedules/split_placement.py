"""Programs whose stages run on more than one rank: lowering and validation (``Program.pair_ranks``).

HelixPipe runs layer ``l``'s attention for microbatch ``i`` on rank ``(l + i + 1) mod p`` and SPipe runs
a stage's backward on another rank than its forward. A family of that kind decides, as every family
does, the compute order of each rank, plus the forward and backward rank of every
``(stage, microbatch)`` pair; :func:`build_split_program` derives the communication from them with the
rules of CONVENTIONS.md, extended by one message:

* ``F(s, i)`` needs ``(s-1 -> s, i)`` when the forward of ``(s-1, i)`` runs on another rank, and sends
  ``(s -> s+1, i)`` when the forward of ``(s+1, i)`` does;
* ``B``/``I`` of ``(s, i)`` need ``(s+1 -> s, i)`` and send ``(s -> s-1, i)`` across backward ranks;
* a pair whose backward runs on another rank than its forward ships its input, the *checkpoint*
  ``(s -> s, i)``: ``SEND_C`` right after its forward, ``RECV_C`` right before the pair's first
  backward-side compute (its ``RECOMPUTE``, or ``B``/``I``), which must rebuild the activations.

Between every ordered pair of ranks receives follow the peer's send order, as for any program.
:func:`lightning_pipe.schedules.validate` checks these programs with split-placement versions of its
structure and order checks (the rank of an action is its pair's, not its stage's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .ir import Action, ActionType, Program
from .lowering import is_communication, receives_up_to, recv_of, send_of

__all__ = ["build_split_program", "first_backward_flags", "split_messages"]

_F, _B, _I = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT
_RECOMPUTE = ActionType.RECOMPUTE

PairRanks = tuple[tuple[tuple[int, int], ...], ...]


def split_messages(
    action: Action, pair_ranks: PairRanks, first_backward: bool
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Messages ``action`` needs before it and produces after it, as ``(src, dst, microbatch)``.

    Args:
        action: a compute (or ``RECOMPUTE``) action.
        pair_ranks: ``[stage][microbatch] -> (forward_rank, backward_rank)``.
        first_backward: whether ``action`` is the first backward-side compute of its pair on its rank
            (it receives the pair's checkpoint when the forward ran elsewhere).
    """
    s, mb, kind = action.stage, action.microbatch, action.type
    needs: list[tuple[int, int, int]] = []
    produces: list[tuple[int, int, int]] = []
    if mb is None:
        return needs, produces
    last = len(pair_ranks) - 1
    forward, backward = pair_ranks[s][mb]
    if kind is _F:
        if s > 0 and pair_ranks[s - 1][mb][0] != forward:
            needs.append((s - 1, s, mb))
        if s < last and pair_ranks[s + 1][mb][0] != forward:
            produces.append((s, s + 1, mb))
        if backward != forward:
            produces.append((s, s, mb))
        return needs, produces
    if first_backward and backward != forward and (kind is _RECOMPUTE or kind is _B or kind is _I):
        needs.append((s, s, mb))
    if kind is _B or kind is _I:
        if s < last and pair_ranks[s + 1][mb][1] != backward:
            needs.append((s + 1, s, mb))
        if s > 0 and pair_ranks[s - 1][mb][1] != backward:
            produces.append((s, s - 1, mb))
    return needs, produces


def first_backward_flags(order: Sequence[Action]) -> list[bool]:
    """Per action of a rank's order: whether it is its pair's first backward-side compute there."""
    seen: set[tuple[int, int | None]] = set()
    flags = []
    for action in order:
        key = (action.stage, action.microbatch)
        first = action.type in (_RECOMPUTE, _B, _I) and key not in seen
        if first:
            seen.add(key)
        flags.append(first)
    return flags


def build_split_program(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    pair_ranks: PairRanks,
    compute_orders: Sequence[Iterable[Action]],
) -> Program:
    """Program with split placement from per-rank compute orders: communication inserted.

    Args:
        name: family name for display.
        num_microbatches: microbatches per step.
        stage_to_rank: the rank owning each stage's parameters.
        pair_ranks: ``[stage][microbatch] -> (forward_rank, backward_rank)``.
        compute_orders: per rank, compute (and memory) actions in execution order.

    Returns:
        The program; run :func:`lightning_pipe.schedules.validate` on it to check it.
    """
    orders = [[a for a in order if not is_communication(a.type)] for order in compute_orders]
    flags = [first_backward_flags(order) for order in orders]
    program_ranks = Program(name, len(stage_to_rank), num_microbatches, tuple(stage_to_rank), (), pair_ranks)
    sent: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for rank, order in enumerate(orders):
        for action, first in zip(order, flags[rank], strict=True):
            for message in split_messages(action, pair_ranks, first)[1]:
                sent.setdefault((rank, program_ranks.rank_of_action(recv_of(*message))), []).append(message)
    position = {pair: 0 for pair in sent}
    result: list[tuple[Action, ...]] = []
    for rank, order in enumerate(orders):
        received: set[tuple[int, int, int]] = set()
        out: list[Action] = []
        for action, first in zip(order, flags[rank], strict=True):
            needs, produces = split_messages(action, pair_ranks, first)
            for message in needs:
                if message in received:
                    continue
                pair = (program_ranks.rank_of_action(send_of(*message)), rank)
                out.extend(receives_up_to(message, sent.get(pair, []), pair, position, received))
            out.append(action)
            out.extend(send_of(*message) for message in produces)
        result.append(tuple(out))
    return Program(name, len(stage_to_rank), num_microbatches, tuple(stage_to_rank), tuple(result), pair_ranks)
