"""Cost estimates of a whole module: the meta-device probe, the measured profile, and their JSON file.

What the strategy's cost models (``strategies/costs.py``), the ``PipelineProfiler`` callback and the
``lightning-pipe-profile`` command share. No strategy and no process group here: a module, an example
microbatch, a device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.model.blocks import BlockStack
from lightning_pipe.model.units import UnitLayout
from lightning_pipe.profiling.cost_probe import CostEstimate, DeviceSpeed, count_units, fit_cost_model
from lightning_pipe.profiling.unit_timing import fit_timings, time_units

__all__ = [
    "assumed_link",
    "estimate_costs",
    "format_fits",
    "probe_grid",
    "probe_lengths",
    "probe_shapes",
    "profile_grid",
    "profile_module",
    "save_profile",
]

# Assumed stage-to-stage link, (seconds per message, bytes per second), until migrations are measured.
_LINK = {"cpu": (1e-4, 2e9), "cuda": (1e-5, 50e9)}


def assumed_link(device: torch.device | str) -> tuple[float, float]:
    """``(seconds per message, bytes per second)`` assumed between stages on ``device`` until measured."""
    return _LINK.get(torch.device(device).type, _LINK["cuda"])


def probe_shapes(max_length: int, num_sequences: int) -> list[tuple[int, int]]:
    """The meta probe's ``(num_sequences, length)`` grid: full, half and quarter length, two sizes."""
    half, quarter = max(2, math.ceil(max_length / 2)), max(2, math.ceil(max_length / 4))
    shapes = [(num_sequences, max_length), (num_sequences, half), (2 * num_sequences, quarter)]
    shapes.append((max(1, num_sequences // 2) if num_sequences > 1 else 2, max_length))
    return list(dict.fromkeys(shapes))


def estimate_costs(
    module: torch.nn.Module,
    stack: BlockStack,
    layout: UnitLayout,
    microbatch: Any,
    max_length: int,
    num_sequences: int,
    device: torch.device,
    optimizer_states_per_parameter: float = 2.0,
    speed: DeviceSpeed | None = None,
) -> CostEstimate:
    """The meta-device cost model of ``module`` (``profiling.cost_probe``) for microbatches like ``microbatch``.

    Args:
        module: the user's module.
        stack: its block stack.
        layout: its units.
        microbatch: an example microbatch (structure and dtypes only).
        max_length: the longest sample length to probe.
        num_sequences: samples per probe microbatch.
        device: the device training runs on (sets the assumed speed and link).
        optimizer_states_per_parameter: optimizer state tensors per trained parameter.
        speed: the assumed device; None: :meth:`DeviceSpeed.for_device`.
    """
    counts = count_units(
        module,
        stack,
        "training_step",
        (microbatch, 0),
        probe_shapes(max_length, num_sequences),
        speed or DeviceSpeed.for_device(device),
    )
    latency, bandwidth = assumed_link(device)
    return fit_cost_model(counts, module, layout, optimizer_states_per_parameter, latency, bandwidth)


def profile_grid(max_length: int, num_sequences: int) -> list[tuple[int, int]]:
    """The profiler's default ``(num_sequences, length)`` grid: 4 lengths down to a quarter, 2 sizes."""
    lengths = dict.fromkeys(max(2, round(max_length * f)) for f in (1.0, 0.75, 0.5, 0.25))
    sizes = dict.fromkeys((num_sequences, max(1, num_sequences // 2)))
    return [(b, n) for n in lengths for b in sizes]


def profile_module(
    module: torch.nn.Module,
    microbatch: Any,
    shapes: Sequence[tuple[int, int]],
    blocks: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    holdout_fraction: float = 0.25,
    optimizer_states_per_parameter: float = 2.0,
) -> CostEstimate:
    """Profile a whole module in this process (no strategy, no process group): time every unit on
    ``shapes``, fit, and return the :class:`CostEstimate` (``lightning-pipe-profile`` uses this).

    Args:
        module: the user's module, on the device to profile.
        microbatch: an example microbatch on that device (values are reused to make the probes).
        shapes: ``(num_sequences, length)`` of every probe microbatch.
        blocks: dotted path of the block stack; None: found automatically.
        repeats: timed runs per shape (median kept).
        warmup: untimed runs per shape first.
        holdout_fraction: share of samples held out to report each fit's error.
        optimizer_states_per_parameter: optimizer state tensors per trained parameter (2: Adam).
    """
    from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks

    stack = find_blocks(module, blocks)
    layout = analyze_units(module, stack)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    runner = StageRunner(module, stack)
    try:
        span = StageSpan(0, 0, stack.num_blocks, stack.num_blocks)
        timings = time_units(
            runner, "training_step", (microbatch, 0), [span], shapes, list(module.parameters()), device, repeats, warmup
        )
    finally:
        runner.remove()
    template = estimate_costs(
        module,
        stack,
        layout,
        microbatch,
        max(n for _, n in shapes),
        max(b for b, _ in shapes),
        device,
        optimizer_states_per_parameter,
    )
    return fit_timings(timings, template, holdout_fraction)


def probe_lengths(length: int) -> list[int]:
    """Probe lengths from the longest one: it and 3/4, 1/2, 1/4 of it (at least 2, no repeats)."""
    return list(dict.fromkeys(max(2, round(length * f)) for f in (1.0, 0.75, 0.5, 0.25)))


def probe_grid(lengths: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Every ``(num_sequences, length)`` pair of ``sizes`` x ``lengths`` (repeats dropped), lengths outer."""
    return [(b, n) for n in dict.fromkeys(lengths) for b in dict.fromkeys(sizes)]


def save_profile(estimate: Any, path: str | Path) -> None:
    """Write a ``CostEstimate`` as JSON (a ``CostModel`` profile plus ``length_offset`` and fit errors)."""
    data = estimate.to_dict()
    data["fit_errors"] = {
        fit.unit.name: {"forward": fit.forward.relative_error, "backward": fit.backward.relative_error}
        for fit in estimate.fits
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def format_fits(estimate: Any) -> str:
    """One line per unit: fitted forward/backward coefficients and held-out relative errors."""
    lines = [f"{'unit':<10} {'fwd s/token':>12} {'fwd s/len^2':>12} {'bwd s/token':>12} {'fwd err':>8} {'bwd err':>8}"]
    for fit in estimate.fits:
        unit = fit.unit
        lines.append(
            f"{unit.name:<10} {unit.forward.per_token:>12.3e} {unit.forward.per_squared_length:>12.3e} "
            f"{unit.backward.per_token:>12.3e} {fit.forward.relative_error:>8.1%} {fit.backward.relative_error:>8.1%}"
        )
    return "\n".join(lines)
