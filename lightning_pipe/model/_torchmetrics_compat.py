"""Every private torchmetrics name ``model/metrics.py`` touches, in one place with a test
(tests/runtime/test_torch_compat.py).

The pipeline computes a metric's batch state on the last stage and merges it on every rank, as
torchmetrics' own ``forward`` does (``_reduce_states``, ``_update_count``, ``_forward_cache``); there
is no public API for that. A torchmetrics upgrade that renames one breaks this file, with a message
saying so, and nothing else.
"""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from torchmetrics import Metric

__all__ = [
    "batch_compute",
    "check_metric",
    "clear_computed",
    "forward_cache",
    "reduce_states",
    "restore_snapshot",
    "set_forward_cache",
    "set_update_count",
    "snapshot",
    "state_copy",
    "update_count",
]

_ATTRIBUTES = ("_update_count", "_forward_cache", "_to_sync", "_should_unsync", "_computed")
_METHODS = ("_copy_state_dict", "_reduce_states")


def check_metric(metric: Metric) -> None:
    """Raise if ``metric`` lacks a private name used here (a torchmetrics version we do not know).

    Raises:
        RuntimeError: naming the missing names and this file.
    """
    missing = [name for name in _ATTRIBUTES + _METHODS if not hasattr(metric, name)]
    if missing:
        raise RuntimeError(
            f"torchmetrics {torchmetrics.__version__}: `{type(metric).__name__}` has no {missing}, which lightning-pipe "
            "uses to merge a metric's batch state across pipeline ranks: update lightning_pipe/model/_torchmetrics_compat.py."
        )


def state_copy(metric: Metric) -> dict[str, Any]:
    """A copy of the metric's states (``_copy_state_dict``)."""
    return metric._copy_state_dict()


def update_count(metric: Metric) -> int:
    """How many times ``update`` ran since the last reset (``_update_count``)."""
    return metric._update_count


def set_update_count(metric: Metric, count: int) -> None:
    """Set ``_update_count`` (after merging states whose updates it must count)."""
    metric._update_count = count


def forward_cache(metric: Metric) -> Any:
    """The value the last ``forward`` returned (``_forward_cache``)."""
    return metric._forward_cache


def set_forward_cache(metric: Metric, value: Any) -> None:
    """Make ``value`` the last ``forward``'s result, as if this rank had run it."""
    metric._forward_cache = value


def reduce_states(metric: Metric, saved: dict[str, Any]) -> None:
    """Reduce the metric's current (batch) state with ``saved`` by its own reduction functions
    (``_reduce_states``, what ``forward`` does with the state before the batch)."""
    metric._reduce_states(saved)


def clear_computed(metric: Metric) -> None:
    """Forget the cached ``compute`` result (``_computed``) after its state changed."""
    metric._computed = None


def batch_compute(metric: Metric) -> Any:
    """``compute`` over the current (batch) state, synchronised only as ``forward`` would."""
    to_sync, unsync, cached = metric._to_sync, metric._should_unsync, metric.compute_with_cache
    metric._to_sync, metric._should_unsync, metric._computed = metric.dist_sync_on_step, False, None
    try:
        with torch.no_grad():
            return metric.compute()
    finally:
        metric._to_sync, metric._should_unsync, metric._computed = to_sync, unsync, None
        metric.compute_with_cache = cached


def snapshot(metric: Metric) -> tuple[dict[str, Any], int, Any, Any]:
    """Everything an ``update`` or ``forward`` changes: a copy of the states, the update count, the
    last forward's result and the cached ``compute`` (for :func:`restore_snapshot`)."""
    return state_copy(metric), metric._update_count, metric._forward_cache, metric._computed


def restore_snapshot(metric: Metric, saved: tuple[dict[str, Any], int, Any, Any]) -> None:
    """Put back what :func:`snapshot` took: the metric is as if the calls in between never ran."""
    states, metric._update_count, metric._forward_cache, metric._computed = saved
    for name, value in states.items():
        setattr(metric, name, value)
