"""Check that running a microbatch cut to its real tokens gives the model's own result.

Cutting the padding of a microbatch (``runtime/padding.py``) is exact for a model whose real
positions never read padded ones: padding is masked out of attention, positions come from the batch
or start at the first real token, and the loss ignores padded labels. A model that averages over
the sequence including padding, or numbers positions with ``arange`` over the padded length of a
left-padded batch, gives another result. That is not assumed either way: once per batch layout,
:func:`check_trimming` runs one microbatch cut and uncut through the whole pipeline, forward only,
and compares every block output this rank computes (at the real positions) and the step's result.

It runs in two phases so that a model that cannot run cut fails on every rank alike, never on one
rank while its peers wait for its tensors: first the step runs on the meta device on every rank
(``StageRunner.observe``: shapes only), the ranks agree, then the real forward runs.
Dropout and other random draws do not disturb training: the module runs in evaluation mode under
a forked random-number state.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.metrics import metrics_inert
from lightning_pipe.model.stage_runner import StageRunner, StageSpan
from lightning_pipe.runtime import collectives
from lightning_pipe.runtime._torch_compat import tree_flatten
from lightning_pipe.runtime.executor import PipelineExecutor, StepWork
from lightning_pipe.runtime.side_runs import quiet_forward, relative_tolerance
from lightning_pipe.runtime.microbatch import MicrobatchPlan
from lightning_pipe.schedules.ir import Program


@dataclass(frozen=True)
class TrimVerdict:
    """Whether cutting padding is exact for this model and batch layout, and if not, why."""

    exact: bool
    reason: str = ""


def check_trimming(
    plan: MicrobatchPlan,
    batch: Any,
    rest: tuple,
    step_name: str,
    runner: StageRunner,
    executor: PipelineExecutor,
    program_for: Callable[[int], Program],
    spans: dict[int, StageSpan],
    group: Any,
) -> TrimVerdict | None:
    """Run the microbatch of ``plan`` that loses the most padding cut and uncut, and compare.

    A collective of the pipeline ``group`` (None: one process): every rank calls it with the
    same plan and gets the same verdict. None: no microbatch of this batch is cut (only ordered),
    so there is nothing to check yet.

    Args:
        plan: the batch's microbatch plan, with windows.
        batch: the batch the plan was made for.
        rest: the step's other arguments (the batch index, ...).
        step_name: the step to run (``"training_step"``).
        runner: runs stages of the user's module.
        executor: runs programs on this rank.
        program_for: a forward-only program for a number of microbatches (the current schedule's).
        spans: this rank's stages.
        group: the pipeline process group.
    """
    padding = plan.padding
    assert padding is not None
    mb = max(range(plan.num_microbatches), key=lambda i: padding.length - (plan.lengths[i] or padding.length))
    window = plan.windows[mb]
    if window is None:
        return None
    cut = plan.split(batch)[mb]
    whole = plan.untrimmed().split(batch)[mb]
    module = runner.root
    try:
        with metrics_inert(module):
            runner.observe(step_name, (cut, *rest))
        failure = ""
    except Exception as error:  # noqa: BLE001 - any error: the model cannot run a cut microbatch
        failure = f"`{step_name}` cannot run a microbatch cut to its real tokens ({type(error).__name__}: {error})"
    failures = _agree(failure, group)
    if failures:
        return TrimVerdict(False, failures[0])

    outputs: dict[tuple[int, int], Any] = {}

    def recorder(stage: int, microbatch: int):
        def run(index: int, original: Callable, args: tuple, kwargs: dict) -> Any:
            output = original(*args, **kwargs)
            outputs[(microbatch, index)] = output
            return output

        return run

    samples = plan.samples(mb)
    real = torch.tensor(
        [[padding.starts[i] <= p < padding.ends[i] for p in range(*window)] for i in samples], dtype=torch.bool
    )
    program, count = _program_of_two(program_for, plan.num_microbatches)
    steps = [(cut, *rest)] + [(whole, *rest)] * (count - 1)
    with ExitStack() as stack:
        stack.enter_context(quiet_forward(module))
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        outcome = executor.run(program, spans, StepWork(step_name, steps, block_wrapper=recorder))
    differences = []
    for (microbatch, index), output in sorted(outputs.items(), key=lambda kv: kv[0][::-1]):
        if microbatch == 0 and (1, index) in outputs:
            where = f"the output of block `{runner.stack.block_path(index)}`"
            differences += _compare(output, outputs[(1, index)], window, real, where)
    if 0 in outcome.step_outputs and 1 in outcome.step_outputs:
        differences += _compare(outcome.step_outputs[0], outcome.step_outputs[1], None, None, f"what `{step_name}` returns")
    disagreements = _agree(differences[0] if differences else "", group)
    return TrimVerdict(not disagreements, disagreements[0] if disagreements else "")


def _agree(failure: str, group: Any) -> list[str]:
    """Every rank's failure (empty strings dropped), the same list on every rank."""
    failures = [failure] if group is None else collectives.all_gather_objects(failure, group)
    return [f for f in failures if f]


def _program_of_two(program_for: Callable[[int], Program], fallback: int) -> tuple[Program, int]:
    """A forward-only program for the two microbatches (or the plan's count, if the schedule needs
    more: the extra microbatches repeat the uncut one)."""
    try:
        return program_for(2), 2
    except ValueError:
        return program_for(fallback), fallback


def _compare(cut: Any, whole: Any, window: tuple[int, int] | None, real: Tensor | None, where: str) -> list[str]:
    """Differences between a cut run's value and the uncut run's, at the real positions."""
    cut_leaves, whole_leaves = tree_flatten(cut)[0], tree_flatten(whole)[0]
    if len(cut_leaves) != len(whole_leaves):
        return [f"{where} has another structure when cut"]
    found = []
    for a, b in zip(cut_leaves, whole_leaves):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or not (a.is_floating_point() or a.is_complex()):
            continue
        if window is not None and a.dim() >= 2 and b.dim() >= 2 and a.shape[0] == b.shape[0] and (
            a.shape[1] == window[1] - window[0] and b.shape[1] != a.shape[1] and a.shape[2:] == b.shape[2:]
        ):
            assert real is not None
            mask = real.to(a.device)
            a, b = a[mask], b.narrow(1, window[0], window[1] - window[0])[mask]
        elif a.shape != b.shape:
            continue  # not per position: the step's result covers it
        tolerance = relative_tolerance(b.dtype)
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        if not torch.allclose(a.to(b.dtype), b, rtol=tolerance, atol=tolerance * scale):
            found.append(
                f"{where} differs at the real tokens (largest difference {float((a.to(b.dtype) - b).abs().max()):.3g})"
            )
    return found
