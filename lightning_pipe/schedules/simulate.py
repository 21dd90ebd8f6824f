"""Discrete-event simulator: how long a program takes, how idle each rank is, how much memory it holds.

Each rank runs its actions in order. A compute action takes its cost from :class:`ActionCosts`, as
the table of :mod:`~lightning_pipe.schedules.action_rules` says (``RECOMPUTE`` costs a forward; a
registered instruction costs its ``seconds``). A send takes no
time on the sender; the matching receive completes at ``max(issue time, send time + transfer)``.
Memory is accounted per rank as static bytes plus the saved activations alive: a stage's saved
bytes for a microbatch are held from its ``F`` until its ``B`` (until ``W`` for zero-bubble), not
while offloaded (between ``OFFLOAD`` and ``RELOAD``), and, for pairs that have a ``RECOMPUTE``, only
from the ``RECOMPUTE`` on (before it, the pair's ``checkpoint_bytes`` when the costs give them). Under
split placement (``Program.pair_ranks``) a checkpoint (``SEND_C``/``RECV_C``) is one more message, and
a pair whose backward runs elsewhere holds nothing on its forward's rank. Limits: no compute/communication overlap model beyond non-blocking
sends, no link contention, memory as a count of bytes (no fragmentation, no workspace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .action_rules import ACTION_RULES, instruction_seconds, saves_again
from .costs import ActionCosts
from .ir import Action, ActionType, Program
from .lowering import message_key
from .validate import ScheduleError, format_grid

__all__ = ["TimedAction", "SimulationResult", "simulate"]

_SEND_F, _SEND_B, _RECV_F, _RECV_B = ActionType.SEND_F, ActionType.SEND_B, ActionType.RECV_F, ActionType.RECV_B
_SEND_C, _RECV_C = ActionType.SEND_C, ActionType.RECV_C


@dataclass(frozen=True)
class TimedAction:
    """One action placed in time: what the simulator produces and what a real run records.

    Attributes:
        rank: pipeline rank that ran it.
        action: the action.
        start: seconds since the step started.
        end: seconds since the step started (``end - start`` includes a receive's wait).
        arrival: real steps only: when the message from another rank that the action consumes
            arrived, if the action had to wait for it (None when it was already there, and in
            simulations, where an action starts when its message arrives).
    """

    rank: int
    action: Action
    start: float
    end: float
    arrival: float | None = None

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated step of a program looks like.

    Attributes:
        name: the program's name.
        num_ranks: pipeline ranks.
        makespan: seconds from the first action to the last one finishing.
        busy: per rank, seconds spent computing (communication waits are not busy).
        idle: per rank, ``makespan - busy``.
        bubble_ratio: ``sum(idle) / (num_ranks * makespan)``, 0 for an empty program.
        peak_memory: per rank, static bytes plus the peak of saved activation bytes alive.
        max_in_flight: per rank, the peak number of microbatches in flight there: forward run on
            some stage of the rank and backward (``B``, or ``W`` for zero-bubble) not yet run on
            all of them. The same count the DSL's ``max_in_flight`` limits.
        critical_path: the chain of actions, each waiting on the previous one, that ends last.
        events: every action with its start and end, rank by rank in program order.
    """

    name: str
    num_ranks: int
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_ratio: float
    peak_memory: tuple[float, ...]
    max_in_flight: tuple[int, ...]
    critical_path: tuple[Action, ...]
    events: tuple[TimedAction, ...]


def _check_costs(program: Program, costs: ActionCosts) -> None:
    if costs.num_stages < program.num_stages or costs.num_microbatches < program.num_microbatches:
        raise ValueError(
            f"costs cover {costs.num_stages} stages x {costs.num_microbatches} microbatches but program "
            f"{program.name!r} has {program.num_stages} x {program.num_microbatches}; build costs for "
            f"num_stages={program.num_stages}, num_microbatches={program.num_microbatches}"
        )


def _duration(action: Action, costs: ActionCosts) -> float:
    s, mb, duration = action.stage, action.microbatch, ACTION_RULES[action.type].duration
    if duration == "forward":
        return costs.forward[s][mb]
    if duration == "backward":
        return costs.backward[s][mb]
    if duration == "input_gradient":
        return costs.input_gradient(s, mb)
    if duration == "weight_gradient":
        return costs.weight_gradient(s, mb)
    if duration == "instruction":
        return instruction_seconds(action)
    return 0.0


def _memory(program: Program, rank: int, costs: ActionCosts, training: bool) -> tuple[float, int]:
    """Peak bytes (static + saved) and peak in-flight pairs of one rank, from its action order."""
    static = sum(costs.static_bytes[s] for s in program.stages_of(rank)) if costs.static_bytes else 0.0
    recomputed = {(a.stage, a.microbatch) for a in program.actions[rank] if saves_again(a.type)}
    # Split placement: a forward whose backward runs on another rank keeps nothing here (it ships its
    # input instead, ``SEND_C``); a recomputed pair holds its checkpoint until its ``RECOMPUTE``.
    shipped = {(a.stage, a.microbatch) for a in program.actions[rank] if a.type is _SEND_C}
    checkpoints = costs.checkpoint_bytes
    # ... and a pair whose forward ran on another rank and that is not recomputed here holds nothing here.
    received = {(a.stage, a.microbatch) for a in program.actions[rank] if a.type is _RECV_C}
    shipped_in = received - recomputed
    held: dict[tuple[int, int | None], float] = {}
    offloaded: dict[tuple[int, int | None], float] = {}
    alive = peak = 0.0
    in_flight = max_in_flight = 0  # distinct microbatches with a (stage, microbatch) pair alive
    pairs: dict[int | None, int] = {}
    for a in program.actions[rank]:
        key = (a.stage, a.microbatch)
        saved = costs.saved_bytes[a.stage][a.microbatch] if costs.saved_bytes and a.microbatch is not None else 0.0
        rule = ACTION_RULES[a.type]
        if rule.starts_pair:
            if training and key not in shipped:
                pairs[a.microbatch] = pairs.get(a.microbatch, 0) + 1
                in_flight += pairs[a.microbatch] == 1
                if key not in recomputed:
                    held[key] = saved
                    alive += saved
                elif checkpoints is not None:
                    held[key] = checkpoints[a.stage][a.microbatch]
                    alive += held[key]
        elif rule.saves:  # saved again later in the step (RECOMPUTE)
            if key in received:  # the pair's forward ran on another rank: it starts here
                pairs[a.microbatch] = pairs.get(a.microbatch, 0) + 1
                in_flight += pairs[a.microbatch] == 1
            alive += saved - held.get(key, 0.0)
            held[key] = saved
        elif rule.frees:
            if key in shipped_in:  # split placement: the pair was never started on this rank
                continue
            pairs[a.microbatch] = pairs.get(a.microbatch, 0) - 1
            in_flight -= pairs[a.microbatch] == 0
            alive -= held.pop(key, 0.0)
        elif rule.offloads and key in held:
            offloaded[key] = held.pop(key)
            alive -= offloaded[key]
        elif rule.reloads and key in offloaded:
            held[key] = offloaded.pop(key)
            alive += held[key]
        peak = max(peak, alive)
        max_in_flight = max(max_in_flight, in_flight)
    return static + peak, max_in_flight


def simulate(program: Program, costs: ActionCosts, *, record_events: bool = True) -> SimulationResult:
    """Simulate one step of ``program`` with per-action ``costs``.

    Does not check the program (run :func:`lightning_pipe.schedules.validate` for that) except
    that it must finish: a receive whose send never comes is reported as a deadlock.

    Args:
        program: what every rank runs.
        costs: seconds and bytes per stage and microbatch; must cover the program's stages.
        record_events: False skips ``events`` and ``critical_path`` (left empty): about twice as
            fast, for planners that only compare numbers.

    Returns:
        Makespan, per-rank busy/idle time, bubble ratio, peak memory, in-flight peak, critical
        path and the timed events.

    Raises:
        ValueError: if ``costs`` do not cover the program.
        ScheduleError: if some rank waits forever on a receive.
    """
    _check_costs(program, costs)
    num_ranks = program.num_ranks
    run = _run(program, _compile(program, costs), record_events)
    makespan = max(run.ends, default=0.0)
    idle = tuple(makespan - b for b in run.busy)
    bubble = sum(idle) / (num_ranks * makespan) if makespan > 0 else 0.0
    training = any(
        a.type is ActionType.BACKWARD or a.type is ActionType.BACKWARD_INPUT
        for actions in program.actions
        for a in actions
    )
    memory = [_memory(program, r, costs, training) for r in range(num_ranks)]
    return SimulationResult(
        name=program.name,
        num_ranks=num_ranks,
        makespan=makespan,
        busy=tuple(run.busy),
        idle=idle,
        bubble_ratio=bubble,
        peak_memory=tuple(m for m, _ in memory),
        max_in_flight=tuple(n for _, n in memory),
        critical_path=_critical_path(run.events, run.predecessor),
        events=tuple(run.events),
    )


def _compile(program: Program, costs: ActionCosts) -> list[list[tuple]]:
    """Per rank and step: ``(0, duration)`` compute, ``(1, message)`` send, ``(2, message, transfer)`` receive."""
    plans: list[list[tuple]] = []
    for actions in program.actions:
        plan: list[tuple] = []
        for a in actions:
            kind = a.type
            if kind is _SEND_F or kind is _SEND_B or kind is _SEND_C:
                plan.append((1, message_key(a)))
            elif kind is _RECV_F or kind is _RECV_B or kind is _RECV_C:
                key = message_key(a)
                plan.append((2, key, costs.transfer(min(key[0], key[1]), key[2])))
            else:
                plan.append((0, _duration(a, costs)))
        plans.append(plan)
    return plans


@dataclass
class _Run:
    """What the event loop produced: every event's end, per-rank busy time, and (when recorded) the
    events with the index of the event each waited on (-1: none)."""

    ends: list[float]
    busy: list[float]
    events: list[TimedAction]
    predecessor: list[int]


def _run(program: Program, plans: list[list[tuple]], record_events: bool) -> _Run:
    """Sweep the ranks, each running its steps until it blocks on a receive whose send has not run,
    until no rank moves; then every rank must be done, or the program deadlocks."""
    num_ranks = program.num_ranks
    clock = [0.0] * num_ranks
    pointer = [0] * num_ranks
    last_event = [-1] * num_ranks
    run = _Run([], [0.0] * num_ranks, [], [])
    ends, busy = run.ends, run.busy
    send_event: dict[tuple[int, int, int], int] = {}
    progress = True
    while progress:
        progress = False
        for rank, plan in enumerate(plans):
            actions = program.actions[rank]
            position, time = pointer[rank], clock[rank]
            while position < len(plan):
                step = plan[position]
                before = last_event[rank]
                if step[0] == 2:
                    sender = send_event.get(step[1])
                    if sender is None:
                        break
                    arrival = ends[sender] + step[2]
                    end = time if time >= arrival else arrival
                    if arrival > time:
                        before = sender
                else:
                    end = time + step[1] if step[0] == 0 else time
                    busy[rank] += end - time
                    if step[0] == 1:
                        send_event[step[1]] = len(ends)
                if record_events:
                    run.predecessor.append(before)
                    run.events.append(TimedAction(rank, actions[position], time, end))
                last_event[rank] = len(ends)
                ends.append(end)
                time = end
                position += 1
            if position != pointer[rank]:
                pointer[rank], clock[rank] = position, time
                progress = True
    _raise_if_blocked(program, pointer)
    return run


def _raise_if_blocked(program: Program, pointer: list[int]) -> None:
    blocked = [r for r in range(program.num_ranks) if pointer[r] < len(program.actions[r])]
    if blocked:
        rank = blocked[0]
        waits = ", ".join(f"rank {r} waits on {program.actions[r][pointer[r]]}" for r in blocked)
        raise ScheduleError(
            f"simulation cannot finish: {waits}",
            rule="deadlock",
            rank=rank,
            step=pointer[rank],
            action=program.actions[rank][pointer[rank]],
            grid=format_grid(program.actions, mark=(rank, pointer[rank]), window=12),
        )


def _critical_path(events: Sequence[TimedAction], predecessor: Sequence[int]) -> tuple[Action, ...]:
    if not events:
        return ()
    index = max(range(len(events)), key=lambda i: (events[i].end, -i))
    path = []
    while index >= 0:
        path.append(events[index].action)
        index = predecessor[index]
    return tuple(reversed(path))
