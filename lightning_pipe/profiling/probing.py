"""What the probes share: where a microbatch's sequences are, and running a probe without a trace.

The memory profile, the unit tracker and the unit timings all read sequence lengths from the same
token tensor and all restore RNG state and buffers after probing (training is the same as without).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.runtime._torch_compat import tree_flatten

__all__ = ["token_tensor", "untouched"]


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
    """Restore RNG state and every real buffer after the block (probes must not change training)."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers() if not b.is_meta}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            current = dict(module.named_buffers())
            with torch.no_grad():
                for name, value in buffers.items():
                    current[name].copy_(value)
