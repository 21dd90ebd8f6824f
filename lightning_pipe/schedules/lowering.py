"""Lowering passes: stage placement, compute order -> full program with communication, forward-only.

Generators (hand-written families and the DSL) only decide the *compute* order of every rank. The
point-to-point actions are then derived here, once, from that order, so that every program follows
CONVENTIONS.md the same way: a ``SEND`` right after the action that produced the tensor, a ``RECV``
right before the action that consumes it, and, between every ordered pair of ranks, receives in
exactly the order of the peer's sends (NCCL ignores tags, so order is the only thing that matches a
receive with its send). When a rank consumes messages of one peer in another order than the peer
sent them, the earlier-sent message is received early (just before the one that is needed). That
never adds a wait: the peer issued it before the needed one.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .ir import Action, ActionType, Program

__all__ = [
    "PLACEMENTS",
    "place_stages",
    "build_program",
    "insert_communication",
    "forward_only",
    "compute_only",
    "Message",
    "message_of",
]

#: Stage placement strategies understood by :func:`place_stages`.
PLACEMENTS = ("one_to_one", "circular", "v_shape")


def place_stages(placement: str, num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Rank of every global stage for a named placement strategy (CONVENTIONS.md).

    Args:
        placement: ``"one_to_one"`` (stage s on rank s, needs ``stages_per_rank == 1``),
            ``"circular"`` (stage s on rank ``s % num_ranks``: interleaved, looped BFS) or
            ``"v_shape"`` (2 stages per rank; stage s on rank s going down, back up after).
        num_ranks: number of pipeline ranks.
        stages_per_rank: number of stages each rank holds.

    Returns:
        ``stage_to_rank`` tuple of length ``num_ranks * stages_per_rank``.

    Raises:
        ValueError: for an unknown placement or a count it cannot place.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    num_stages = num_ranks * stages_per_rank
    if placement == "one_to_one":
        if stages_per_rank != 1:
            raise ValueError(
                f"placement 'one_to_one' puts exactly one stage on each rank, got stages_per_rank={stages_per_rank}; "
                "use placement 'circular' or 'v_shape' for several stages per rank"
            )
        return tuple(range(num_ranks))
    if placement == "circular":
        return tuple(s % num_ranks for s in range(num_stages))
    if placement == "v_shape":
        if stages_per_rank != 2:
            raise ValueError(f"placement 'v_shape' needs stages_per_rank=2, got stages_per_rank={stages_per_rank}")
        return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages))
    raise ValueError(f"unknown placement {placement!r}; valid placements: {', '.join(PLACEMENTS)}")


class Message(NamedTuple):
    """One point-to-point tensor: the activation or gradient crossing one stage boundary.

    A named tuple rather than a dataclass: the validator and simulator build one per communication
    action, and tuple construction is several times cheaper.

    Attributes:
        src_stage: stage that sends.
        dst_stage: stage that receives (``src_stage + 1`` forward, ``src_stage - 1`` backward,
            ``src_stage`` itself for a checkpoint: the stage's input sent to the rank of its backward).
        microbatch: microbatch it belongs to.
    """

    src_stage: int
    dst_stage: int
    microbatch: int

    @property
    def send(self) -> Action:
        """The ``SEND_F``/``SEND_B``/``SEND_C`` action of the sending stage."""
        return send_of(self.src_stage, self.dst_stage, self.microbatch)

    @property
    def recv(self) -> Action:
        """The ``RECV_F``/``RECV_B``/``RECV_C`` action of the receiving stage."""
        return recv_of(self.src_stage, self.dst_stage, self.microbatch)


_ENDPOINTS = {
    ActionType.SEND_F: (0, 1),
    ActionType.RECV_F: (-1, 0),
    ActionType.SEND_B: (0, -1),
    ActionType.RECV_B: (1, 0),
    ActionType.SEND_C: (0, 0),
    ActionType.RECV_C: (0, 0),
}


def message_of(action: Action) -> Message:
    """The message a communication action sends or receives.

    Raises:
        ValueError: if ``action`` is not one of the four point-to-point kinds.
    """
    offsets = _ENDPOINTS.get(action.type)
    if offsets is None or action.microbatch is None:
        raise ValueError(f"{action} is not a point-to-point action with a microbatch")
    return Message(action.stage + offsets[0], action.stage + offsets[1], action.microbatch)


# Identity tests on enum members: these helpers run once per action in every pass, and an Enum's
# ``__hash__`` (used by set membership) is a Python-level call.
_FORWARD, _BACKWARD, _INPUT = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B
_SEND_C, _RECV_C = ActionType.SEND_C, ActionType.RECV_C


def is_communication(kind: ActionType) -> bool:
    """Fast ``kind.is_communication``."""
    return (
        kind is _SEND_F or kind is _RECV_F or kind is _SEND_B or kind is _RECV_B or kind is _SEND_C or kind is _RECV_C
    )


def message_key(action: Action) -> tuple[int, int, int]:
    """``tuple(message_of(action))`` without building the named tuple (hot loops)."""
    offsets = _ENDPOINTS[action.type]
    return (action.stage + offsets[0], action.stage + offsets[1], action.microbatch)  # type: ignore[return-value]


def send_of(src: int, dst: int, microbatch: int) -> Action:
    """The send action of the message ``src -> dst`` for ``microbatch`` (``src == dst``: a checkpoint)."""
    return Action(src, _SEND_F if dst > src else _SEND_B if dst < src else _SEND_C, microbatch)


def recv_of(src: int, dst: int, microbatch: int) -> Action:
    """The receive action of the message ``src -> dst`` for ``microbatch`` (``src == dst``: a checkpoint)."""
    return Action(dst, _RECV_F if dst > src else _RECV_B if dst < src else _RECV_C, microbatch)


def _needs(action: Action, stage_to_rank: Sequence[int]) -> tuple[int, int, int] | None:
    """Message ``action`` must receive from another rank before it runs, if any."""
    s, mb, kind = action.stage, action.microbatch, action.type
    if mb is None:
        return None
    if kind is _FORWARD:
        if s > 0 and stage_to_rank[s - 1] != stage_to_rank[s]:
            return (s - 1, s, mb)
    elif kind is _BACKWARD or kind is _INPUT:
        if s < len(stage_to_rank) - 1 and stage_to_rank[s + 1] != stage_to_rank[s]:
            return (s + 1, s, mb)
    return None


def _produces(action: Action, stage_to_rank: Sequence[int]) -> tuple[int, int, int] | None:
    """Message ``action`` must send to another rank after it runs, if any."""
    s, mb, kind = action.stage, action.microbatch, action.type
    if mb is None:
        return None
    if kind is _FORWARD:
        if s < len(stage_to_rank) - 1 and stage_to_rank[s + 1] != stage_to_rank[s]:
            return (s, s + 1, mb)
    elif kind is _BACKWARD or kind is _INPUT:
        if s > 0 and stage_to_rank[s - 1] != stage_to_rank[s]:
            return (s, s - 1, mb)
    return None


def receives_up_to(
    message: tuple[int, int, int],
    queue: Sequence[tuple[int, int, int]],
    pair: tuple[int, int],
    position: dict[tuple[int, int], int],
    received: set[tuple[int, int, int]],
) -> list[Action]:
    """The receives a rank posts to get ``message`` from its peer: everything the peer sent on
    ``pair`` before it, in the peer's send order (NCCL matches in order), then ``message`` itself if
    the peer never sent it (the receive stays; ``validate()`` reports it). Advances ``position`` and
    ``received``."""
    out = []
    while position.get(pair, 0) < len(queue):
        early = queue[position[pair]]
        position[pair] += 1
        out.append(recv_of(*early))
        received.add(early)
        if early == message:
            break
    if message not in received:
        out.append(recv_of(*message))
        received.add(message)
    return out


def insert_communication(
    compute_orders: Sequence[Iterable[Action]], stage_to_rank: Sequence[int]
) -> tuple[tuple[Action, ...], ...]:
    """Add ``SEND``/``RECV`` actions to per-rank compute orders (CONVENTIONS.md).

    Args:
        compute_orders: per rank, its actions in execution order without communication (any
            existing communication actions are dropped and re-derived).
        stage_to_rank: rank of every global stage.

    Returns:
        Per-rank action tuples with communication, receives matched in order with the peer's sends.
    """
    orders = [[a for a in order if not is_communication(a.type)] for order in compute_orders]
    rank_of = tuple(stage_to_rank)
    # What each rank sends to each peer, in send order. Messages are (src_stage, dst_stage, mb).
    sent: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for rank, order in enumerate(orders):
        for action in order:
            message = _produces(action, rank_of)
            if message is not None:
                sent.setdefault((rank, rank_of[message[1]]), []).append(message)
    position = {pair: 0 for pair in sent}
    result: list[tuple[Action, ...]] = []
    for rank, order in enumerate(orders):
        received: set[tuple[int, int, int]] = set()
        out: list[Action] = []
        for action in order:
            message = _needs(action, rank_of)
            if message is not None and message not in received:
                pair = (rank_of[message[0]], rank)
                out.extend(receives_up_to(message, sent.get(pair, []), pair, position, received))
            out.append(action)
            produced = _produces(action, rank_of)
            if produced is not None:
                out.append(send_of(*produced))
        result.append(tuple(out))
    return tuple(result)


def build_program(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    compute_orders: Sequence[Iterable[Action]],
) -> Program:
    """Program from per-rank compute orders: communication inserted, nothing validated.

    Args:
        name: family or spec name for display.
        num_microbatches: microbatches per step.
        stage_to_rank: rank of every global stage.
        compute_orders: per rank, compute (and custom/memory) actions in execution order.

    Returns:
        The program; run :func:`lightning_pipe.schedules.validate` on it to check it.
    """
    placement = tuple(stage_to_rank)
    return Program(
        name=name,
        num_stages=len(placement),
        num_microbatches=num_microbatches,
        stage_to_rank=placement,
        actions=insert_communication(compute_orders, placement),
    )


_FORWARD_KINDS = frozenset({ActionType.FORWARD, ActionType.SEND_F, ActionType.RECV_F})


def forward_only(program: Program) -> Program:
    """The forward part of a program, for validation and prediction (no backward, no weights).

    Keeps ``F``, ``SEND_F`` and ``RECV_F`` in their original order on every rank. The forward
    messages keep their relative order on both sides, so the result stays matched and deadlock
    free whenever the original program was.

    Args:
        program: a training program.

    Returns:
        A program named ``"<name>/forward_only"`` with the same placement (and the same class:
        a heterogeneous ``LayoutProgram`` keeps its widths).
    """
    return dataclasses.replace(
        program,
        name=f"{program.name}/forward_only",
        actions=tuple(tuple(a for a in rank if a.type in _FORWARD_KINDS) for rank in program.actions),
    )


def compute_only(program: Program) -> tuple[tuple[Action, ...], ...]:
    """Per-rank actions without the point-to-point ones (torch's "compute_only" CSV format)."""
    return tuple(tuple(a for a in rank if not is_communication(a.type)) for rank in program.actions)
