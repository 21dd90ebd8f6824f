"""The DSL's scheduler: FlexPipe's step loop over dependency-free actions, one action per rank per step.

At every step each rank picks at most one action among those whose dependencies were completed in
an *earlier* step (results become visible one step later, like FlexPipe's local buffers), by:

1. pending registered instructions first (they follow their anchor action immediately);
2. the computation-type priority: ``backward_first`` tries ``B``/``I`` then ``F``;
   ``forward_first`` the reverse; ``interleaved`` alternates ``forward_unit`` forwards and
   ``backward_unit`` backwards (before the rank's first backward it falls back to forwards when no
   backward is ready; afterwards it waits for the preferred kind while that kind has work left);
   deferred ``W`` (``split_backward``) come last and so fill what would be bubbles;
3. the stage-traversal priority within a kind: ``breadth_first`` takes the ready action of the
   rank's lowest stage, ``depth_first`` of its highest; with an ``interval`` ``k`` the rank takes
   ``k`` consecutive actions of one stage, in strict order, before moving to the next stage in that
   direction (cyclically) and waits when that action is not ready;
4. the in-flight limit: a microbatch is in flight on a rank from its first forward there to its
   last backward there (``W`` if split); a forward that would bring a *new* microbatch in is
   allowed only while fewer than ``max_in_flight`` are in flight. Later stages of admitted
   microbatches are never held back, so the limit alone cannot deadlock circular or V placements;
5. user rules: any rule returning False vetoes the candidate for this step.

Within a stage, actions of one kind run in microbatch order. If some step leaves every rank without
an action while work remains, the spec deadlocks and :class:`ScheduleError` says where.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .instructions import custom_action, get_instruction
from .ir import Action, ActionType, Program
from .lowering import build_program
from .validate import ScheduleError, format_grid

__all__ = ["RuleContext", "EngineSettings", "run_engine"]

_F, _B, _I, _W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT


@dataclass(frozen=True)
class RuleContext:
    """What a user rule sees when asked whether ``action`` may run on ``rank`` at ``step``.

    Attributes:
        rank: the rank choosing.
        step: the scheduling step (0-based; every rank takes at most one action per step).
        action: the candidate.
        num_ranks: pipeline ranks.
        num_stages: global stages.
        num_microbatches: microbatches per step.
        stage_to_rank: placement.
        in_flight: microbatches in flight on this rank (forwarded here, not yet fully backwarded here).
        completed: ``{(type, stage, microbatch): step}`` of every action scheduled so far (kept
            only when the spec has rules).
    """

    rank: int
    step: int
    action: Action
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    in_flight: int
    completed: dict

    def step_of(self, action: Action) -> int | None:
        """Step at which ``action`` was scheduled, or None if it was not yet."""
        return self.completed.get((action.type, action.stage, action.microbatch))


Rule = Callable[[RuleContext], bool]


@dataclass(frozen=True)
class EngineSettings:
    """Resolved, per-rank settings the engine runs with (built by :mod:`lightning_pipe.schedules.dsl`)."""

    name: str
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    priority: str
    forward_unit: int
    backward_unit: int
    forward_descending: bool
    backward_descending: bool
    forward_interval: int | tuple[int, ...] | None
    backward_interval: int | tuple[int, ...] | None
    max_in_flight: tuple[float, ...]
    split_backward: bool
    instructions: tuple[str, ...]
    rules: tuple[Rule, ...]


class _Traversal:
    """Stage choice for one kind on one rank: free (first ready in direction) or strict with interval.

    ``interval`` is an int, or a list of ints used one per round (one pass over the rank's stages).
    """

    def __init__(self, stages: Sequence[int], descending: bool, interval: int | Sequence[int] | None) -> None:
        self.order = sorted(stages, reverse=descending)
        self.intervals = None if interval is None else ([interval] if isinstance(interval, int) else list(interval))
        self.position = 0
        self.taken = 0
        self.round = 0

    def _move(self) -> None:
        self.position, self.taken = (self.position + 1) % len(self.order), 0
        if self.position == 0:
            self.round += 1

    def candidates(self, remaining: Callable[[int], bool]) -> Sequence[int]:
        if self.intervals is None:
            return self.order  # the caller skips stages without remaining work
        for _ in range(len(self.order)):
            if remaining(self.order[self.position]):
                return (self.order[self.position],)
            self._move()
        return ()

    def took(self, stage: int) -> None:
        if self.intervals is None:
            return
        self.taken += 1
        if self.taken >= self.intervals[min(self.round, len(self.intervals) - 1)]:
            self._move()


def run_engine(settings: EngineSettings) -> list[list[Action]]:
    """Compute order of every rank for ``settings`` (communication not yet inserted).

    Raises:
        ScheduleError: when no rank can move while work remains (rule ``"deadlock"``).
    """
    return _Engine(settings).run()


class _Engine:
    """The DSL's step loop: at every step each rank runs at most one action, the first its priority
    order allows (:meth:`kinds`, :meth:`pick`), and what ran updates the counters (:meth:`record`).

    Step numbers live in lists indexed by stage and microbatch, not in dicts keyed by actions: hashing
    tuples that hold Enum members (a Python-level ``__hash__``) dominated the engine's time.
    """

    def __init__(self, settings: EngineSettings) -> None:
        placement = settings.stage_to_rank
        self.settings = settings
        self.num_ranks, self.last = max(placement) + 1, len(placement) - 1
        self.num_stages = len(placement)
        self.m = m = settings.num_microbatches
        self.backward_kind = _I if settings.split_backward else _B
        self.stages_of = [[s for s, r in enumerate(placement) if r == rank] for rank in range(self.num_ranks)]
        self.next_mb = {(kind, s): 0 for s in range(len(placement)) for kind in (_F, self.backward_kind)}
        self.completed: dict[tuple, int] = {}  # (type, stage, microbatch) -> step, for rules
        never = float("inf")
        # step at which F / B-or-I of (stage, microbatch) ran
        self.forward_step = [[never] * m for _ in placement]
        self.backward_step = [[never] * m for _ in placement]
        self.pending_w: list[deque[Action]] = [deque() for _ in range(self.num_ranks)]
        self.pending_custom: list[deque[Action]] = [deque() for _ in range(self.num_ranks)]
        self.in_flight = [0] * self.num_ranks  # distinct microbatches alive on the rank
        self.alive = [[0] * m for _ in range(self.num_ranks)]  # per rank and microbatch: pairs alive
        self.phase = [[_F, 0] for _ in range(self.num_ranks)]  # interleaved priority: kind preferred now, count
        self.started = [False] * self.num_ranks  # whether the rank ran a backward yet
        self.forward_walk = [
            _Traversal(st, settings.forward_descending, settings.forward_interval) for st in self.stages_of
        ]
        self.backward_walk = [
            _Traversal(st, settings.backward_descending, settings.backward_interval) for st in self.stages_of
        ]
        self.anchors = [get_instruction(name) for name in settings.instructions]
        self.orders: list[list[Action]] = [[] for _ in range(self.num_ranks)]
        self.step = 0

    def ready(self, kind: ActionType, s: int, mb: int) -> bool:
        step = self.step
        if kind is _F:
            return s == 0 or self.forward_step[s - 1][mb] < step
        return self.forward_step[s][mb] < step and (s == self.last or self.backward_step[s + 1][mb] < step)

    def allowed(self, rank: int, action: Action) -> bool:
        settings = self.settings
        if not settings.rules:
            return True
        context = RuleContext(
            rank, self.step, action, self.num_ranks, self.num_stages, self.m, settings.stage_to_rank,
            self.in_flight[rank], self.completed,
        )
        return all(rule(context) for rule in settings.rules)

    def pick(self, rank: int, kind: ActionType) -> Action | None:
        if kind is _W:
            queue = self.pending_w[rank]
            if not queue or self.backward_step[queue[0].stage][queue[0].microbatch] >= self.step:
                return None
            return queue[0] if self.allowed(rank, queue[0]) else None
        m, next_mb, alive = self.m, self.next_mb, self.alive[rank]
        full = kind is _F and self.in_flight[rank] >= self.settings.max_in_flight[rank]
        walk = self.forward_walk[rank] if kind is _F else self.backward_walk[rank]
        for s in walk.candidates(lambda s: next_mb[(kind, s)] < m):
            mb = next_mb[(kind, s)]
            if mb >= m:
                continue
            if full and not alive[mb]:
                continue  # a new microbatch would exceed max_in_flight; admitted ones may go on
            action = Action(s, kind, mb)
            if self.ready(kind, s, mb) and self.allowed(rank, action):
                return action
        return None

    def kinds(self, rank: int) -> list[ActionType]:
        settings, backward_kind = self.settings, self.backward_kind
        if settings.priority == "forward_first":
            order = [_F, backward_kind]
        elif settings.priority == "backward_first":
            order = [backward_kind, _F]
        else:
            preferred = self.phase[rank][0]
            other = backward_kind if preferred is _F else _F
            # Strict alternation once the rank has run a backward (Megatron's steady state): wait for
            # the preferred kind while it still has work on this rank.
            strict = self.started[rank] and any(self.next_mb[(preferred, s)] < self.m for s in self.stages_of[rank])
            order = [preferred] if strict else [preferred, other]
        return order + ([_W] if settings.split_backward else [])

    def record(self, rank: int, action: Action) -> None:
        settings, kind, backward_kind = self.settings, action.type, self.backward_kind
        if kind is _F or kind is backward_kind:
            self.next_mb[(kind, action.stage)] += 1
            (self.forward_walk if kind is _F else self.backward_walk)[rank].took(action.stage)
            if settings.priority == "interleaved":
                unit = settings.forward_unit if kind is _F else settings.backward_unit
                phase = self.phase[rank]
                count = phase[1] + 1 if phase[0] is kind else 1
                self.phase[rank] = [backward_kind if kind is _F else _F, 0] if count >= unit else [kind, count]
        mb, alive, in_flight = action.microbatch, self.alive[rank], self.in_flight
        if kind is _F:
            in_flight[rank] += alive[mb] == 0
            alive[mb] += 1
        else:
            self.started[rank] = True
        if kind is _B or kind is _W:
            alive[mb] -= 1
            in_flight[rank] -= alive[mb] == 0
        if kind is _I:
            self.pending_w[rank].append(Action(action.stage, _W, action.microbatch))
        elif kind is _W:
            self.pending_w[rank].popleft()
        for instruction in self.anchors:
            if kind is instruction.after and instruction.applies_to(
                action.stage, action.microbatch, self.num_stages, self.m
            ):
                self.pending_custom[rank].append(custom_action(action.stage, instruction.name, action.microbatch))

    def choose(self) -> list[tuple[int, Action]]:
        """What every rank runs at this step (a pending instruction first, else its preferred action)."""
        chosen: list[tuple[int, Action]] = []
        for rank in range(self.num_ranks):
            if self.pending_custom[rank]:
                chosen.append((rank, self.pending_custom[rank].popleft()))
                continue
            for kind in self.kinds(rank):
                action = self.pick(rank, kind)
                if action is not None:
                    chosen.append((rank, action))
                    break
        return chosen

    def run(self) -> list[list[Action]]:
        settings = self.settings
        total = self.num_stages * self.m * (3 if settings.split_backward else 2)
        scheduled_compute = idle_streak = 0
        while scheduled_compute < total or any(self.pending_custom):
            chosen = self.choose()
            if not chosen:
                idle_streak += 1
                # Without rules an idle step changes nothing: deadlock. Rules may depend on the step
                # number, so give them as many idle steps as there are actions before giving up.
                if not settings.rules or idle_streak > total:
                    _deadlock(settings, self.orders, self.step, self.in_flight)
            else:
                idle_streak = 0
            for rank, action in chosen:
                if settings.rules:
                    self.completed[(action.type, action.stage, action.microbatch)] = self.step
                if action.type is _F:
                    self.forward_step[action.stage][action.microbatch] = self.step
                elif action.type is self.backward_kind:
                    self.backward_step[action.stage][action.microbatch] = self.step
                self.orders[rank].append(action)
                if action.type is not ActionType.CUSTOM:
                    scheduled_compute += 1
                    self.record(rank, action)
            self.step += 1
        return self.orders


def _deadlock(settings: EngineSettings, orders: list[list[Action]], step: int, in_flight: list[int]) -> None:
    limits = ", ".join(
        f"rank {r}: {n} in flight (max_in_flight={settings.max_in_flight[r]:g})" for r, n in enumerate(in_flight)
    )
    raise ScheduleError(
        f"spec {settings.name!r} deadlocks at scheduling step {step}: no rank has an action it may run ({limits}); "
        "raise max_in_flight, drop an interval, or relax a rule",
        rule="deadlock",
        grid=format_grid(orders),
    )


def engine_program(settings: EngineSettings) -> Program:
    """Run the engine and lower the result (communication inserted, not validated)."""
    return build_program(settings.name, settings.num_microbatches, settings.stage_to_rank, run_engine(settings))
