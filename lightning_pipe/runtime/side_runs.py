"""Extra forwards that check a plan against the plain run: they must leave no trace and agree to rounding.

The checks that decide whether a batch transform is exact for the user's model (cutting padding,
``runtime/padding_check.py``; packing and slicing, ``runtime/packing.py``) run the user's step a
second way beside the normal one. Those runs must not disturb training (no dropout draws, random
generators restored, metric states untouched) and compare with one rule of tolerance.
"""

from __future__ import annotations

import contextlib

import torch

from lightning_pipe.model.metrics import metrics_inert


@contextlib.contextmanager
def quiet_forward(module: torch.nn.Module):
    """Evaluation mode (no dropout), no gradients, metrics inert, and the random number generators
    restored afterwards; every submodule goes back to its own mode."""
    modes = [(m, m.training) for m in module.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), metrics_inert(module):
        module.train(False)
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training


def relative_tolerance(dtype: torch.dtype) -> float:
    """How far two runs that only reorder reductions (another length, another packing) may differ,
    relative to the values' scale: a few hundred units of the dtype's rounding."""
    if dtype in (torch.float64, torch.complex128):
        return 1e-9
    if dtype in (torch.float16, torch.bfloat16):
        return 3e-2
    return 1e-4
