"""Auto-scheduler: simulate every family and a grid of DSL settings, rank them, fit a memory limit.

Following FlexPipe's auto-tuner (section 6 of the paper): enumerate placements, computation-type
priorities and stage traversals (``forward_first`` only when asked, intervals only for circular
placement), simulate each candidate with the same costs and keep those that fit the memory limit,
fastest first. Identical programs reached by different settings are simulated once.

Costs for a different number of stages than given are derived by :func:`split_stages`: each
stage's numbers are cut evenly into ``v`` consecutive sub-stages, which keeps the model's depth
profile (a heavy last stage stays heavy at the end).
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .backward_merging import merged_program
from .costs import ActionCosts, SplitBackward
from .dsl import build_spec, parse_spec
from .ir import Program
from .registry import Schedule
from .resolve import resolve_schedule
from .simulate import simulate
from .split_schedules import HELIX_PRE_SHARE, is_split_placement, split_program
from .validate import ScheduleError

__all__ = [
    "AutoScheduleRow",
    "auto_schedule",
    "default_candidates",
    "split_candidates",
    "split_stages",
    "format_auto_table",
    "render_auto_table",
]


@dataclass(frozen=True)
class AutoScheduleRow:
    """One simulated candidate.

    Attributes:
        schedule: what to pass to the strategy (``schedule=row.schedule``).
        label: short human-readable name.
        makespan: simulated seconds per step.
        bubble_ratio: idle fraction of rank time.
        peak_memory: the largest per-rank peak, bytes.
        max_in_flight: the largest per-rank peak of microbatches in flight.
        fits: True when every rank's peak is within the memory limit.
    """

    schedule: Schedule
    label: str
    makespan: float
    bubble_ratio: float
    peak_memory: float
    max_in_flight: int
    fits: bool


def split_stages(costs: ActionCosts, factor: int) -> ActionCosts:
    """Costs for ``factor`` times as many stages: every stage cut into ``factor`` equal, consecutive parts.

    Times, saved bytes and static bytes are divided by ``factor``; the activation bytes crossing a
    boundary stay the same (a transformer's hidden state has the same size between any two blocks).
    """
    if factor == 1:
        return costs

    def split(table: Any, divide: bool = True) -> Any:
        if table is None:
            return None
        return tuple(tuple(v / factor if divide else v for v in row) for row in table for _ in range(factor))

    return ActionCosts(
        forward=split(costs.forward),
        backward=split(costs.backward),
        backward_input=split(costs.backward_input),
        backward_weight=split(costs.backward_weight),
        activation_bytes=split(costs.activation_bytes, divide=False),
        saved_bytes=split(costs.saved_bytes),
        static_bytes=None
        if costs.static_bytes is None
        else tuple(v / factor for v in costs.static_bytes for _ in range(factor)),
        latency=costs.latency,
        bandwidth=costs.bandwidth,
    )


def default_candidates(*, include_forward_first: bool = False) -> list[tuple[str, Schedule]]:
    """The families and DSL settings :func:`auto_schedule` tries by default, as ``(label, schedule)``.

    The DSL grid follows FlexPipe's tuner rules (no ``forward_first`` unless asked, intervals only
    with circular placement) and leaves out settings that, in a sweep over p <= 8 and m <= 16,
    always deadlocked (strict intervals other than Megatron's breadth-first forward /
    depth-first backward, ``interleaved`` on V-shape) or always reproduced a family already in
    the list (one-to-one ``backward_first`` with the ``auto`` limit is 1F1B).
    """
    out: list[tuple[str, Schedule]] = [
        (name, resolve_schedule(name)) for name in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "looped_bfs", "zbv")
    ]
    specs: list[dict[str, Any]] = [
        {"placement": "one_to_one", "split_backward": True, "max_in_flight": "num_ranks"},
        {"placement": "one_to_one", "max_in_flight": None},
        {
            "placement": "circular",
            "stages_per_rank": 2,
            "priority": "interleaved",
            "forward_traversal": "breadth_first",
            "backward_traversal": "depth_first",
            "interval": "num_ranks",
            "split_backward": True,
        },
    ]
    traversals = ("breadth_first", "depth_first")
    for fwd, bwd, split in itertools.product(traversals, traversals, (False, True)):
        specs.append(
            {
                "placement": "circular",
                "stages_per_rank": 2,
                "forward_traversal": fwd,
                "backward_traversal": bwd,
                "split_backward": split,
            }
        )
    for bwd, split in itertools.product(traversals, (False, True)):
        specs.append(
            {
                "placement": "v_shape",
                "stages_per_rank": 2,
                "forward_traversal": "depth_first",
                "backward_traversal": bwd,
                "split_backward": split,
            }
        )
    if include_forward_first:
        specs += [
            {"placement": "one_to_one", "priority": "forward_first", "max_in_flight": None},
            {"placement": "circular", "stages_per_rank": 2, "priority": "forward_first", "max_in_flight": None},
        ]
    for spec in specs:
        out.append((_short(spec), resolve_schedule(spec)))
    return out


def _short(spec: dict[str, Any]) -> str:
    """Compact label of a DSL candidate: ``dsl:circular,bf/db,split``."""
    parts = [spec["placement"]]
    if spec.get("priority", "backward_first") != "backward_first":
        parts.append(spec["priority"])
    if spec.get("stages_per_rank", 1) > 1:
        parts.append(
            f"{spec.get('forward_traversal', 'breadth_first')[0]}f/"
            f"{spec.get('backward_traversal', 'breadth_first')[0]}b"
        )
    if spec.get("interval"):
        parts.append("interval=p")
    if spec.get("max_in_flight", "auto") != "auto":
        parts.append(f"in_flight={spec['max_in_flight']}")
    if spec.get("split_backward"):
        parts.append("split")
    return "dsl:" + ",".join(parts)


def auto_schedule(
    costs: ActionCosts | Callable[[int], ActionCosts],
    num_ranks: int,
    memory_limit: float | Sequence[float] | None = None,
    *,
    num_microbatches: int | None = None,
    candidates: Iterable[Any] | None = None,
    num_blocks: int | None = None,
    attention_share: float | None = None,
    merge_split_backward: bool = False,
    split_backward: SplitBackward | None = None,
) -> list[AutoScheduleRow]:
    """Simulate candidate schedules and rank them: those that fit first, then by makespan and memory.

    Args:
        costs: costs of the model cut into ``num_ranks`` stages (split for schedules with more
            stages per rank, see :func:`split_stages`), or a function ``num_stages -> ActionCosts``
            when you have a better model of finer cuts.
        num_ranks: pipeline ranks.
        memory_limit: bytes per rank (one number for all, or one per rank); None: everything fits.
        num_microbatches: default: as many as the cost tables have.
        candidates: schedules to try (names, specs, :class:`Schedule`); default
            :func:`default_candidates`.
        num_blocks: the model's blocks. Given, the split-placement families are candidates too (their
            stage count follows the model): ``spipe`` (``stages_per_rank`` 1 and 2, ``backward_split``
            2), each rank's costs cut evenly into its finer stages, and ``helix`` when
            ``attention_share`` is given. Off by default: the strategy runs them only when chosen at
            construction (``schedule="helix"``), so a per-batch switch (``ScheduleSwitch``) must not
            pick them.
        attention_share: the fraction of a block's forward (and backward) spent in the attention
            core, which HelixPipe runs on other ranks (the rest: ``HELIX_PRE_SHARE`` pre-attention, the
            remainder post-attention); per-stage costs do not tell it, so helix is priced only with it.
        merge_split_backward: price zero-bubble families by the program the strategy runs with its
            ``merge_split_backward``: pairs merged into one ``B`` as :func:`merged_program` decides with
            ``split_backward`` (the shares the strategy's cost model measured; None: ideal halves).
        split_backward: see ``merge_split_backward``.

    Returns:
        One row per distinct candidate that builds; candidates that deadlock or do not apply to
        these sizes are left out.

    Raises:
        ValueError: if ``memory_limit`` lists a different number of ranks than ``num_ranks``.
    """
    if callable(costs) and not isinstance(costs, ActionCosts):
        cost_for = costs
        base = None
    else:
        base = costs
        cost_for = None
    if base is not None and base.num_stages != num_ranks:
        raise ValueError(
            f"costs cover {base.num_stages} stages; give costs for num_ranks={num_ranks} stages (one per rank)"
        )
    m = num_microbatches if num_microbatches is not None else (base.num_microbatches if base else None)
    if m is None:
        raise ValueError("pass num_microbatches when costs is a function")
    limits = _limits(memory_limit, num_ranks)
    pool = default_candidates() if candidates is None else [(str(c), resolve_schedule(c)) for c in candidates]
    if num_blocks is not None:
        if base is None:
            raise ValueError("split-placement candidates (num_blocks=...) are priced from per-rank costs: pass an ActionCosts")
        pool += split_candidates(attention_share is not None)
    cache: dict[int, ActionCosts] = {}
    seen: dict[tuple, AutoScheduleRow] = {}
    rows: list[AutoScheduleRow] = []
    for label, schedule in pool:
        try:
            if is_split_placement(schedule):
                if num_blocks is None:
                    raise ValueError("split placement needs num_blocks")
                program = split_program(schedule, num_ranks, m, num_blocks)
            else:
                program = _build(schedule, num_ranks, m)
                if merge_split_backward and program.splits_backward:
                    program = merged_program(schedule, num_ranks, m, split_backward)
        except (ScheduleError, ValueError):
            continue
        key = (program.stage_to_rank, program.actions)
        if key in seen:
            continue
        if is_split_placement(schedule):
            costs_of_program = _split_costs(schedule, program, base, attention_share)  # type: ignore[arg-type]
        else:
            v = schedule.stages_per_rank
            if v not in cache:
                cache[v] = cost_for(num_ranks * v) if cost_for else split_stages(base, v)  # type: ignore[arg-type]
            costs_of_program = cache[v]
        result = simulate(program, costs_of_program, record_events=False)
        row = AutoScheduleRow(
            schedule=schedule,
            label=label,
            makespan=result.makespan,
            bubble_ratio=result.bubble_ratio,
            peak_memory=max(result.peak_memory),
            max_in_flight=max(result.max_in_flight),
            fits=all(peak <= limit for peak, limit in zip(result.peak_memory, limits, strict=True)),
        )
        seen[key] = row
        rows.append(row)
    return sorted(rows, key=lambda r: (not r.fits, r.makespan, r.peak_memory, r.label))


def split_candidates(include_helix: bool = True) -> list[tuple[str, Schedule]]:
    """The split-placement candidates :func:`auto_schedule` adds when told the model's blocks."""
    out = [
        (f"spipe:v={v}", resolve_schedule({"name": "spipe", "stages_per_rank": v, "backward_split": 2})) for v in (1, 2)
    ]
    if include_helix:
        out.insert(0, ("helix", resolve_schedule("helix")))
    return out


def _split_costs(schedule: Schedule, program: Program, base: ActionCosts, attention_share: float | None) -> ActionCosts:
    """Per-rank costs cut into a split-placement program's stages (see :func:`auto_schedule`)."""
    num_ranks = base.num_stages
    if schedule.name == "spipe":
        return split_stages(base, program.num_stages // num_ranks)
    assert attention_share is not None
    layers = (program.num_stages - 1) // 2
    per_rank = layers // num_ranks
    rest = 1.0 - attention_share
    parts = (HELIX_PRE_SHARE * rest, attention_share, (1.0 - HELIX_PRE_SHARE) * rest)  # pre, attention, post

    def table(source: Any) -> Any:
        rows = []
        for stage in range(program.num_stages):
            layer, attention = divmod(stage, 2)
            # a stage's share of its block's cost, from the rank that holds the block's unit
            rank = min(layer, layers - 1) // per_rank
            block = [value / per_rank for value in source[rank]]
            if attention:
                share = parts[1]
            elif stage == 0:
                share = parts[0]
            elif stage == program.num_stages - 1:
                share = parts[2]
            else:
                share = parts[0] + parts[2]
            rows.append(tuple(value * share for value in block))
        return tuple(rows)

    saved = table(base.saved_bytes) if base.saved_bytes is not None else None
    return ActionCosts(forward=table(base.forward), backward=table(base.backward), saved_bytes=saved)


def _build(schedule: Schedule, num_ranks: int, num_microbatches: int) -> Program:
    """Build a candidate; DSL programs skip the final validation (the engine and the lowering are
    correct by construction and tested over grids; the strategy validates what it runs).
    """
    if schedule.name != "dsl":
        return schedule.build(num_ranks, num_microbatches)
    spec = parse_spec({**schedule.options, "stages_per_rank": schedule.stages_per_rank})
    return build_spec(spec, num_ranks, num_microbatches, check=False)


def _limits(memory_limit: float | Sequence[float] | None, num_ranks: int) -> tuple[float, ...]:
    if memory_limit is None:
        return (math.inf,) * num_ranks
    if isinstance(memory_limit, (int, float)):
        return (float(memory_limit),) * num_ranks
    limits = tuple(float(x) for x in memory_limit)
    if len(limits) != num_ranks:
        raise ValueError(f"memory_limit lists {len(limits)} ranks, expected num_ranks={num_ranks}")
    return limits


def render_auto_table(rows: Sequence[AutoScheduleRow], *, limit: int | None = None, title: str | None = None) -> Any:
    """A ``rich.table.Table`` of the ranked rows (best first)."""
    from rich.table import Table

    table = Table(title=title or "schedules ranked by simulated step time")
    for header, justify in (
        ("#", "right"),
        ("schedule", "left"),
        ("stages/rank", "right"),
        ("makespan", "right"),
        ("bubble", "right"),
        ("peak memory", "right"),
        ("in flight", "right"),
        ("fits", "center"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for index, row in enumerate(rows[:limit] if limit else rows, start=1):
        table.add_row(
            str(index),
            row.label,
            str(row.schedule.stages_per_rank),
            f"{row.makespan:.4g}",
            f"{row.bubble_ratio:.1%}",
            _bytes(row.peak_memory),
            str(row.max_in_flight),
            "yes" if row.fits else "[red]no[/red]",
        )
    return table


def format_auto_table(rows: Sequence[AutoScheduleRow], *, limit: int | None = None, width: int = 120) -> str:
    """:func:`render_auto_table` rendered to plain text."""
    from rich.console import Console

    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(render_auto_table(rows, limit=limit))
    return console.export_text()


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.4g} {unit}"
        value /= 1024
    return f"{value:g}"
