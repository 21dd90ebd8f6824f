"""Optimizers the pipeline cannot run, refused at setup (before the first update)."""

from __future__ import annotations

import torch
from torch.optim import Optimizer


# Optimizers that re-evaluate the loss inside ``step`` or treat all parameters as one flat vector.
_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def check_optimizers(optimizers: list[Optimizer], strategy_name: str) -> None:
    """Refuse optimizers the pipeline cannot run, before the first update.

    Raises:
        ValueError: ``torch.optim.LBFGS`` (or a subclass): it calls the closure several times per
            step and flattens every parameter into one vector, while each rank holds only its stages'
            parameters (the others are on the meta device).
    """
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if isinstance(optimizer, _CLOSURE_OPTIMIZERS):
            raise ValueError(
                f"`{type(optimizer).__name__}` is not supported by `{strategy_name}`: it re-evaluates the closure "
                "several times per step and works on all parameters as one flat vector, while each pipeline rank "
                "runs the forward and backward once per step and holds only its own stages' parameters. Use a "
                "first-order optimizer (SGD, Adam, AdamW, ...) in `configure_optimizers`, or train on one device."
            )
