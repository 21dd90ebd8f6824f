"""What the probes share: where a microbatch's sequences are, and running a probe without a trace.

The memory profile, the unit tracker and the unit timings all read sequence lengths from the same
token tensor and all restore RNG state, buffers and metric states after probing (training is the
same as without).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_pipe.model._torchmetrics_compat import restore_snapshot, snapshot
from lightning_pipe.runtime._torch_compat import tree_flatten

__all__ = ["metrics_untouched", "token_tensor", "untouched"]


def token_tensor(microbatch: Any) -> Tensor:
    """The microbatch's token tensor ``[B, T, ...]``: its first integer tensor of two or more dimensions
    (token ids), else its first tensor of two or more dimensions.

    Raises:
        ValueError: when the microbatch holds no such tensor (say how long samples are instead).
    """
    leaves = [leaf for leaf in tree_flatten(microbatch)[0] if isinstance(leaf, Tensor) and leaf.dim() >= 2]
    integers = [leaf for leaf in leaves if not leaf.is_floating_point() and not leaf.is_complex()]
    if integers:
        return integers[0]
    if leaves:
        return leaves[0]
    raise ValueError(
        f"Cannot find sequences in a microbatch of type {type(microbatch).__name__}: memory planning reads the "
        "sequence length from the first tensor of shape [batch, length, ...] (token ids first). Pass "
        "`lengths=` to MemoryPlanner to say how long each sample is."
    )


@contextlib.contextmanager
def untouched(module: nn.Module, device: torch.device):
    """Restore RNG state, every real buffer and every torchmetrics metric's state after the block
    (probes run the user's step, whose metric updates must not count the probes' data)."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers() if not b.is_meta}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), metrics_untouched(module):
        try:
            yield
        finally:
            current = dict(module.named_buffers())
            with torch.no_grad():
                for name, value in buffers.items():
                    current[name].copy_(value)


@contextlib.contextmanager
def metrics_untouched(module: nn.Module):
    """Restore the state of every torchmetrics metric in ``module`` after the block: a probe runs the
    user's step, and its metric updates (on probe data, or failing halfway on meta tensors) must not
    count."""
    saved = [(metric, snapshot(metric)) for metric in module.modules() if isinstance(metric, Metric)]
    try:
        yield
    finally:
        for metric, state in saved:
            restore_snapshot(metric, state)
