"""Validator: proves a program correct before anyone runs it.

A program is correct when (1) every compute action happens exactly once (``F`` and either ``B`` or
``I`` + ``W`` per stage and microbatch), (2) each rank's order respects the data dependencies,
(3) communication actions are present exactly where CONVENTIONS.md requires, (4) between every
ordered pair of ranks the sends of one side and the receives of the other match one-to-one in order
and (5) it cannot deadlock when sends never block and receives block until the matching send was
issued. The first broken rule raises :class:`ScheduleError` with the rank, the step, the action and
a step x rank grid of the program with the failing step marked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .action_rules import ACTION_RULES
from .instructions import is_registered_instruction
from .ir import Action, ActionType, Program
from .lowering import Message, _produces, is_communication, message_key, message_of, recv_of, send_of
from .split_placement import first_backward_flags, split_messages

__all__ = ["ScheduleError", "format_grid", "validate"]

_F, _B, _I, _W = (ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)
_RECOMPUTE = ActionType.RECOMPUTE
_BACKWARD_KINDS = frozenset({_B, _I, _W})
_RECV = frozenset({ActionType.RECV_F, ActionType.RECV_B})


def _is_compute(kind: ActionType) -> bool:
    """Fast ``kind.is_compute`` (identity tests; Enum hashing is a Python-level call)."""
    return kind is _F or kind is _B or kind is _I or kind is _W


_GRID_WINDOW = 12  # steps shown on each side of the failing step in long programs


class ScheduleError(ValueError):
    """A program breaks a rule of CONVENTIONS.md; says which rank, step, action and rule.

    Attributes:
        rule: short name of the broken rule (``"exactly_once"``, ``"dependency"``,
            ``"communication"``, ``"matching"``, ``"deadlock"``, ``"structure"``).
        rank: rank where it was found, or None for whole-program problems.
        step: index in that rank's action list, or None.
        action: the offending action, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        rule: str,
        rank: int | None = None,
        step: int | None = None,
        action: Action | None = None,
        grid: str = "",
    ) -> None:
        self.rule = rule
        self.rank = rank
        self.step = step
        self.action = action
        self.grid = grid
        where = "" if rank is None else f"rank {rank}" + ("" if step is None else f", step {step}")
        text = f"[{rule}] {where + ': ' if where else ''}{message}"
        super().__init__(text + (f"\n\n{grid}" if grid else ""))


def format_grid(
    actions: Sequence[Sequence[Action]],
    mark: tuple[int, int] | None = None,
    window: int | None = None,
) -> str:
    """Text grid of a program, one row per step and one column per rank (torch's layout).

    Args:
        actions: per-rank action lists.
        mark: ``(rank, step)`` to highlight: the cell is bracketed and the row ends in ``<-- here``.
        window: show only this many steps on each side of the marked step (None: all steps).

    Returns:
        The grid as text, with a header row naming the ranks.
    """
    num_steps = max((len(a) for a in actions), default=0)
    first, last = 0, num_steps
    if mark is not None and window is not None:
        first, last = max(0, mark[1] - window), min(num_steps, mark[1] + window + 1)
    cells = [[str(a) for a in rank] for rank in actions]
    if mark is not None and 0 <= mark[0] < len(cells) and 0 <= mark[1] < len(cells[mark[0]]):
        cells[mark[0]][mark[1]] = f"[{cells[mark[0]][mark[1]]}]"
    widths = [max([len(f"rank {r}")] + [len(c) for c in col]) for r, col in enumerate(cells)]
    label = len(f"step {max(num_steps - 1, 0)}")
    lines = [" " * (label + 2) + " ".join(f"{f'rank {r}':<{w}}" for r, w in enumerate(widths))]
    if first > 0:
        lines.append(f"{'...':<{label}}")
    for step in range(first, last):
        row = " ".join(f"{(col[step] if step < len(col) else ''):<{w}}" for col, w in zip(cells, widths, strict=True))
        suffix = "  <-- here" if mark is not None and step == mark[1] else ""
        lines.append(f"{f'step {step}':<{label}}: {row.rstrip()}{suffix}")
    if last < num_steps:
        lines.append(f"{'...':<{label}}")
    return "\n".join(lines)


def _fail(program: Program, message: str, rule: str, rank: int | None = None, step: int | None = None) -> None:
    action = None
    mark = None
    if rank is not None and step is not None and step < len(program.actions[rank]):
        action = program.actions[rank][step]
        mark = (rank, step)
    longest = max((len(a) for a in program.actions), default=0)
    window = _GRID_WINDOW if mark is not None and longest > 2 * _GRID_WINDOW + 1 else None
    grid = format_grid(program.actions, mark=mark, window=window)
    raise ScheduleError(message, rule=rule, rank=rank, step=step, action=action, grid=grid)


def _check_structure(program: Program) -> None:
    if program.num_stages != len(program.stage_to_rank):
        _fail(
            program,
            f"num_stages={program.num_stages} but stage_to_rank has {len(program.stage_to_rank)} entries",
            "structure",
        )
    bad = [r for r in program.stage_to_rank if not 0 <= r < program.num_ranks]
    if bad:
        _fail(
            program,
            f"stage_to_rank={program.stage_to_rank} names ranks {bad} outside 0..{program.num_ranks - 1}",
            "structure",
        )
    for rank, actions in enumerate(program.actions):
        for step, a in enumerate(actions):
            if not 0 <= a.stage < program.num_stages:
                _fail(program, f"{a}: stage {a.stage} outside 0..{program.num_stages - 1}", "structure", rank, step)
            if program.stage_to_rank[a.stage] != rank:
                _fail(
                    program,
                    f"{a}: stage {a.stage} is placed on rank {program.stage_to_rank[a.stage]}, not here",
                    "structure",
                    rank,
                    step,
                )
            if a.type is ActionType.CUSTOM:
                if not a.name or not is_registered_instruction(a.name):
                    _fail(
                        program,
                        f"{a}: unknown instruction {a.name!r}; register it with register_instruction()",
                        "structure",
                        rank,
                        step,
                    )
                if a.microbatch is not None and not 0 <= a.microbatch < program.num_microbatches:
                    _fail(
                        program, f"{a}: microbatch outside 0..{program.num_microbatches - 1}", "structure", rank, step
                    )
                continue
            if a.microbatch is None or not 0 <= a.microbatch < program.num_microbatches:
                _fail(
                    program,
                    f"{a}: microbatch {a.microbatch} outside 0..{program.num_microbatches - 1}",
                    "structure",
                    rank,
                    step,
                )


def _check_exactly_once(program: Program, forward_only: bool) -> None:
    counts: Counter[tuple[ActionType, int, int]] = Counter()
    where: dict[tuple[ActionType, int, int], tuple[int, int]] = {}
    for rank, actions in enumerate(program.actions):
        for step, a in enumerate(actions):
            if _is_compute(a.type):
                key = (a.type, a.stage, a.microbatch)
                counts[key] += 1
                if counts[key] == 2:
                    _fail(
                        program,
                        f"{a} appears twice (every compute action must run exactly once)",
                        "exactly_once",
                        rank,
                        step,
                    )
                where[key] = (rank, step)
    for s in range(program.num_stages):
        rank = program.stage_to_rank[s]
        for mb in range(program.num_microbatches):
            if counts[(_F, s, mb)] != 1:
                _fail(program, f"forward {Action(s, _F, mb)} is missing", "exactly_once", rank)
            full, split_i, split_w = counts[(_B, s, mb)], counts[(_I, s, mb)], counts[(_W, s, mb)]
            if forward_only:
                if full or split_i or split_w:
                    key = next(k for k in ((_B, s, mb), (_I, s, mb), (_W, s, mb)) if counts[k])
                    _fail(program, f"{Action(s, key[0], mb)} in a forward-only program", "exactly_once", *where[key])
                continue
            if full and (split_i or split_w):
                _fail(
                    program,
                    f"stage {s} microbatch {mb} has both B and I/W; use B or I+W",
                    "exactly_once",
                    *where[(_B, s, mb)],
                )
            if not full and not (split_i and split_w):
                missing = "B (or I and W)" if not split_i and not split_w else ("W" if split_i else "I")
                _fail(program, f"stage {s} microbatch {mb}: {missing} missing", "exactly_once", rank)


def _order_requirements(a: Action, rank: int, rank_of: Sequence[int], last: int) -> list[tuple[tuple, str]]:
    """What must already have run on this rank before ``a``: ``(key, reason)`` pairs.

    A key is ``(type, stage, microbatch)``, or a tuple of such keys when any one of them will do.
    """
    s, mb = a.stage, a.microbatch
    required: list[tuple[tuple, str]] = []
    for dependency in ACTION_RULES[a.type].requires:
        stage = s + dependency.stage_offset
        if stage < 0 or stage > last:
            continue
        if dependency.stage_offset and rank_of[stage] != rank:
            assert dependency.received_as is not None, dependency
            required.append(((dependency.received_as, s, mb), dependency.received_reason))
            continue
        keys = tuple((kind, stage, mb) for kind in dependency.kinds)
        required.append((keys[0] if len(keys) == 1 else keys, dependency.reason))
    return required


def _check_order(program: Program) -> None:
    """Local dependencies and presence of communication, one rank at a time."""
    rank_of = program.stage_to_rank
    last = program.num_stages - 1
    for rank, actions in enumerate(program.actions):
        done: set[tuple] = set()
        for step, a in enumerate(actions):
            key = (a.type, a.stage, a.microbatch)
            for required, why in _order_requirements(a, rank, rank_of, last):
                if isinstance(required[0], tuple):
                    if not any(r in done for r in required):
                        _fail(program, f"{a} runs before {why}", "dependency", rank, step)
                elif required not in done:
                    _fail(
                        program,
                        f"{a} runs before {Action(required[1], required[0], required[2])} ({why})",
                        "dependency",
                        rank,
                        step,
                    )
            if is_communication(a.type):
                if key in done:
                    _fail(program, f"{a} appears twice", "communication", rank, step)
                msg = message_of(a)
                if not 0 <= msg.dst_stage <= last or rank_of[msg.dst_stage] == rank_of[msg.src_stage]:
                    _fail(
                        program,
                        f"{a} crosses no rank boundary (stages {msg.src_stage}->{msg.dst_stage})",
                        "communication",
                        rank,
                        step,
                    )
            done.add(key)
        # Every tensor this rank produces for another rank is sent.
        for step, a in enumerate(actions):
            if _is_compute(a.type):
                message = _produces(a, rank_of)
                if message is not None:
                    send = send_of(*message)
                    if (send.type, send.stage, send.microbatch) not in done:
                        _fail(program, f"{a} needs {send} after it (CONVENTIONS.md)", "communication", rank, step)


def _check_matching_and_deadlock(program: Program) -> None:
    comms, sends, recvs = _communications(program)
    _check_matching(program, sends, recvs)
    _check_deadlock(program, comms)


_Key = tuple[int, int, int]  # a message: (sending stage, receiving stage, microbatch)
_Rows = list[list[tuple[bool, _Key] | None]]
_ByPair = dict[tuple[int, int], list[tuple[_Key, int]]]


def _communications(program: Program) -> tuple[_Rows, _ByPair, _ByPair]:
    """Per rank, (is_receive, message key) of each action (None for computation); and the sends and
    receives (key, step) per (sending rank, receiving rank), in program order."""
    rank_of = program.stage_to_rank
    split = program.pair_ranks is not None
    comms: _Rows = []
    sends: _ByPair = {}
    recvs: _ByPair = {}
    for rank, actions in enumerate(program.actions):
        row: list[tuple[bool, _Key] | None] = []
        for step, a in enumerate(actions):
            kind = a.type
            if is_communication(kind):
                key = message_key(a)
                receive = kind is ActionType.RECV_F or kind is ActionType.RECV_B or kind is ActionType.RECV_C
                if split:  # split placement: the peer is where the other end of the message runs
                    peer = program.rank_of_action(send_of(*key) if receive else recv_of(*key))
                else:
                    peer = rank_of[key[0]] if receive else rank_of[key[1]]
                if receive:
                    recvs.setdefault((peer, rank), []).append((key, step))
                else:
                    sends.setdefault((rank, peer), []).append((key, step))
                row.append((receive, key))
            else:
                row.append(None)
        comms.append(row)
    return comms, sends, recvs


def _check_matching(program: Program, sends: _ByPair, recvs: _ByPair) -> None:
    """Between two ranks, the k-th send and the k-th receive carry the same message."""
    for pair in sorted(set(sends) | set(recvs)):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(out), len(into))):
            if k >= len(into):
                _fail(
                    program,
                    f"{Message(*out[k][0]).send} has no matching receive on rank {pair[1]}",
                    "matching",
                    pair[0],
                    out[k][1],
                )
            if k >= len(out):
                _fail(
                    program,
                    f"{Message(*into[k][0]).recv} has no matching send on rank {pair[0]}",
                    "matching",
                    pair[1],
                    into[k][1],
                )
            if out[k][0] != into[k][0]:
                _fail(
                    program,
                    f"receive #{k} from rank {pair[0]} is {Message(*into[k][0]).recv} but that rank's send #{k} is "
                    f"{Message(*out[k][0]).send} (sends and receives between two ranks must match in order)",
                    "matching",
                    pair[1],
                    into[k][1],
                )


def _check_deadlock(program: Program, comms: _Rows) -> None:
    """Every rank reaches its end when each receive waits only for its send to be issued."""
    # Deadlock: advance every rank as far as it can; a receive waits for its send to be issued.
    issued: set[tuple[int, int, int]] = set()
    pointer = [0] * program.num_ranks
    progress = True
    while progress:
        progress = False
        for rank, steps in enumerate(comms):
            position = pointer[rank]
            while position < len(steps):
                comm = steps[position]
                if comm is not None:
                    if comm[0]:
                        if comm[1] not in issued:
                            break
                    else:
                        issued.add(comm[1])
                position += 1
            if position != pointer[rank]:
                pointer[rank] = position
                progress = True
    blocked = [r for r, actions in enumerate(program.actions) if pointer[r] < len(actions)]
    if blocked:
        waits = ", ".join(f"rank {r} waits at step {pointer[r]} on {program.actions[r][pointer[r]]}" for r in blocked)
        _fail(
            program,
            f"no rank can move on (receives block until their send is issued): {waits}",
            "deadlock",
            blocked[0],
            pointer[blocked[0]],
        )


def _check_split_structure(program: Program) -> None:
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
            if a.microbatch is None:
                _fail(program, f"{a}: needs a microbatch", "structure", rank, step)
            placed = program.rank_of_action(a)
            if placed != rank:
                _fail(program, f"{a}: its pair places it on rank {placed}, not here", "structure", rank, step)


def _check_split_order(program: Program) -> None:
    """Dependencies of every action on its rank, with receives standing for work done elsewhere, and
    every message a compute action produces sent right there (the split-placement ``_check_order``)."""
    pair_ranks = program.pair_ranks
    assert pair_ranks is not None
    last = program.num_stages - 1
    for rank, actions in enumerate(program.actions):
        done: set[tuple] = set()
        flags = first_backward_flags(actions)
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


def validate(program: Program, *, forward_only: bool | None = None) -> Program:
    """Check every rule of CONVENTIONS.md; raise :class:`ScheduleError` at the first broken one.

    Args:
        program: the program to check.
        forward_only: True for a program with forwards only (validation/predict; see
            :func:`lightning_pipe.schedules.forward_only`); None decides from the program (no
            backward action at all means forward-only).

    Returns:
        ``program`` itself, so that ``validate(build(...))`` chains.

    Raises:
        ScheduleError: naming the rank, step, action and rule, with the step x rank grid.
    """
    if forward_only is None:
        forward_only = not any(a.type in _BACKWARD_KINDS for actions in program.actions for a in actions)
    if program.pair_ranks is not None:
        _check_split_structure(program)
        _check_exactly_once(program, forward_only)
        _check_split_order(program)
    else:
        _check_structure(program)
        _check_exactly_once(program, forward_only)
        _check_order(program)
    _check_matching_and_deadlock(program)
    return program
