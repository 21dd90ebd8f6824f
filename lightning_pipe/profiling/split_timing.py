"""What zero-bubble's split backward costs on a real stage, against its full backward.

The planners price ``I`` and ``W`` as shares of a stage's backward
(:class:`~lightning_pipe.schedules.costs.SplitBackward`). Half each is the ideal; measured on CPU, on
small layers, the two passes cost 1.1x to 1.3x one backward together (each has its own autograd engine
calls, and ``I`` keeps the gradients ``W`` starts from), so a planner using the halves picks split
families where they lose. :func:`time_split_backward` measures one stage of the strategy the way the
executor runs it (``runtime/split_backward.py``), on one real microbatch, without touching ``.grad``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.stage_runner import StageRunner, StageSpan
from lightning_pipe.profiling.probing import untouched
from lightning_pipe.profiling.unit_tracker import step_loss
from lightning_pipe.runtime.split_backward import backward_input

__all__ = ["SplitTiming", "time_split_backward"]


@dataclass(frozen=True)
class SplitTiming:
    """Median seconds of one stage's backward on one microbatch: whole (``B``) and split (``I``, ``W``)."""

    backward_seconds: float
    input_seconds: float
    weight_seconds: float


def time_split_backward(
    runner: StageRunner,
    step_name: str,
    step_args: tuple,
    span: StageSpan,
    parameters: list[Tensor],
    device: torch.device,
    repeats: int = 3,
    warmup: int = 1,
    step_context: Callable[[], Any] | None = None,
) -> SplitTiming:
    """Time ``span``'s backward whole and split, alternating, on the microbatch of ``step_args``.

    The stage runs the user's step through ``runner`` (zero inputs of the received shapes, requiring
    gradients, as ``I`` computes them), then either ``B`` (gradients of the inputs and parameters
    together) or ``I`` then ``W``; no gradient is accumulated. RNG state and buffers are restored.

    Raises:
        ValueError: the span is the first stage (its inputs need no gradient: nothing to split).
    """
    if span.is_first:
        raise ValueError("The first stage's inputs need no gradient: its I computes nothing and its W is its B.")
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    params = [p for p in parameters if p.requires_grad]
    context = step_context or contextlib.nullcontext
    seconds: dict[str, list[float]] = {"B": [], "I": [], "W": []}
    with untouched(runner.root, device):
        for index in range(warmup + repeats):
            for split in (False, True):
                with context():
                    spent = _run_once(runner, step_name, step_args, span, params, device, split)
                if index >= warmup:
                    for part, value in spent.items():
                        seconds[part].append(value)
    return SplitTiming(*(statistics.median(seconds[part]) for part in ("B", "I", "W")))


def _run_once(runner, step_name, args, span, params, device, split: bool) -> dict[str, float]:
    def receive(metas: list[Tensor]) -> list[Tensor]:
        made = [torch.zeros(m.shape, dtype=m.dtype, device=device) for m in metas]
        return [t.requires_grad_(True) if t.is_floating_point() else t for t in made]

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    with torch.enable_grad():
        result = runner.run(step_name, args, span, receive=receive)
        if span.is_last:
            loss = step_loss(result.step_output)
            outputs, grads = ([loss], [None]) if loss is not None and loss.requires_grad else ([], [])
        else:
            outputs = [t for t in result.outputs if t.requires_grad]
            grads = [torch.ones_like(t) for t in outputs]
        inputs = [t for t in result.inputs if t.requires_grad]
        if not outputs:
            return {"B": 0.0} if not split else {"I": 0.0, "W": 0.0}
        start = now()
        if not split:
            torch.autograd.grad(outputs, params + inputs, None if span.is_last else grads, allow_unused=True)
            return {"B": now() - start}
        _, weight_pass = backward_input(outputs, grads, inputs, accumulate=False)
        middle = now()
        weight_pass.run(accumulate=False)
        return {"I": middle - start, "W": now() - middle}
