"""Pictures of plans over time: which blocks every stage held at every step.

The same picture serves the simulated benchmark (partitions the planner chose per batch) and a real
run (``PipelineMonitor`` draws the partitions it logged); a line of a per-step quantity beside it
(the batch's longest sequence, the step time) shows *why* the boundaries moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_partitions(
    steps: Sequence[int],
    boundaries: Sequence[Sequence[int]],
    path: str | Path,
    *,
    values: Sequence[float] | None = None,
    value_label: str = "",
    step_label: str = "step",
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Draw stage boundaries over steps as stacked bands (one colour per stage) and save a PNG.

    Args:
        steps: the step (or batch) of every partition, increasing.
        boundaries: per step, the block boundaries ``[0, b1, ..., num_blocks]`` of its stages.
        path: where the PNG goes.
        values: optionally one number per step, drawn as a line on a second axis.
        value_label: the second axis' label.
        step_label: the horizontal axis' label.
        title: the figure's title.
        dpi: resolution.

    Raises:
        ValueError: no steps, or steps and boundaries (or values) of different lengths.
    """
    if not steps or len(steps) != len(boundaries) or (values is not None and len(values) != len(steps)):
        raise ValueError(
            f"`plot_partitions` needs one partition (and value) per step: {len(steps)} steps, "
            f"{len(boundaries)} partitions, {len(values) if values is not None else 'no'} values."
        )
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    num_stages = max(len(b) for b in boundaries) - 1
    colours = colormaps["tab10"]
    figure = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    # bands are drawn step-wise: a partition holds from its step until the next one
    x = list(steps) + [steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)]
    for stage in range(num_stages):
        low = [b[stage] if stage < len(b) - 1 else b[-1] for b in boundaries]
        high = [b[stage + 1] if stage < len(b) - 1 else b[-1] for b in boundaries]
        axis.fill_between(x, low + low[-1:], high + high[-1:], step="post", color=colours(stage % 10), alpha=0.75,
                          linewidth=0, label=f"stage {stage}")
    axis.set_xlim(x[0], x[-1])
    axis.set_ylim(0, max(b[-1] for b in boundaries))
    axis.set_xlabel(step_label)
    axis.set_ylabel("blocks")
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(num_stages, 8), fontsize=8, frameon=False)
    if values is not None:
        twin = axis.twinx()
        twin.step(x, list(values) + list(values[-1:]), where="post", color="black", linewidth=1.2)
        twin.set_ylabel(value_label)
        twin.set_ylim(bottom=0)
    if title:
        axis.set_title(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def plot_layouts(
    steps: Sequence[int],
    boundaries: Sequence[Sequence[int]],
    widths: Sequence[Sequence[int]],
    path: str | Path,
    *,
    step_label: str = "step",
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Draw elastic-depth layouts over steps: blocks per stage (top) and devices per stage (bottom).

    Both panels are stacked bands, one colour per stage, so a step where the pipeline grows shows more
    bands in both; the bottom panel's band heights are the stages' data-parallel widths.

    Args:
        steps: the step of every layout, increasing.
        boundaries: per step, the block boundaries of its stages.
        widths: per step, the replicas of every stage (``len(boundaries[i]) - 1`` entries).
        path: where the PNG goes.
        step_label: the horizontal axis' label.
        title: the figure's title.
        dpi: resolution.

    Raises:
        ValueError: no steps, lists of different lengths, or widths that do not match the stages.
    """
    if not steps or not len(steps) == len(boundaries) == len(widths):
        raise ValueError(
            f"`plot_layouts` needs one layout per step: {len(steps)} steps, {len(boundaries)} boundaries, "
            f"{len(widths)} widths."
        )
    if any(len(w) != len(b) - 1 for b, w in zip(boundaries, widths)):
        raise ValueError("`plot_layouts`: every step needs one width per stage of its boundaries.")
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    devices = [(0, *_cumulative(w)) for w in widths]
    num_stages = max(len(w) for w in widths)
    colours = colormaps["tab10"]
    figure = Figure(figsize=(9, 5.2))
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    x = list(steps) + [steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)]
    for axis, edges, label in ((top, boundaries, "blocks"), (bottom, devices, "devices (ranks)")):
        for stage in range(num_stages):
            low = [e[stage] if stage < len(e) - 1 else e[-1] for e in edges]
            high = [e[stage + 1] if stage < len(e) - 1 else e[-1] for e in edges]
            axis.fill_between(x, low + low[-1:], high + high[-1:], step="post", color=colours(stage % 10), alpha=0.75,
                              linewidth=0, label=f"stage {stage}")
        axis.set_ylim(0, max(e[-1] for e in edges))
        axis.set_ylabel(label)
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlim(x[0], x[-1])
    bottom.set_xlabel(step_label)
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(num_stages, 8), fontsize=8, frameon=False)
    if title:
        top.set_title(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def _cumulative(values: Sequence[int]) -> list[int]:
    total, result = 0, []
    for value in values:
        total += value
        result.append(total)
    return result
