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
:func:`lightning_pipe.schedules.validate` checks these programs with :func:`check_split_structure`
and :func:`check_split_order` in place of the one-rank-per-stage checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .action_rules import ACTION_RULES
from .ir import Action, ActionType, Program
from .lowering import is_communication, recv_of, send_of
from .validate import _fail

__all__ = ["build_split_program", "check_split_order", "check_split_structure", "split_messages"]

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


def _first_backward_flags(order: Sequence[Action]) -> list[bool]:
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
    flags = [_first_backward_flags(order) for order in orders]
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
                queue = sent.get(pair, [])
                while position.get(pair, 0) < len(queue):  # receive in the peer's send order
                    early = queue[position[pair]]
                    position[pair] += 1
                    out.append(recv_of(*early))
                    received.add(early)
                    if early == message:
                        break
                if message not in received:  # never sent: keep the receive; validate() reports it
                    out.append(recv_of(*message))
                    received.add(message)
            out.append(action)
            out.extend(send_of(*message) for message in produces)
        result.append(tuple(out))
    return Program(name, len(stage_to_rank), num_microbatches, tuple(stage_to_rank), tuple(result), pair_ranks)


def check_split_structure(program: Program) -> None:
    """Every action of a split-placement program sits on the rank its pair names, inside the ranges."""
    pair_ranks = program.pair_ranks
    assert pair_ranks is not None
    if len(pair_ranks) != program.num_stages or any(len(row) != program.num_microbatches for row in pair_ranks):
        _fail(program, "pair_ranks must have one (forward, backward) rank per stage and microbatch", "structure")
    for rank, actions in enumerate(program.actions):
        for step, a in enumerate(actions):
            if not 0 <= a.stage < program.num_stages:
                _fail(program, f"{a}: stage {a.stage} outside 0..{program.num_stages - 1}", "structure", rank, step)
            if a.microbatch is not None and not 0 <= a.microbatch < program.num_microbatches:
                _fail(program, f"{a}: microbatch outside 0..{program.num_microbatches - 1}", "structure", rank, step)
            if a.microbatch is None and a.type is not ActionType.STEP:
                _fail(program, f"{a}: needs a microbatch", "structure", rank, step)
            placed = program.rank_of_action(a)
            if placed != rank:
                _fail(program, f"{a}: its pair places it on rank {placed}, not here", "structure", rank, step)


def check_split_order(program: Program) -> None:
    """Dependencies of every action on its rank, with receives standing for work done elsewhere, and
    every message a compute action produces sent right there (the split-placement ``_check_order``)."""
    pair_ranks = program.pair_ranks
    assert pair_ranks is not None
    last = program.num_stages - 1
    for rank, actions in enumerate(program.actions):
        done: set[tuple] = set()
        flags = _first_backward_flags(actions)
        for step, a in enumerate(actions):
            s, mb = a.stage, a.microbatch
            for dependency in ACTION_RULES[a.type].requires:
                stage = s + dependency.stage_offset
                if stage < 0 or stage > last or mb is None:
                    continue
                there = {program.rank_of_action(Action(stage, kind, mb)) for kind in dependency.kinds}
                if rank in there:
                    if not any((kind, stage, mb) in done for kind in dependency.kinds):
                        _fail(program, f"{a} runs before {dependency.reason}", "dependency", rank, step)
                    continue
                receive = dependency.received_as if dependency.stage_offset else ActionType.RECV_C
                if (receive, s, mb) not in done:
                    why = dependency.received_reason if dependency.stage_offset else "receive of its checkpoint"
                    _fail(program, f"{a} runs before {Action(s, receive, mb)} ({why})", "dependency", rank, step)
            if a.type.is_compute or a.type is _RECOMPUTE:
                needs, _ = split_messages(a, pair_ranks, flags[step])
                for message in needs:
                    receive = recv_of(*message)
                    if (receive.type, receive.stage, receive.microbatch) not in done:
                        _fail(program, f"{a} runs before {receive}", "communication", rank, step)
            if is_communication(a.type) and (a.type, s, mb) in done:
                _fail(program, f"{a} appears twice", "communication", rank, step)
            done.add((a.type, s, mb))
        for step, a in enumerate(actions):
            if a.type.is_compute or a.type is _RECOMPUTE:
                for message in split_messages(a, pair_ranks, flags[step])[1]:
                    send = send_of(*message)
                    if (send.type, send.stage, send.microbatch) not in done:
                        _fail(program, f"{a} needs {send} after it", "communication", rank, step)
