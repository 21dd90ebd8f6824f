"""Find what in a module makes splitting its batch into microbatches ambiguous or inexact.

* Time-major layers (``batch_first=False``: ``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``,
  RNNs by default) take ``(T, B, ...)`` tensors. The batch split cannot tell from shapes alone
  whether the dataloader's tensors are laid out that way, so the user must say (``batch_dim``).
* Layers that mix samples in training (batch normalization) compute statistics over the samples
  they see: with microbatches those are a microbatch's, not the batch's, so the result differs
  from one device.
"""

from __future__ import annotations

from torch import nn

from lightning_pipe.model._torch_compat import BatchNormBase


def find_time_major_modules(module: nn.Module) -> list[tuple[str, str]]:
    """``(name, class name)`` of every submodule with ``batch_first=False`` (time-major inputs)."""
    found = []
    for name, child in module.named_modules():
        if getattr(child, "batch_first", None) is False:
            found.append((name, type(child).__name__))
    return found


def find_sample_mixing_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every batch-normalization layer (statistics over the samples in training)."""
    return [(name, child) for name, child in module.named_modules() if isinstance(child, BatchNormBase)]


def describe_modules(found: list[tuple[str, object]], limit: int = 3) -> str:
    """```model.bn1` (BatchNorm1d), ...``: how messages name modules."""
    names = [f"`{name}` ({kind if isinstance(kind, str) else type(kind).__name__})" for name, kind in found[:limit]]
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return ", ".join(names) + more
