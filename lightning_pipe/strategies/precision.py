"""Gradient clipping by the global norm over every stage of the pipeline.

Lightning's precision plugins clip by the norm of the gradients *this process* holds, which under
pipeline parallelism is one stage's. The strategy gives whichever precision plugin Lightning chose
(32-true, 64-true, bf16-mixed, ...) a ``clip_grad_by_norm`` that uses the norm over all stages, so
clipping is exactly that of a single-device run. It is set on the plugin instance, not by
subclassing, because Lightning picks the plugin class from the ``precision`` flag.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer


def install_global_norm_clipping(plugin: Precision, norm_of: Callable[[list[Tensor]], Tensor]) -> None:
    """Make ``plugin`` clip by the norm ``norm_of(gradients)`` returns (the pipeline-wide norm).

    Args:
        plugin: the strategy's precision plugin.
        norm_of: given this rank's gradients, returns the global L2 norm (a collective).
    """

    def clip_grad_by_norm(self: Precision, optimizer: Optimizer, clip_val: float) -> None:
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None and p.device.type != "meta"]
        total_norm = norm_of(grads)
        # the same arithmetic as torch.nn.utils.clip_grad_norm_
        coefficient = torch.clamp(clip_val / (total_norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.device, grad.dtype))

    plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)
