"""torchmetrics objects in a pipelined step: one device's states and values on every rank.

The user's step runs to the end only on the last stage, once per microbatch, so a ``Metric``'s
``update``/``forward`` runs there, per microbatch. One device updates it once per batch, computes
the batch value (``forward``'s result, what ``self.log(name, metric)`` shows on step) and, at the
epoch's end, ``compute`` over the accumulated state, on the rank that logs (rank 0, which may hold
the first stage). :class:`MetricStates` makes every rank see exactly that:

1. before the step, on the last stage, every metric's state is put aside and the metric reset, so
   the microbatches accumulate the *batch's* state;
2. after the step, the batch value is computed from that state (when ``forward`` ran), and the
   batch state is merged into the state put aside (torchmetrics' own ``_reduce_states``, as its
   ``forward`` does), so the last stage holds one device's state;
3. the batch states and values travel with the step's broadcast; every other rank of the pipeline
   merges them into its own metric objects, so all hold the same state;
4. ``self.log(name, metric)`` and logged ``forward`` results are replayed on every rank as the
   rank's own metric object and the batch value.

Epoch-end ``compute`` then runs on every rank with the same state; each metric's ``process_group``
(when the user left it unset) is the data-parallel group, so it reduces over replicas as DDP does,
not over the pipeline ranks that hold copies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.metric import CompositionalMetric

from lightning_pipe.model._torch_compat import tree_map
from lightning_pipe.model._torchmetrics_compat import (
    batch_compute,
    check_metric,
    clear_computed,
    forward_cache,
    reduce_states,
    set_forward_cache,
    set_update_count,
    state_copy,
    update_count,
)


@dataclass(frozen=True)
class MetricObject:
    """A logged ``Metric`` object, named by its path in the module (replayed as the rank's own)."""

    name: str


@dataclass(frozen=True)
class MetricValue:
    """A logged result of a metric's ``forward`` (replayed as the batch value)."""

    name: str


@dataclass
class BatchUpdate:
    """What one step did to one metric (plain data, CPU tensors).

    Attributes:
        state: the batch's state (the metric's state after the step minus what it held before).
        updates: ``update``/``forward`` calls per microbatch ... counted once per step.
        value: the batch value if ``forward`` ran in the step, else None.
    """

    state: dict[str, Any]
    updates: int
    value: Any = None


class MetricStates:
    """Keeps a module's torchmetrics objects identical on every pipeline rank (see the module docstring).

    Args:
        module: the user's module.
        data_parallel_group: the process group of this rank's data-parallel replicas.
    """

    def __init__(self, module: nn.Module, data_parallel_group: Any = None) -> None:
        self.metrics: dict[str, Metric] = {
            name: m for name, m in module.named_modules()
            if isinstance(m, Metric) and not isinstance(m, CompositionalMetric)
        }
        self._names = {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}
        for metric in self.metrics.values():
            check_metric(metric)
            if metric.process_group is None and data_parallel_group is not None:
                metric.process_group = data_parallel_group
        self._saved: dict[str, tuple[dict[str, Any], int]] = {}
        self._outputs: dict[int, tuple[Any, str]] = {}
        self._hooks: list[Any] = []

    def __bool__(self) -> bool:
        return bool(self.metrics)

    # --- last stage --------------------------------------------------------------------------------

    def begin(self) -> None:
        """Before the step's first microbatch: put states aside, reset, watch ``forward`` results."""
        for name, metric in self.metrics.items():
            self._saved[name] = (state_copy(metric), update_count(metric))
            metric.reset()
            self._hooks.append(metric.register_forward_hook(self._watch(name)))

    def _watch(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._outputs[id(output)] = (output, name)

        return hook

    def end(self, num_microbatches: int) -> dict[str, BatchUpdate]:
        """After the step: compute batch values, merge batch states into the saved ones.

        Returns:
            Per updated metric, its :class:`BatchUpdate` (for the other ranks).
        """
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        forwarded = {name for _, name in self._outputs.values()}
        updates = {}
        for name, metric in self.metrics.items():
            saved, count = self._saved.pop(name)
            if update_count(metric) == 0:
                _restore(metric, saved, count)
                continue
            value = batch_compute(metric) if name in forwarded else None
            calls = max(1, update_count(metric) // num_microbatches)
            batch_state = state_copy(metric)
            _merge(metric, saved, count + calls)
            set_forward_cache(metric, value)
            updates[name] = BatchUpdate(tree_map(_to_cpu, batch_state), calls, tree_map(_to_cpu, value))
        return updates

    def mark(self, value: Any) -> Any:
        """A logged value as the marker the other ranks resolve (or the value itself)."""
        if isinstance(value, Metric):
            name = self._names.get(id(value))
            if name is None:
                raise ValueError(
                    f"`self.log(..., <{type(value).__name__}>)`: the metric is not a submodule of the LightningModule; "
                    "assign it as an attribute (`self.acc = Accuracy(...)`) so every pipeline rank has it."
                )
            return MetricObject(name)
        entry = self._outputs.get(id(value))
        if entry is not None and entry[0] is value:
            return MetricValue(entry[1])
        return value

    def forget_outputs(self) -> None:
        """Drop the ``forward`` results kept to recognise logged values."""
        self._outputs = {}

    # --- every rank --------------------------------------------------------------------------------

    def apply(self, updates: dict[str, BatchUpdate], device: torch.device) -> None:
        """Merge the last stage's batch states into this rank's metrics (not on the last stage)."""
        for name, update in updates.items():
            metric = self.metrics[name]
            saved, count = state_copy(metric), update_count(metric)
            for attr, value in update.state.items():
                setattr(metric, attr, tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, value))
            _merge(metric, saved, count + update.updates)
            set_forward_cache(metric, tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, update.value))

    def resolve(self, marker: Any, device: torch.device) -> Any:
        """The value to replay for a marker: the rank's own metric, or its batch value."""
        if isinstance(marker, MetricObject):
            return self._object(marker.name)
        if isinstance(marker, MetricValue):
            return forward_cache(self._object(marker.name))
        return marker

    def _object(self, name: str) -> Metric:
        if name in self.metrics:
            return self.metrics[name]
        raise KeyError(name)


@contextlib.contextmanager
def metrics_inert(module: nn.Module):
    """Make every ``Metric`` of ``module`` do nothing while a step runs for another purpose (the
    first step's observation runs the whole step on placeholder values): ``update`` is skipped,
    ``forward`` returns a zero instead of updating, so no state changes and no metric kernel sees a
    placeholder. Collections are made inert as a whole (their compute groups are decided on their
    first real update, which must not be this one)."""
    metrics = [m for m in module.modules() if isinstance(m, (Metric, MetricCollection))]
    # torchmetrics wraps `update` per instance at construction: put back exactly what was there
    saved = [{k: m.__dict__[k] for k in ("update", "forward") if k in m.__dict__} for m in metrics]
    for metric in metrics:
        metric.update = lambda *args, **kwargs: None
        if isinstance(metric, MetricCollection):
            metric.forward = lambda *args, **kwargs: {}
        else:
            metric.forward = lambda *args, **kwargs: torch.zeros(())
    try:
        yield
    finally:
        for metric, attributes in zip(metrics, saved):
            for key in ("update", "forward"):
                if key in attributes:
                    metric.__dict__[key] = attributes[key]
                else:
                    del metric.__dict__[key]


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _merge(metric: Metric, saved: dict[str, Any], count: int) -> None:
    """Reduce the metric's current (batch) state with ``saved`` (the state before the batch)."""
    set_update_count(metric, count)
    with torch.no_grad():
        reduce_states(metric, saved)
    clear_computed(metric)


def _restore(metric: Metric, saved: dict[str, Any], count: int) -> None:
    for attr, value in saved.items():
        setattr(metric, attr, value)
    set_update_count(metric, count)
