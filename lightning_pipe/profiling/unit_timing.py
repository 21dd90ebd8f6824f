"""Time every unit of an unchanged module for real, and fit the planners' cost model to the times.

:func:`time_units` runs the stages of one rank through the :class:`~lightning_pipe.model.StageRunner`
(stages that are not first get zero inputs of the shapes the previous stage would send; no
communication) and times each unit's forward and backward with the hooks of
:class:`~lightning_pipe.profiling.unit_tracker.UnitTracker` (synchronizing CUDA at each switch).
:func:`fit_timings` fits per-unit linear costs (``planning.fit``) and keeps a meta estimate's bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.stage_runner import StageRunner, StageSpan
from lightning_pipe.model.units import UnitLayout
from lightning_pipe.planning.cost_model import MicrobatchShape
from lightning_pipe.planning.fit import TimingSample, fit_unit_cost
from lightning_pipe.profiling.cost_probe import CostEstimate, UnitCount, fit_cost_model, length_offset
from lightning_pipe.profiling.probing import untouched
from lightning_pipe.profiling.unit_tracker import SavedBytes, UnitTracker, resize_microbatch, step_loss
from lightning_pipe.runtime._torch_compat import tree_flatten

__all__ = ["UnitTiming", "fit_timings", "measured_template", "time_units"]


@dataclass(frozen=True)
class UnitTiming:
    """Measured seconds of one unit on one probe microbatch (real device).

    Attributes:
        unit: unit index (``pre`` is 0).
        num_sequences: samples in the microbatch.
        length: positions per sample of the token tensor.
        positions: positions per sample the blocks process.
        forward_seconds: median forward seconds over the repeats.
        backward_seconds: median backward seconds over the repeats.
        saved_bytes: bytes autograd kept from the unit's forward for backward (measured).
        output_bytes: bytes of the tensors the unit handed on (0 for ``post``).
    """

    unit: int
    num_sequences: int
    length: int
    positions: int
    forward_seconds: float
    backward_seconds: float
    saved_bytes: int = 0
    output_bytes: int = 0


class _Clock:
    """Time spent in each unit, from the tracker's switches (synchronizing CUDA at each)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.unit = -1
        self.since = 0.0
        self.spent: dict[int, float] = defaultdict(float)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, unit: int) -> None:
        self.unit, self.since = unit, self.now()

    def switch(self, unit: int) -> None:
        now = self.now()
        self.spent[self.unit] += now - self.since
        self.unit, self.since = unit, now

    def stop(self) -> None:
        self.switch(-1)


@dataclass
class _SpanRun:
    """What one run of a span measured, per unit."""

    forward: dict[int, float]
    backward: dict[int, float]
    positions: int
    saved: dict[int, int]
    outputs: dict[int, int]


def _time_span_once(
    runner: StageRunner, step_name: str, args: tuple, span: StageSpan, params: list[Tensor], device: torch.device
) -> _SpanRun:
    forward, backward = _Clock(device), _Clock(device)

    def on_switch(direction: str, unit: int) -> None:
        (forward if direction == "forward" else backward).switch(unit)

    tracker = UnitTracker(runner.stack.blocks, on_switch)
    saved = SavedBytes(tracker, params + [t for t in tree_flatten(args)[0] if isinstance(t, Tensor)])

    def receive(metas: list[Tensor]) -> list[Tensor]:
        inputs = []
        for meta in metas:
            tensor = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
            inputs.append(tensor.requires_grad_(True) if tensor.is_floating_point() else tensor)
        saved.exclude(inputs)
        return inputs

    with tracker, torch.enable_grad():
        forward.start(0)
        with saved.hooks():
            result = runner.run(step_name, args, span, receive=None if span.is_first else receive)
        forward.stop()
        if span.is_last:
            loss = step_loss(result.step_output)
            outputs, grads = ([loss], None) if loss is not None and loss.requires_grad else ([], None)
        else:
            outputs = [t for t in result.outputs if t.requires_grad]
            grads = [torch.ones_like(t) for t in outputs]
        inputs = [p for p in params if p.requires_grad] + [t for t in result.inputs if t.requires_grad]
        if outputs and inputs:
            backward.start(span.num_blocks + 1 if span.is_last else span.end_block)
            torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
            backward.stop()
    del result
    return _SpanRun(forward.spent, backward.spent, tracker.positions, dict(saved.saved), dict(tracker.outputs))


def _span_units(span: StageSpan) -> list[int]:
    units = [0] if span.is_first else []
    units += [1 + b for b in range(span.first_block, span.end_block)]
    return units + ([span.num_blocks + 1] if span.is_last else [])


def time_units(
    runner: StageRunner,
    step_name: str,
    step_args: tuple,
    spans: Sequence[StageSpan],
    shapes: Sequence[tuple[int, int]],
    parameters: Sequence[Tensor],
    device: torch.device,
    repeats: int = 3,
    warmup: int = 1,
    step_context: Callable[[], Any] | None = None,
) -> list[UnitTiming]:
    """Time the forward and backward of every unit of ``spans`` for every probe shape, for real.

    Each stage runs the user's step through ``runner`` (stages that are not first get zero inputs of
    the shapes the previous stage would send), then backward from the loss (last stage) or from
    gradients of ones on the stage's outputs, with ``torch.autograd.grad`` (no ``.grad`` changes).
    Shapes are visited round-robin ``repeats`` times, so that a slow period of a shared machine
    spreads over all shapes; the median is kept. RNG state and buffers are restored afterwards.

    Args:
        runner: the stage runner of the module.
        step_name: ``"training_step"``.
        step_args: an example of the step's arguments (microbatch first, with real values).
        spans: the stages to time (this rank's).
        shapes: ``(num_sequences, length)`` of every probe microbatch.
        parameters: the real parameters of the spans' units (gradients are computed for them).
        device: where the stages run.
        repeats: timed runs per shape.
        warmup: untimed runs per shape first.
        step_context: a context-manager factory around each run (precision autocast).

    Returns:
        One :class:`UnitTiming` per unit of ``spans`` and shape.
    """
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    params = list(parameters)
    probes = [(shape, (resize_microbatch(step_args[0], *shape, device=device), *step_args[1:])) for shape in shapes]
    samples: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    positions: dict[tuple[int, int], int] = {}
    nbytes: dict[tuple, tuple[int, int]] = {}
    context = step_context or contextlib.nullcontext
    with untouched(runner.root, device):
        for round_index in range(warmup + repeats):
            for shape, args in probes:
                for span in spans:
                    with context():
                        run = _time_span_once(runner, step_name, args, span, params, device)
                    positions[shape] = run.positions or positions.get(shape, 0)
                    if round_index < warmup:
                        continue
                    for unit in _span_units(span):
                        samples[(shape, unit)].append((run.forward.get(unit, 0.0), run.backward.get(unit, 0.0)))
                        output = 0 if unit == span.num_blocks + 1 else run.outputs.get(unit, 0)
                        nbytes[(shape, unit)] = (run.saved.get(unit, 0), output)
    timings = []
    for (shape, unit), values in sorted(samples.items()):
        timings.append(
            UnitTiming(
                unit,
                shape[0],
                shape[1],
                positions.get(shape) or shape[1],
                statistics.median(v[0] for v in values),
                statistics.median(v[1] for v in values),
                *nbytes[(shape, unit)],
            )
        )
    return timings


def fit_timings(timings: Sequence[UnitTiming], template: CostEstimate, holdout_fraction: float = 0.25) -> CostEstimate:
    """Replace the seconds of ``template`` (bytes kept) by fits of measured timings.

    Args:
        timings: from :func:`time_units` (every unit, at least four shapes each when holding out).
        template: the model to start from (a meta estimate: bytes, parameters, link).
        holdout_fraction: fraction of each unit's samples held out to report the fit's error.

    Returns:
        A :class:`CostEstimate` with ``source="profile"`` and one fit per unit in ``fits``.
    """
    offset = length_offset([(t.length, t.positions) for t in timings])
    by_unit: dict[int, list[UnitTiming]] = defaultdict(list)
    for timing in timings:
        by_unit[timing.unit].append(timing)
    fits = []
    for unit, cost in enumerate(template.cost_model.units):
        rows = by_unit.get(unit)
        if not rows:
            raise ValueError(f"No timings for unit {unit} ({cost.name}); every unit must be timed by some rank.")
        samples = [
            TimingSample(
                MicrobatchShape.from_lengths([max(1, r.length - offset)] * r.num_sequences),
                max(r.forward_seconds, 1e-9),
                max(r.backward_seconds, 1e-9),
            )
            for r in rows
        ]
        fits.append(fit_unit_cost(samples, cost, holdout_fraction=holdout_fraction))
    model = dataclasses.replace(template.cost_model, units=tuple(f.unit for f in fits))
    return CostEstimate(model, offset, "profile", tuple(fits))


def measured_template(
    timings: Sequence[UnitTiming],
    module: torch.nn.Module,
    layout: UnitLayout,
    optimizer_states_per_parameter: float = 2.0,
    latency: float = 0.0,
    bandwidth: float = float("inf"),
) -> CostEstimate:
    """A cost model made only from real runs: seconds, saved and output bytes as :func:`time_units` measured.

    What :func:`fit_timings` starts from when the meta-device probe cannot run the user's step
    (``.item()``, data-dependent branches): the same per-unit linear fits as
    :func:`~lightning_pipe.profiling.cost_probe.fit_cost_model`, from measured instead of counted rows.

    Args:
        timings: from :func:`time_units`, every unit on at least one shape (three for linear fits).
        module: the user's module (parameter bytes per unit; placeholders count by their shapes).
        layout: its units.
        optimizer_states_per_parameter: optimizer state tensors per trained parameter.
        latency: seconds per point-to-point message.
        bandwidth: bytes per second of a link between stages.
    """
    counts = [
        UnitCount(
            unit=t.unit,
            num_sequences=t.num_sequences,
            length=t.length,
            positions=t.positions,
            forward_flops=0.0,
            backward_flops=0.0,
            forward_seconds=t.forward_seconds,
            backward_seconds=t.backward_seconds,
            num_forward_ops=0,
            saved_bytes=t.saved_bytes,
            output_bytes=t.output_bytes,
        )
        for t in timings
    ]
    return fit_cost_model(counts, module, layout, optimizer_states_per_parameter, latency, bandwidth)
