"""Pictures of a step: ASCII timeline, PNG Gantt chart, Chrome-trace JSON.

Everything is drawn from a list of :class:`TimedAction` (a :class:`SimulationResult` or its
``events``), so a step recorded on real hardware, turned into the same events, is drawn the same
way. Only compute actions (and registered instructions) are drawn; receive waits show as idle.
matplotlib is imported only inside :func:`render_png`, with its Agg canvas (no display needed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .ir import ActionType
from .simulate import SimulationResult, TimedAction

__all__ = ["render_ascii", "render_png", "to_chrome_trace", "write_chrome_trace"]

_DRAWN = frozenset(
    {
        ActionType.FORWARD,
        ActionType.BACKWARD,
        ActionType.BACKWARD_INPUT,
        ActionType.BACKWARD_WEIGHT,
        ActionType.RECOMPUTE,
        ActionType.CUSTOM,
    }
)
_COLORS = {
    ActionType.FORWARD: "#4C72B0",
    ActionType.BACKWARD: "#55A868",
    ActionType.BACKWARD_INPUT: "#DD8452",
    ActionType.BACKWARD_WEIGHT: "#8172B3",
    ActionType.RECOMPUTE: "#C44E52",
    ActionType.CUSTOM: "#937860",
}
Timeline = SimulationResult | Sequence[TimedAction]


def _events(timeline: Timeline) -> tuple[list[TimedAction], int, float]:
    events = list(timeline.events if isinstance(timeline, SimulationResult) else timeline)
    num_ranks = (
        timeline.num_ranks if isinstance(timeline, SimulationResult) else max((e.rank for e in events), default=-1) + 1
    )
    end = max((e.end for e in events), default=0.0)
    return events, num_ranks, end


def _label(event: TimedAction, later_chunk: bool) -> str:
    """``F3``; lower case (``f3``) for a stage other than the rank's first (later chunks)."""
    a = event.action
    token = a.name if a.type is ActionType.CUSTOM and a.name else a.type.value
    if later_chunk and a.type is not ActionType.CUSTOM:
        token = token.lower()
    return token + ("" if a.microbatch is None else str(a.microbatch))


def _nice_step(minimum: float) -> float:
    """Smallest 1, 2 or 5 times a power of ten that is at least ``minimum``."""
    power = 10.0 ** math.floor(math.log10(minimum)) if minimum > 0 else 1.0
    return next(f * power for f in (1, 2, 5, 10) if f * power >= minimum)


def render_ascii(timeline: Timeline, *, time_unit: float | None = None, max_width: int = 200) -> str:
    """Terminal timeline: one row per rank, time to the right, ``.`` where the rank is idle.

    An action is drawn as its type and microbatch (``F3``, ``B3---``), in lower case for the later
    stages of a rank that holds several (``f3`` is the rank's second chunk).

    Args:
        timeline: a simulation result or timed events.
        time_unit: seconds that one label cell stands for; default: the shortest compute action.
        max_width: characters available for the time axis. When labels do not fit, each action is
            drawn with its type letter only, and past that several time units share a character.

    Returns:
        The text: a time axis, one row per rank, a legend line.
    """
    events, num_ranks, end = _events(timeline)
    drawn = [e for e in events if e.action.type in _DRAWN and e.end > e.start]
    if not drawn or end <= 0:
        return "\n".join(f"rank {r} |" for r in range(num_ranks))
    first_stage = {r: min((e.action.stage for e in drawn if e.rank == r), default=0) for r in range(num_ranks)}
    labels = {id(e): _label(e, e.action.stage != first_stage[e.rank]) for e in drawn}
    unit = time_unit or min(e.end - e.start for e in drawn)
    cell = max(len(label) for label in labels.values()) + 1
    units = end / unit
    chars_per_unit = min(cell, max(1, int(max_width // max(units, 1e-12))))
    scale = chars_per_unit / unit if units * chars_per_unit <= max_width + 1e-9 else max_width / end
    width = max(1, int(round(end * scale)))
    rows = [["."] * width for _ in range(num_ranks)]
    for e in drawn:
        first = min(width - 1, int(round(e.start * scale)))
        last = max(first + 1, min(width, int(round(e.end * scale))))
        span, label = last - first, labels[id(e)]
        if span > len(label):
            text = label + "-" * (span - len(label) - 1) + " "
        else:
            text = label[0] * span
        rows[e.rank][first:last] = list(text)
    label_width = len(f"rank {num_ranks - 1}")
    step = _nice_step(10 / scale)
    axis = [" "] * (width + 12)
    tick = 0.0
    while tick * scale < width:
        mark = f"{tick:g}"
        column = int(round(tick * scale))
        axis[column : column + len(mark)] = list(mark)
        tick += step
    lines = [f"{'t':>{label_width}} |" + "".join(axis).rstrip()]
    lines += [f"{f'rank {r}':>{label_width}} |" + "".join(row) for r, row in enumerate(rows)]
    lines.append("F forward  B backward  I input grad  W weight grad  . idle  (lower case: a later stage of that rank)")
    return "\n".join(lines)


def render_png(timeline: Timeline, path: str | Path, *, title: str | None = None, dpi: int = 120) -> Path:
    """Gantt chart of a step as a PNG (matplotlib, Agg canvas).

    About 80 lines: a straight sequence of matplotlib calls (figure, bars, labels, legend), clearer
    read top to bottom than cut into helpers that each take the figure.

    Args:
        timeline: a simulation result or timed events.
        path: file to write; parent folders are created.
        title: chart title; default names the program and its bubble ratio when known.
        dpi: resolution.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events, num_ranks, end = _events(timeline)
    drawn = [e for e in events if e.action.type in _DRAWN and e.end > e.start]
    span = end if end > 0 else 1.0
    width_inches = min(16.0, 4.0 + 0.22 * max(1, len(drawn) / max(1, num_ranks)))
    height_inches = 1.3 + 0.45 * num_ranks
    figure = Figure(figsize=(width_inches, height_inches))
    # Fixed margins (inches) instead of tight_layout, which would draw every label twice.
    figure.subplots_adjust(
        left=0.75 / width_inches, right=1 - 0.15 / width_inches, bottom=0.5 / height_inches, top=1 - 0.4 / height_inches
    )
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    lowest = {r: min((e.action.stage for e in drawn if e.rank == r), default=0) for r in range(num_ranks)}
    points_per_second = 0.85 * width_inches * 72 / span  # bar width in points, to decide on labels
    groups: dict[tuple[int, ActionType, bool], list[tuple[float, float]]] = {}
    for e in drawn:
        later_chunk = e.action.stage != lowest[e.rank]
        groups.setdefault((e.rank, e.action.type, later_chunk), []).append((e.start, e.end - e.start))
        label = "" if e.action.microbatch is None else str(e.action.microbatch)
        if label and (e.end - e.start) * points_per_second >= 4 + 5 * len(label):
            axes.text(
                (e.start + e.end) / 2,
                e.rank,
                label,
                ha="center",
                va="center",
                fontsize=6.5,
                color="black" if later_chunk else "white",
            )
    for (rank, kind, later_chunk), spans in groups.items():  # one collection per group: fast to draw
        axes.broken_barh(
            spans,
            (rank - 0.4, 0.8),
            facecolors=_COLORS[kind],
            alpha=0.55 if later_chunk else 1.0,
            edgecolor="white",
            linewidth=0.6,
        )
    axes.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    axes.set_ylim(num_ranks - 0.5, -0.5)
    axes.set_xlim(0, span)
    axes.set_xlabel("time (numbers in bars: microbatch; pale: a later stage of that rank)", fontsize=8)
    if title is None:
        title = "timeline"
        if isinstance(timeline, SimulationResult):
            title = f"{timeline.name}: makespan {timeline.makespan:g}, bubble {timeline.bubble_ratio:.1%}"
    axes.set_title(title, fontsize=9, loc="left")
    kinds = sorted({e.action.type for e in drawn}, key=lambda t: list(_COLORS).index(t))
    names = {
        ActionType.FORWARD: "F forward",
        ActionType.BACKWARD: "B backward",
        ActionType.BACKWARD_INPUT: "I input grad",
        ActionType.BACKWARD_WEIGHT: "W weight grad",
        ActionType.RECOMPUTE: "recompute",
        ActionType.CUSTOM: "instruction",
    }
    axes.legend(
        handles=[Patch(color=_COLORS[k], label=names[k]) for k in kinds],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncol=len(kinds),
        frameon=False,
        borderaxespad=0.2,
    )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=dpi)
    return target


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Chrome-trace (``chrome://tracing``, Perfetto) JSON object: one thread per rank, times in µs.

    Every event is exported, communication included (a receive's duration is its wait).
    """
    events, num_ranks, _ = _events(timeline)
    trace: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}} for r in range(num_ranks)
    ]
    for e in events:
        a = e.action
        trace.append(
            {
                "name": str(a),
                "cat": a.type.value,
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": e.start * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "args": {"stage": a.stage, "microbatch": a.microbatch, "type": a.type.value},
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path`` and return it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(to_chrome_trace(timeline)))
    return target
