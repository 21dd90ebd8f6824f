"""Combine the ``self.log`` calls of a step's microbatches into the calls of the whole batch.

The user's step logs once per microbatch, on the last stage only. Lightning must see one call per
name per batch, with the value a single-device run over the whole batch would log: microbatch
values are combined by the call's ``reduce_fx`` ("mean" weighted per call: by the microbatch's share
of the batch's loss for the returned loss, by counted targets for other token-averaged losses, by
samples otherwise; "sum", "max", "min"), then replayed on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.metrics import MetricObject, MetricValue
from lightning_pipe.model.stage_runner import LogCall

_MEAN = ("mean", torch.mean)
_SUM = ("sum", torch.sum)
_MAX = ("max", torch.max)
_MIN = ("min", torch.min)


def _as_tensor(name: str, value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().to("cpu", torch.float64)
    if isinstance(value, (int, float, bool)):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(
        f"`self.log({name!r}, <{type(value).__name__}>)` inside a pipelined step is not supported: log tensors or "
        "numbers (for torchmetrics, log `metric.compute()` in an epoch-end hook instead of the Metric object)."
    )


def reduce_log_calls(per_microbatch: list[list[LogCall]], weights: list[list[float]]) -> list[LogCall]:
    """One call per logged name, combining the microbatches that logged it.

    Args:
        per_microbatch: the calls recorded for each microbatch, in microbatch order.
        weights: per microbatch, the weight of each of its calls in a "mean" (normalised over the
            microbatches that logged the name; a zero weight leaves a microbatch out).

    Returns:
        Calls with CPU float64 tensor values, ready to broadcast and replay.
    """
    names: dict[str, list[tuple[float, LogCall]]] = {}
    for call_weights, calls in zip(weights, per_microbatch, strict=True):
        for weight, call in zip(call_weights, calls, strict=True):
            names.setdefault(call.name, []).append((weight, call))
    reduced = []
    for name, entries in names.items():
        kwargs = dict(entries[0][1].kwargs)
        markers = {call.value for _, call in entries if isinstance(call.value, (MetricObject, MetricValue))}
        if markers:  # a metric (or its forward result): one batch-level value, replayed as is
            if len(markers) != 1 or any(not isinstance(c.value, (MetricObject, MetricValue)) for _, c in entries):
                raise ValueError(f"`self.log({name!r}, ...)` logged different metrics or values in one step.")
            reduced.append(LogCall(name, markers.pop(), kwargs))
            continue
        values = torch.stack([_as_tensor(name, call.value) for _, call in entries])
        fx = kwargs.get("reduce_fx", "mean")
        if fx in _MEAN:
            w = torch.tensor([weight for weight, _ in entries], dtype=torch.float64)
            kept = w != 0  # a microbatch without counted targets logs NaN and contributes nothing
            if kept.any():
                values, w = values[kept], w[kept]
            value = (values * (w / w.sum()).view(-1, *([1] * (values.dim() - 1)))).sum(0)
        elif fx in _SUM:
            value = values.sum(0)
        elif fx in _MAX:
            value = values.max(0).values
        elif fx in _MIN:
            value = values.min(0).values
        else:
            raise ValueError(f"`self.log({name!r}, reduce_fx={fx!r})`: pipelined steps support mean, sum, max and min.")
        first = entries[0][1].value
        value = value.to(first.dtype if isinstance(first, Tensor) and first.is_floating_point() else torch.float32)
        if "batch_size" in kwargs:
            kwargs["batch_size"] = sum(call.kwargs.get("batch_size", 0) for _, call in entries)
        reduced.append(LogCall(name, value, kwargs))
    return reduced
