"""Choose recompute and offload per (stage, microbatch) under a memory budget.

The decision variables are InfiniPipe's (§3.3.3): per stage ``s`` and microbatch ``m``, how many of
the stage's blocks are recomputed, here split by kind, ``full[s, m]`` and ``keep[s, m]`` (attention
outputs kept), plus how many are offloaded, ``offload[s, m]``, all integers with
``full + keep + offload <= blocks(s)``. Saved bytes are linear in them (InfiniPipe Eq. 19), so the
memory constraint at every in-flight window of the program (every ``F``, and every backward with its
one-block recompute/reload transient) is a linear inequality (Eq. 20).

Two objectives:

* ``"makespan"`` (default): the simulated step time itself. The program's dependency graph (the same
  max-plus recurrence :func:`~lightning_pipe.schedules.simulate` evaluates) becomes linear
  constraints ``end[op] >= end[previous] + duration(op)``, ``end[recv] >= end[send] + transfer``,
  ``T >= end[last]``; recompute adds to backward durations, offload stalls (transfer time not hidden
  behind a block's compute) to forward and backward. Minimizing ``T`` (plus a tiny weight on total
  recompute seconds, so that recompute off the critical path is not chosen for nothing) gives the
  plan with the smallest simulated step time among those that fit.
* ``"recompute"``: InfiniPipe's Eq. 20, minimize total recompute seconds; with
  ``tie_diagonals=True`` also its Eq. 15 (one variable per backward "diagonal" of a 1F1B pipeline).

Both are solved with ``scipy.optimize.milp`` (HiGHS). :func:`plan_greedy` is the fast fallback: while
some window is over budget, add the cheapest bytes-per-second step (one more block recomputed,
attention-kept or offloaded) among the microbatches alive in it. Plans are checked with
:func:`~lightning_pipe.planning.memory_model.predict_memory` before being returned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_pipe.planning.chunk_memory import ChunkMemory
from lightning_pipe.planning.cost_model import CostModel, LinearCost, MicrobatchShape, UnitCost
from lightning_pipe.planning.memory_model import (
    FULL,
    KEEP_ATTENTION,
    NONE,
    OFFLOAD,
    MemoryPlan,
    MemoryPrediction,
    MemoryProfile,
    StageMemory,
    format_size,
    predict_memory,
    stage_footprints,
)
from lightning_pipe.schedules.costs import ActionCosts, SplitBackward
from lightning_pipe.schedules.action_rules import ACTION_RULES, backward_share, instruction_seconds
from lightning_pipe.schedules.split_schedules import refuse_split_placement
from lightning_pipe.schedules.ir import ActionType, Program
from lightning_pipe.schedules.lowering import message_of
from lightning_pipe.schedules.simulate import simulate

__all__ = ["MemoryBudgetError", "MemoryPlanResult", "plan_memory", "plan_greedy", "profile_cost_model", "step_seconds"]

_OPTIONS = (FULL, KEEP_ATTENTION, OFFLOAD)


class MemoryBudgetError(ValueError):
    """No plan fits the memory budget; the message says what would."""


@dataclass(frozen=True)
class MemoryPlanResult:
    """A chosen memory plan and what it costs.

    Attributes:
        plan: recompute/offload per (stage, microbatch).
        prediction: predicted memory per rank under ``plan``.
        step_seconds: simulated step time with the plan's recompute and offload stalls.
        recompute_seconds: total seconds of recomputation and offload stalls added over all ranks.
        method: ``"none"`` (nothing needed), ``"milp"`` or ``"greedy"``.
        budget: bytes per device the plan was chosen for.
        gap: how far the plan's objective may be above the best under the model, as a fraction of it
            (HiGHS's reported relative gap): 0 when nothing was needed or the MILP proved optimality
            to its tolerance, inf for a greedy plan (no bound).
    """

    plan: MemoryPlan
    prediction: MemoryPrediction
    step_seconds: float
    recompute_seconds: float
    method: str
    budget: float
    gap: float = 0.0


def profile_cost_model(profile: MemoryProfile, device_flops: float = 1e12) -> CostModel:
    """A flop-count cost model from a memory profile, for plans when no measured cost model is given.

    Forward flops of a block ``2 * parameters * tokens + 4 * hidden * sum_squared_lengths`` (matmuls
    and attention's two products), backward twice; ``pre`` costs nothing, ``post``
    ``2 * parameters * tokens``. Only ratios matter to the planner.
    """
    units = []
    for index, unit in enumerate(profile.units):
        is_block = 0 < index < len(profile.units) - 1
        per_token = 2.0 * unit.parameters / device_flops if index > 0 else 0.0
        per_square = 4.0 * unit.hidden / device_flops if is_block else 0.0
        units.append(
            UnitCost(
                name=unit.name,
                forward=LinearCost(0.0, per_token, per_square),
                backward=LinearCost(0.0, 2 * per_token, 2 * per_square),
                saved_bytes=unit.saved[NONE],
                parameter_bytes=unit.parameter_bytes,
            )
        )
    return CostModel(units=tuple(units))


# --- per-(stage, microbatch) numbers -------------------------------------------------------------


@dataclass
class _Problem:
    """Everything the solvers need, as arrays ``[stage, microbatch]`` (per block values are means)."""

    chunks: ChunkMemory | None
    program: Program
    boundaries: tuple[int, ...]
    shapes: list[MicrobatchShape]
    profile: MemoryProfile
    static_stage: list[float]
    budget: float
    options: tuple[str, ...]
    blocks: np.ndarray  # [S] blocks per stage
    base: np.ndarray  # saved bytes with nothing recomputed
    gain: dict[str, np.ndarray]  # bytes saved per block by each option
    transient: dict[str, np.ndarray]  # backward transient of one block in each option
    seconds: dict[str, np.ndarray]  # added backward seconds per block (offload: backward stall)
    offload_forward_stall: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    transfer: np.ndarray
    costs: ActionCosts
    split_backward: bool
    mlp_chunk_size: int | None
    split_shares: SplitBackward | None = None  # the cost model's measured shares of I and W (None: halves)

    def plan_of(self, counts: dict[str, np.ndarray]) -> MemoryPlan:
        entries = {}
        S, M = self.base.shape
        for s in range(S):
            for m in range(M):
                values = {o: int(round(counts[o][s, m])) for o in _OPTIONS}
                choice = StageMemory(
                    full=values[FULL], keep_attention=values[KEEP_ATTENTION], offload=values[OFFLOAD],
                    mlp_chunk_size=self.mlp_chunk_size,
                )
                if not choice.is_default:
                    entries[(s, m)] = choice
        return MemoryPlan(StageMemory(mlp_chunk_size=self.mlp_chunk_size), {}, entries)

    def durations(self, counts: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds ``[S, M]`` with the counts' recompute and stalls."""
        added = sum(counts[o] * self.seconds[o] for o in _OPTIONS)
        forward = self.forward + counts[OFFLOAD] * self.offload_forward_stall
        # with split backward (I then W) each pass recomputes: twice the recompute over the pair
        backward = self.backward + (2.0 if self.split_backward else 1.0) * added
        return forward, backward

    def step_seconds(self, counts: dict[str, np.ndarray]) -> float:
        forward, backward = self.durations(counts)
        table = lambda a: tuple(tuple(float(v) for v in row) for row in a)  # noqa: E731
        split_tables = {"backward_input": None, "backward_weight": None}  # None: half of the backward each
        if self.split_shares is not None:  # each pass its share of the plain backward, plus its own recompute
            added = sum(counts[o] * self.seconds[o] for o in _OPTIONS)
            shares = np.array([self.split_shares.shares(s) for s in range(len(self.backward))])  # [S, 2]
            split_tables = {
                "backward_input": table(shares[:, :1] * self.backward + added),
                "backward_weight": table(shares[:, 1:] * self.backward + added),
            }
        costs = dataclasses.replace(self.costs, forward=table(forward), backward=table(backward), **split_tables)
        return simulate(self.program, costs).makespan

    def added_seconds(self, counts: dict[str, np.ndarray]) -> float:
        forward, backward = self.durations(counts)
        return float((forward - self.forward).sum() + (backward - self.backward).sum())


def _problem(
    program: Program,
    boundaries: Sequence[int],
    shapes: Sequence[MicrobatchShape],
    profile: MemoryProfile,
    budget: float,
    cost_model: CostModel | None,
    options: Sequence[str],
    host_bandwidth: float,
    static_bytes: Sequence[float] | None,
    mlp_chunk_size: int | None,
    chunks: ChunkMemory | None = None,
) -> _Problem:
    refuse_split_placement(program, "the memory planner")
    bounds = tuple(int(b) for b in boundaries)
    if chunks is not None and chunks.num_microbatches != len(shapes):
        raise ValueError(f"`chunks` describes {chunks.num_microbatches} microbatches, `shapes` {len(shapes)}.")
    model = cost_model if cost_model is not None else profile_cost_model(profile)
    if model.num_blocks != profile.num_blocks:
        raise ValueError(f"The cost model has {model.num_blocks} blocks but the memory profile {profile.num_blocks}.")
    costs = model.stage_costs(bounds, shapes)
    split = program.splits_backward
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"Unknown memory options {sorted(unknown)}; choose among {list(_OPTIONS)}.")
    if split:
        options = [o for o in options if o != KEEP_ATTENTION]  # selective checkpointing allows one backward pass
    S, M = program.num_stages, len(shapes)
    blocks = np.array([bounds[s + 1] - bounds[s] for s in range(S)], dtype=float)
    base = np.zeros((S, M))
    gain = {o: np.zeros((S, M)) for o in _OPTIONS}
    transient = {o: np.zeros((S, M)) for o in _OPTIONS}
    seconds = {o: np.zeros((S, M)) for o in _OPTIONS}
    stall_forward = np.zeros((S, M))
    for s in range(S):
        pre, units, post = profile.stage_units(bounds, s)
        for m, shape in enumerate(shapes):
            base[s, m] = sum(u.saved_bytes(NONE, shape) for u in (pre, *units, post) if u is not None)
            if not units:
                continue
            n = len(units)
            attention = chunks.attention[m] if chunks is not None else 0.0
            base[s, m] += n * (attention + (chunks.kept[m] if chunks is not None else 0.0))
            whole = sum(u.saved_bytes(NONE, shape) for u in units) / n + attention
            block_costs = model.units[1 + bounds[s] : 1 + bounds[s + 1]]
            fwd = sum(u.forward.evaluate(shape) for u in block_costs) / n
            bwd = sum(u.backward.evaluate(shape) for u in block_costs) / n
            linear = sum(LinearCost(u.forward.constant, u.forward.per_token).evaluate(shape) for u in block_costs) / n
            gain[FULL][s, m] = whole - sum(u.saved_bytes(FULL, shape) for u in units) / n
            gain[KEEP_ATTENTION][s, m] = whole - attention - sum(u.saved_bytes(KEEP_ATTENTION, shape) for u in units) / n
            gain[OFFLOAD][s, m] = whole
            transient[FULL][s, m] = gain[FULL][s, m]
            transient[KEEP_ATTENTION][s, m] = gain[KEEP_ATTENTION][s, m]
            transient[OFFLOAD][s, m] = whole
            seconds[FULL][s, m] = fwd
            seconds[KEEP_ATTENTION][s, m] = linear
            copy = whole / host_bandwidth if host_bandwidth > 0 else math.inf
            seconds[OFFLOAD][s, m] = max(0.0, copy - bwd)
            stall_forward[s, m] = max(0.0, copy - fwd)
    for o in _OPTIONS:
        if o not in options:
            gain[o][:] = 0.0
    transfer = np.array([[costs.transfer(s, m) for m in range(M)] for s in range(S)])
    return _Problem(
        chunks, program, bounds, list(shapes), profile,
        list(static_bytes) if static_bytes is not None else profile.static_bytes(bounds), float(budget),
        tuple(options), blocks, base, gain, transient, seconds, stall_forward,
        np.array(costs.forward, dtype=float), np.array(costs.backward, dtype=float), transfer, costs, split,
        mlp_chunk_size, model.split_backward,
    )


def _windows(program: Program, rank: int) -> list[tuple[frozenset, tuple[int, int] | None, bool]]:
    """Distinct memory checkpoints of a rank: (pairs alive, pair whose transient adds, transient kind)."""
    alive: set[tuple[int, int]] = set()
    seen = set()
    result = []
    for action in program.actions[rank]:
        if action.microbatch is None:
            continue
        key, rule = (action.stage, action.microbatch), ACTION_RULES[action.type]
        if rule.starts_pair:
            alive.add(key)
            entry = (frozenset(alive), key, True)
        elif rule.uses_saved:
            entry = (frozenset(alive), key, False)
        else:
            continue
        if entry not in seen:
            seen.add(entry)
            result.append(entry)
        if rule.frees:
            alive.discard(key)
    return result


@dataclass(frozen=True)
class _Operation:
    """One action of the program as a node of the step's dependency graph."""

    action: object
    previous: int  # operation before it on the same rank, or -1
    sender: int  # for a receive, its send; -1 otherwise
    boundary: int  # stage boundary a receive's message crosses


def _operations(program: Program) -> tuple[list[_Operation], list[int]]:
    """Every action with its same-rank predecessor and, for receives, the matching send; last op per rank."""
    index: dict[tuple[int, int], int] = {}
    sends = {}
    for rank, actions in enumerate(program.actions):
        for position, action in enumerate(actions):
            index[(rank, position)] = len(index)
            if action.type in (ActionType.SEND_F, ActionType.SEND_B):
                sends[message_of(action)] = index[(rank, position)]
    operations, last = [], []
    for rank, actions in enumerate(program.actions):
        for position, action in enumerate(actions):
            sender = boundary = -1
            if action.type in (ActionType.RECV_F, ActionType.RECV_B):
                message = message_of(action)
                sender = sends[message]
                boundary = min(message.src_stage, message.dst_stage)
            operations.append(_Operation(action, index[(rank, position - 1)] if position else -1, sender, boundary))
        last.append(index[(rank, len(actions) - 1)] if actions else -1)
    return operations, last


# --- greedy --------------------------------------------------------------------------------------


def _zero_counts(problem: _Problem) -> dict[str, np.ndarray]:
    return {o: np.zeros_like(problem.base) for o in _OPTIONS}


def _event_bytes(problem: _Problem, counts, window, pair, forward: bool) -> float:
    total = 0.0
    for s, m in window:
        total += problem.base[s, m] - sum(counts[o][s, m] * problem.gain[o][s, m] for o in _OPTIONS)
    s, m = pair
    if forward:
        total += problem.gain[OFFLOAD][s, m] if counts[OFFLOAD][s, m] > 0 else 0.0
    else:
        total += max([problem.transient[o][s, m] for o in _OPTIONS if counts[o][s, m] > 0], default=0.0)
    return total


class _CheckBytes:
    """:func:`_event_bytes` of every check at once (the greedy's scan of all checks, vectorized)."""

    def __init__(self, problem: _Problem, checks: list) -> None:
        self.problem = problem
        num_microbatches = problem.base.shape[1]
        self.windows = np.zeros((len(checks), problem.base.size))  # [check, stage * microbatch]: 1 if alive
        for i, (_, window, _, _) in enumerate(checks):
            for s, m in window:
                self.windows[i, s * num_microbatches + m] = 1.0
        self.rooms = np.array([room for room, _, _, _ in checks], dtype=float)
        self.has_pair = np.array([pair is not None for _, _, pair, _ in checks], dtype=bool)
        pairs = [pair if pair is not None else (0, 0) for _, _, pair, _ in checks]
        self.stages = np.array([s for s, _ in pairs], dtype=int)
        self.microbatches = np.array([m for _, m in pairs], dtype=int)
        self.forward = np.array([forward for _, _, _, forward in checks], dtype=bool)

    def of(self, counts: dict[str, np.ndarray]) -> np.ndarray:
        """Bytes at every check under ``counts`` (as :func:`_event_bytes` sums them)."""
        problem, s, m = self.problem, self.stages, self.microbatches
        kept = problem.base - sum(counts[o] * problem.gain[o] for o in _OPTIONS)
        total = self.windows @ kept.ravel()
        offloaded = np.where(counts[OFFLOAD][s, m] > 0, problem.gain[OFFLOAD][s, m], 0.0)
        transients = np.stack([np.where(counts[o][s, m] > 0, problem.transient[o][s, m], -np.inf) for o in _OPTIONS])
        transient = transients.max(axis=0)
        transient = np.where(np.isneginf(transient), 0.0, transient)
        extra = np.where(self.forward, offloaded, transient)
        return total + np.where(self.has_pair, extra, 0.0)


def plan_greedy(problem: _Problem, start: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray] | None:
    """Greedy counts that fit the budget, or None if no step helps any more."""
    counts = {o: a.copy() for o, a in (start or _zero_counts(problem)).items()}
    checks = []
    for rank in range(problem.program.num_ranks):
        static = sum(problem.static_stage[s] for s in problem.program.stages_of(rank))
        checks += [(problem.budget - static, w, p, f) for w, p, f in _windows(problem.program, rank)]
    all_bytes = _CheckBytes(problem, checks)
    for _ in range(int(problem.blocks.sum() * problem.base.shape[1] * 3) + 1):
        excess = all_bytes.of(counts) - all_bytes.rooms
        index = int(np.argmax(excess)) if len(checks) else 0
        if not len(checks) or not excess[index] > 1e-6 * max(problem.budget, 1.0):
            return counts
        room, window, pair, forward = checks[index]
        before = _event_bytes(problem, counts, window, pair, forward)
        best = None
        tiny = 1e-12 * max(float(problem.forward.max()), 1e-30)
        for s, m in window:
            room = int(problem.blocks[s] - sum(counts[o][s, m] for o in _OPTIONS))
            # moves: blocks into option ``to`` (one, or all that are left), or blocks moved from ``away``
            # to a more saving ``to`` (one, or all); "all" crosses the one-block transient's threshold
            moves = [(None, o, k) for o in problem.options if problem.gain[o][s, m] > 0 for k in {1, room} if 0 < k <= room]
            moves += [
                (away, to, k) for away in problem.options for to in problem.options
                if problem.gain[to][s, m] > problem.gain[away][s, m]
                for k in {1, int(counts[away][s, m])} if 0 < k <= counts[away][s, m]
            ]
            for away, to, k in moves:
                counts[to][s, m] += k
                if away is not None:
                    counts[away][s, m] -= k
                relief = before - _event_bytes(problem, counts, window, pair, forward)
                if away is not None:
                    counts[away][s, m] += k
                counts[to][s, m] -= k
                if relief <= 0:
                    continue
                cost = k * (_move_seconds(problem, to, s, m) - (_move_seconds(problem, away, s, m) if away else 0.0))
                score = relief / max(cost, tiny)
                if best is None or score > best[0]:
                    best = (score, away, to, k, s, m)
        if best is None:
            return None
        _, away, to, k, s, m = best
        counts[to][s, m] += k
        if away is not None:
            counts[away][s, m] -= k
    return None


def _move_seconds(problem: _Problem, option: str, s: int, m: int) -> float:
    """Seconds one block in ``option`` adds to (stage, microbatch)."""
    seconds = problem.seconds[option][s, m] * (2.0 if problem.split_backward and option != OFFLOAD else 1.0)
    return seconds + (problem.offload_forward_stall[s, m] if option == OFFLOAD else 0.0)


# --- MILP ----------------------------------------------------------------------------------------


@dataclass
class _Rows:
    """Sparse constraint rows ``lower <= sum(value * variable) <= upper`` in the order they are added."""

    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)

    def add(self, terms: dict[int, float], lo: float, hi: float) -> None:
        r = len(self.lower)
        for c, v in terms.items():
            if v != 0:
                self.rows.append(r)
                self.cols.append(c)
                self.vals.append(v)
        self.lower.append(lo)
        self.upper.append(hi)


@dataclass
class _Variables:
    """Indices of the MILP's variables: block counts per (option, stage, microbatch) (diagonals may
    share one), 0/1 indicators of a count being used, backward transients, action ends, makespan."""

    count: dict[tuple[str, int, int], int]
    indicator: dict[tuple[str, int, int], int]
    transient: dict[tuple[int, int], int]
    end: dict[int, int]
    makespan: int | None
    num: int


def _milp_variables(
    problem: _Problem, options: list[str], tie_diagonals: bool, num_operations: int, with_time: bool
) -> _Variables:
    program = problem.program
    S, M = problem.base.shape
    names: dict = {}
    diagonal = _diagonal_index(program) if tie_diagonals else None

    def new(name) -> int:
        if name not in names:
            names[name] = len(names)
        return names[name]

    count: dict[tuple[str, int, int], int] = {}
    for o in options:
        for s in range(S):
            for m in range(M):
                key = ("x", o, diagonal[(s, m)]) if diagonal is not None else ("x", o, s, m)
                count[(o, s, m)] = new(key)
    indicator = {(o, s, m): new(("z", o, s, m)) for o in options for s in range(S) for m in range(M)}
    transient = {(s, m): new(("t", s, m)) for s in range(S) for m in range(M)}
    end = {i: new(("e", i)) for i in range(num_operations)}
    makespan = new(("T",)) if with_time else None
    return _Variables(count, indicator, transient, end, makespan, len(names))


def _add_memory_rows(rows: _Rows, problem: _Problem, options: list[str], v: _Variables) -> None:
    """Counts within each stage's blocks, indicators and transients, and every rank's peak under the budget."""
    program = problem.program
    S, M = problem.base.shape
    # memory rows in units of the budget (bytes ~1e10 next to seconds ~1 would strain the solver's tolerances)
    unit = max(problem.budget, 1.0)
    big = float(problem.blocks.max())
    for s in range(S):
        for m in range(M):
            rows.add({v.count[(o, s, m)]: 1.0 for o in options}, -np.inf, problem.blocks[s])
            for o in options:
                rows.add({v.count[(o, s, m)]: 1.0, v.indicator[(o, s, m)]: -big}, -np.inf, 0.0)
                rows.add({v.transient[(s, m)]: 1.0, v.indicator[(o, s, m)]: -problem.transient[o][s, m] / unit}, 0.0, np.inf)
    for rank in range(program.num_ranks):
        static = sum(problem.static_stage[s] for s in program.stages_of(rank))
        for window, (ps, pm), forward in _windows(program, rank):
            terms: dict[int, float] = {}
            constant = 0.0
            for s, m in window:
                constant += problem.base[s, m]
                for o in options:
                    c = v.count[(o, s, m)]
                    terms[c] = terms.get(c, 0.0) - problem.gain[o][s, m] / unit
            if forward:
                if OFFLOAD in options:
                    c = v.indicator[(OFFLOAD, ps, pm)]
                    terms[c] = terms.get(c, 0.0) + problem.gain[OFFLOAD][ps, pm] / unit
            else:
                terms[v.transient[(ps, pm)]] = terms.get(v.transient[(ps, pm)], 0.0) + 1.0
            # a hair under the budget: HiGHS may violate rows by its feasibility tolerance (1e-7)
            rows.add(terms, -np.inf, (problem.budget - static - constant) / unit - 1e-6)


def _add_time_rows(
    rows: _Rows, problem: _Problem, options: list[str], v: _Variables, operations: list, last_of_rank: list[int]
) -> None:
    """Each action ends after its predecessor on the rank (and its send) plus its duration, which the
    recompute and offload counts lengthen; the makespan is after every rank's last action."""
    for i, op in enumerate(operations):
        terms = {v.end[i]: 1.0}
        constant = 0.0
        rule, s, m = ACTION_RULES[op.action.type], op.action.stage, op.action.microbatch
        if rule.forward_share:
            constant = problem.forward[s, m] * rule.forward_share
            if OFFLOAD in options and rule.starts_pair:
                terms[v.count[(OFFLOAD, s, m)]] = -problem.offload_forward_stall[s, m]
        elif rule.backward_share:
            constant = problem.backward[s, m] * backward_share(op.action.type, s, problem.split_shares)
            for o in options:
                c = v.count[(o, s, m)]
                terms[c] = terms.get(c, 0.0) - problem.seconds[o][s, m]
        else:
            constant = instruction_seconds(op.action)
        if op.previous >= 0:
            rows.add({**terms, v.end[op.previous]: -1.0}, constant, np.inf)
        else:
            rows.add(terms, constant, np.inf)
        if op.sender >= 0:
            rows.add({v.end[i]: 1.0, v.end[op.sender]: -1.0}, problem.transfer[op.boundary, m], np.inf)
    for last in last_of_rank:
        if last >= 0:
            rows.add({v.makespan: 1.0, v.end[last]: -1.0}, 0.0, np.inf)


def _milp_cost(problem: _Problem, options: list[str], v: _Variables, with_time: bool) -> np.ndarray:
    """The objective: the makespan (recompute seconds as a tie-breaker), or recompute seconds alone."""
    S, M = problem.base.shape
    cost = np.zeros(v.num)
    recompute_weight = {}
    multiplier = 2.0 if problem.split_backward else 1.0
    for o in options:
        for s in range(S):
            for m in range(M):
                seconds = multiplier * problem.seconds[o][s, m]
                if o == OFFLOAD:
                    seconds += problem.offload_forward_stall[s, m]
                recompute_weight[(o, s, m)] = seconds
    if with_time:
        scale = max(float(problem.forward.max()), 1e-30)
        for (o, s, m), seconds in recompute_weight.items():
            cost[v.count[(o, s, m)]] += 1e-3 * seconds / scale
        cost[v.makespan] = 1.0 / scale
    else:
        for (o, s, m), seconds in recompute_weight.items():
            cost[v.count[(o, s, m)]] += seconds
    return cost


def _solve_milp(
    problem: _Problem, objective: str, tie_diagonals: bool, time_limit: float, relative_gap: float = 1e-4
) -> tuple[dict[str, np.ndarray] | None, float]:
    """Recompute/offload block counts per (option, stage, microbatch) from a MILP (HiGHS) and the
    relative gap it reached, or (None, inf) when the solver finds no solution in ``time_limit`` seconds."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    options = [o for o in problem.options if problem.gain[o].max() > 0]
    if not options:
        return _zero_counts(problem), 0.0
    with_time = objective == "makespan"
    operations, last_of_rank = _operations(problem.program) if with_time else ([], [])
    v = _milp_variables(problem, options, tie_diagonals, len(operations), with_time)
    rows = _Rows()
    _add_memory_rows(rows, problem, options, v)
    if with_time:
        _add_time_rows(rows, problem, options, v, operations, last_of_rank)
    cost = _milp_cost(problem, options, v, with_time)

    integrality = np.zeros(v.num)
    upper_bounds = np.full(v.num, np.inf)
    for (o, s, m), c in v.count.items():
        integrality[c] = 1
        upper_bounds[c] = min(upper_bounds[c], problem.blocks[s])
    for c in v.indicator.values():
        integrality[c] = 1
        upper_bounds[c] = 1.0
    matrix = coo_array((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lower), v.num)).tocsr()
    result = milp(
        cost,
        constraints=LinearConstraint(matrix, np.array(rows.lower), np.array(rows.upper)),
        integrality=integrality,
        bounds=Bounds(np.zeros(v.num), upper_bounds),
        options={"time_limit": time_limit, "disp": False, "mip_rel_gap": relative_gap},
    )
    if result.x is None:
        return None, math.inf
    counts = _zero_counts(problem)
    for (o, s, m), c in v.count.items():
        counts[o][s, m] = round(result.x[c])
    gap = getattr(result, "mip_gap", None)  # absent when presolve alone solved it
    if gap is None:
        gap = 0.0 if result.status == 0 else math.inf
    return counts, max(0.0, float(gap))


def _diagonal_index(program: Program) -> dict[tuple[int, int], int]:
    """InfiniPipe Eq. 15/16: the pair running the ``k``-th backward on stage ``s`` shares variable
    ``k + num_stages - 1 - s`` (a backward "diagonal" of a 1F1B pipeline)."""
    if any(len(program.stages_of(r)) != 1 for r in range(program.num_ranks)):
        raise ValueError("`tie_diagonals=True` needs one stage per rank (InfiniPipe's 1F1B pipelines).")
    index = {}
    for rank in range(program.num_ranks):
        order = [a for a in program.actions[rank] if a.type in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT)]
        for k, action in enumerate(order):
            index[(action.stage, action.microbatch)] = k + program.num_stages - 1 - action.stage
    return index


def step_seconds(
    program: Program,
    boundaries: Sequence[int],
    shapes: Sequence[MicrobatchShape],
    profile: MemoryProfile,
    plan: MemoryPlan,
    *,
    cost_model: CostModel | None = None,
    host_bandwidth: float = 25e9,
    chunks: ChunkMemory | None = None,
) -> float:
    """Simulated step seconds of ``program`` under any ``plan`` (recompute and offload stalls included).

    Per (stage, microbatch) the plan's block modes are counted; each recomputed block adds the
    planner's per-block seconds to the backward (twice with split backward), each offloaded block
    its stall (as in :func:`plan_memory`).
    """
    problem = _problem(
        program, boundaries, shapes, profile, math.inf, cost_model, _OPTIONS, host_bandwidth, None, None, chunks
    )
    counts = _zero_counts(problem)
    for s in range(program.num_stages):
        for m in range(len(shapes)):
            for mode in plan.choice(s, m).block_modes(int(problem.blocks[s])):
                if mode != NONE:
                    counts[mode][s, m] += 1
    return problem.step_seconds(counts)


# --- entry point ---------------------------------------------------------------------------------


def plan_memory(
    program: Program,
    boundaries: Sequence[int],
    shapes: Sequence[MicrobatchShape],
    profile: MemoryProfile,
    budget: float,
    *,
    cost_model: CostModel | None = None,
    options: Sequence[str] = (FULL, KEEP_ATTENTION, OFFLOAD),
    method: str = "milp",
    objective: str = "makespan",
    tie_diagonals: bool = False,
    host_bandwidth: float = 25e9,
    static_bytes: Sequence[float] | None = None,
    mlp_chunk_size: int | None = None,
    time_limit: float = 10.0,
    chunks: ChunkMemory | None = None,
    relative_gap: float = 1e-4,
) -> MemoryPlanResult:
    """The plan with the smallest simulated step time whose predicted peak fits ``budget`` on every rank.

    Args:
        program: the training program the plan is for.
        boundaries: stage boundaries over blocks.
        shapes: one shape per microbatch.
        profile: saved bytes per unit and mode (measured).
        budget: bytes per device (static state plus activations).
        cost_model: seconds per unit; default :func:`profile_cost_model` (flop counts).
        options: what the planner may use: ``"full"``, ``"keep_attention"``, ``"offload"``
            (``"keep_attention"`` is dropped for split-backward programs, which run backward twice).
        method: ``"milp"`` (HiGHS, greedy if it fails) or ``"greedy"``.
        objective: ``"makespan"`` or ``"recompute"`` (InfiniPipe's Eq. 20); MILP only.
        tie_diagonals: InfiniPipe's Eq. 15 variable sharing (one stage per rank only).
        host_bandwidth: bytes per second between device and host, for offload stalls.
        static_bytes: per stage parameters, gradients, optimizer state; default from the profile.
        mlp_chunk_size: recorded in every choice of the plan (not chosen by the planner).
        time_limit: seconds HiGHS may take.
        chunks: per microbatch, what packed and sliced chunks keep per block beyond the profile
            (``planning/chunk_memory.py``: masks and a slice's context, removed by full recompute and
            offload; the key/value store of earlier slices, removed by nothing). Each chunk's own
            length is in ``shapes``.
        relative_gap: HiGHS stops once its plan is proven within this fraction of the best (its
            default, 1e-4, is exact for planning purposes; callers that solve many plans per batch
            trade a stated gap for time).

    Returns:
        The plan, its predicted memory, simulated step time, added seconds and the gap reached.

    Raises:
        MemoryBudgetError: if no plan fits; the message gives the smallest budget that would.
        ValueError: for an unknown ``method``/``objective``/option or mismatched sizes.
    """
    if method not in ("milp", "greedy"):
        raise ValueError(f"`method={method!r}`: use 'milp' or 'greedy'.")
    if objective not in ("makespan", "recompute"):
        raise ValueError(f"`objective={objective!r}`: use 'makespan' or 'recompute'.")
    problem = _problem(
        program, boundaries, shapes, profile, budget, cost_model, options, host_bandwidth, static_bytes, mlp_chunk_size,
        chunks,
    )
    empty = _zero_counts(problem)

    def result(counts, name, gap) -> MemoryPlanResult | None:
        plan = problem.plan_of(counts)
        prediction = predict_memory(program, problem.boundaries, shapes, plan, profile, problem.static_stage, chunks)
        if not prediction.fits(budget):
            return None
        seconds, added = problem.step_seconds(counts), problem.added_seconds(counts)
        return MemoryPlanResult(plan, prediction, seconds, added, name, budget, gap)

    found = result(empty, "none", 0.0)
    if found is not None:
        return found
    if method == "milp":
        counts, gap = _solve_milp(problem, objective, tie_diagonals, time_limit, relative_gap)
        if counts is not None:
            found = result(counts, "milp", gap)
            if found is None:  # per-block means differed from exact bytes: repair greedily
                repaired = plan_greedy(problem, counts)
                found = result(repaired, "milp", math.inf) if repaired is not None else None
    if found is None:
        counts = plan_greedy(problem)
        found = result(counts, "greedy", math.inf) if counts is not None else None
    if found is None:
        raise MemoryBudgetError(_nothing_fits(problem))
    return found


def _nothing_fits(problem: _Problem) -> str:
    """Explain the smallest budget that would fit, with every block at its most saving option."""
    best = _zero_counts(problem)
    S, M = problem.base.shape
    most = max(problem.options, key=lambda o: float(problem.gain[o].sum()), default=None)
    if most is not None:
        best[most][:] = problem.blocks[:, None]
    plan = problem.plan_of(best)
    prediction = predict_memory(
        problem.program, problem.boundaries, problem.shapes, plan, problem.profile, problem.static_stage, problem.chunks
    )
    rank = int(np.argmax(prediction.peak_bytes))
    footprints = stage_footprints(problem.profile, problem.boundaries, problem.shapes, plan, problem.chunks)
    stage = max(problem.program.stages_of(rank), key=lambda s: max(f.saved for f in footprints[s]))
    mb = int(np.argmax([f.saved for f in footprints[stage]]))
    pre, units, post = problem.profile.stage_units(problem.boundaries, stage)
    fixed = sum(u.saved_bytes(NONE, problem.shapes[mb]) for u in (pre, post) if u is not None)
    kept = len(units) * problem.chunks.kept[mb] if problem.chunks is not None else 0.0
    where = f"pre/post units and {format_size(kept)} in the stored keys and values of its slice" if kept else "pre/post units"
    return (
        f"No memory plan fits the budget of {format_size(problem.budget)} per device: even with "
        f"'{most or 'nothing allowed'}' on every block, pipeline rank {rank} peaks at "
        f"{format_size(prediction.peak_bytes[rank])} (static {format_size(prediction.static_bytes[rank])}, saved "
        f"activations {format_size(prediction.saved_peak_bytes[rank])}; stage {stage} microbatch {mb} alone keeps "
        f"{format_size(footprints[stage][mb].saved)}, of which {format_size(fixed)} in {where}, never recomputed "
        f"or freed by a plan). A budget of at least {format_size(max(prediction.peak_bytes))} would fit; otherwise use more "
        f"pipeline stages, more (smaller) microbatches, shorter sequences, or allow more of {list(_OPTIONS)} "
        f"(allowed: {list(problem.options)})."
    )
