"""Measure what each unit saves for backward on probe microbatches, in each recompute mode.

A probe runs this rank's stages of the user's own step (:class:`~lightning_pipe.model.StageRunner`)
on one microbatch without communication (a stage's inputs are zeros of the shapes the previous
stage would send), under saved-tensor hooks that attribute every saved byte to its block, or to
``pre``/``post`` code before/after the blocks. Nothing runs backward; the graph is dropped. The RNG
state and the module's buffers are restored afterwards, so a probe leaves training untouched.

Results are plain records (sequence lengths, mode, unit, bytes) that ``planning.memory_model``
fits into per-unit linear costs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.stage_runner import StageRunner, StageSpan
from lightning_pipe.runtime.memory import FULL, KEEP_ATTENTION, NONE, MemoryRuntime
from lightning_pipe.runtime.memory_accounting import AFTER_BLOCKS, BEFORE_BLOCKS
from lightning_pipe.runtime.microbatch import batch_size_of, split_batch
from lightning_pipe.profiling.probing import token_tensor, untouched
from lightning_pipe.runtime import collectives
from lightning_pipe.runtime._torch_compat import tree_flatten, tree_map

PROBE_MODES = (NONE, FULL, KEEP_ATTENTION)


@dataclass(frozen=True)
class ProbeRecord:
    """Bytes one unit saved for one probe microbatch in one mode.

    Attributes:
        lengths: the probe's sequence lengths (one per sample).
        mode: ``"none"``, ``"full"`` or ``"keep_attention"``.
        unit: 0 for ``pre``, ``1 + block`` for a block, ``num_blocks + 1`` for ``post``.
        saved_bytes: bytes kept for backward.
        hidden: features per position of the unit's output (blocks; 0 otherwise).
        positions: positions per sample the block's output has (dimension -2; blocks; 0 otherwise):
            the sequence length the model really processes (token ids ``[B, T + 1]`` feed ``T``).
    """

    lengths: tuple[int, ...]
    mode: str
    unit: int
    saved_bytes: int
    hidden: int = 0
    positions: int = 0


def sequence_lengths(microbatch: Any) -> list[int]:
    """Length of every sample: dimension 1 of the first integer tensor ``[B, T]`` (token ids)."""
    tokens = token_tensor(microbatch)
    return [int(tokens.shape[1])] * int(tokens.shape[0])


def truncate_sequences(microbatch: Any, length: int) -> Any:
    """The microbatch with every tensor of the token tensor's ``[B, T, ...]`` shape cut to ``T = length``."""
    tokens = token_tensor(microbatch)
    batch, full = tokens.shape[0], tokens.shape[1]

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, Tensor) and leaf.dim() >= 2 and leaf.shape[0] == batch and leaf.shape[1] == full:
            return leaf[:, :length]
        return leaf

    return tree_map(cut, microbatch)


def probe_microbatches(microbatch: Any, probe_length: int | None = 512) -> list[Any]:
    """Up to three probes from one microbatch: itself (cut to ``probe_length``), half its samples, half its length.

    Different token counts and lengths let a linear fit separate per-sequence, per-token and
    per-squared-length bytes.
    """
    length = sequence_lengths(microbatch)[0]
    first = truncate_sequences(microbatch, probe_length) if probe_length and length > probe_length else microbatch
    probes = [first]
    size = batch_size_of(first)
    if size >= 2:
        probes.append(split_batch(first, 2)[0])
    length = sequence_lengths(first)[0]
    if length >= 4:
        probes.append(truncate_sequences(first, length // 2))
    return probes


def measure_stages(
    runner: StageRunner,
    memory: MemoryRuntime,
    step_name: str,
    probes: Sequence[tuple],
    spans: Iterable[StageSpan],
    parameters: Iterable[Tensor],
    device: torch.device,
    modes: Sequence[str] = PROBE_MODES,
    step_context: Any = None,
) -> list[ProbeRecord]:
    """Run every stage of ``spans`` on every probe in every mode; what each unit saved.

    Args:
        runner: the stage runner.
        memory: the rank's memory runtime (its counter is used, then left as it was).
        step_name: the step to run (``"training_step"``).
        probes: step arguments per probe (the microbatch first).
        spans: the stages this rank runs.
        parameters: tensors that are not activations.
        device: where the stage inputs are made.
        modes: recompute modes to measure.
        step_context: a context-manager factory around each run (precision autocast).
    """
    records: list[ProbeRecord] = []
    params = list(parameters)
    counter = memory.counter
    saved_state = (counter.static_bytes, counter.step, counter.budget_bytes)
    counter.budget_bytes = None
    try:
        with untouched(runner.root, device), torch.enable_grad():
            for args in probes:
                lengths = tuple(sequence_lengths(args[0]))
                for span in spans:
                    for mode in modes:
                        records += _measure_one(runner, memory, step_name, args, span, mode, params, device, lengths, step_context)
    finally:
        counter.static_bytes, counter.step, counter.budget_bytes = saved_state
    return records


def _measure_one(runner, memory, step_name, args, span, mode, params, device, lengths, step_context) -> list[ProbeRecord]:
    hidden: dict[int, int] = {}
    positions: dict[int, int] = {}
    count = span.end_block - span.first_block
    wrapper = None

    def receive(metas: list[Tensor]) -> list[Tensor]:
        inputs = []
        for meta in metas:
            tensor = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
            if tensor.is_floating_point():
                tensor.requires_grad_(True)
            inputs.append(tensor)
        return inputs

    def wrap(index, forward, call_args, kwargs):
        output = wrapper(index, forward, call_args, kwargs)
        leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.dim() > 0]
        if leaves:
            hidden[index] = int(leaves[0].shape[-1])
            positions[index] = int(leaves[0].shape[-2]) if leaves[0].dim() >= 2 else 0
        return output

    batch_tensors = [leaf for leaf in tree_flatten(args)[0] if isinstance(leaf, Tensor)]
    with memory.step(params + batch_tensors) as step:
        wrapper = memory.wrapper(span.stage, -1, span.first_block, [mode] * count)
        context = step_context() if step_context is not None else contextlib.nullcontext()
        with context:
            result = runner.run(step_name, args, span, receive=receive, wrap_block=wrap)
        by_block = dict(step.saved_by_block)
        del result
    gc.collect()  # the stage boundary's traceback holds the graph in a reference cycle
    records = []
    for (stage, _, block), nbytes in by_block.items():
        if stage != span.stage:
            continue
        if block == BEFORE_BLOCKS:
            if span.is_first:
                records.append(ProbeRecord(lengths, mode, 0, nbytes))
            elif nbytes:  # saved by glue code between the received inputs and the first block
                records.append(ProbeRecord(lengths, mode, 1 + span.first_block, nbytes))
        elif block == AFTER_BLOCKS:
            records.append(ProbeRecord(lengths, mode, span.num_blocks + 1, nbytes))
        else:
            records.append(ProbeRecord(lengths, mode, 1 + block, nbytes, hidden.get(block, 0), positions.get(block, 0)))
    seen = {r.unit for r in records}
    units = [1 + b for b in range(span.first_block, span.end_block)]
    units += [0] if span.is_first else []
    units += [span.num_blocks + 1] if span.is_last else []
    records += [
        ProbeRecord(lengths, mode, u, 0, hidden.get(u - 1, 0), positions.get(u - 1, 0)) for u in units if u not in seen
    ]
    return records


def gather_records(records: list[ProbeRecord], group: Any) -> list[ProbeRecord]:
    """Every rank's records, on every rank of ``group`` (one list; no-op without a process group)."""
    if not collectives.is_initialized() or collectives.group_size(group) == 1:
        return list(records)
    everything = collectives.all_gather_objects(records, group)
    return [r for part in everything for r in part]
