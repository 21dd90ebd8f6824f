"""See what the user's step computes its loss from: loss functions, their reduction and their counts.

A microbatch's loss is only a piece of the batch's loss. To combine pieces exactly, the pipeline
must know what each piece averages over: ``F.cross_entropy(..., ignore_index=-100)`` with the default
``reduction="mean"`` divides by the number of *counted* targets of its own microbatch, which differs
between microbatches when sequences are padded. :class:`LossCounter` watches the last stage's step for one
microbatch (as a torch-function mode, or called by the stage runner's placeholder mode for each
operation it sees) and records

* every call of a known loss function (cross-entropy and NLL with their ``ignore_index`` and class
  weights; elementwise losses such as MSE), with the count its reduction divides by (a mean) or sums
  over (a sum);
* which tensors are scalar multiples of such a result (``loss * 0.5``, ``loss.detach()``,
  ``loss_sum / num_items`` where ``num_items`` equals the counted targets), so the step's returned
  loss and logged values can be traced back to one loss call.

It computes nothing the step does not compute, apart from the counts (a comparison and a sum over
the targets), and keeps tensors only until the microbatch's record is taken.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_pipe.model._torch_compat import legacy_reduction

MEAN = "mean"
SUM = "sum"

_INDEXED = {F.cross_entropy: "F.cross_entropy", F.nll_loss: "F.nll_loss"}
_ELEMENTWISE = {
    F.mse_loss: "F.mse_loss",
    F.l1_loss: "F.l1_loss",
    F.smooth_l1_loss: "F.smooth_l1_loss",
    F.huber_loss: "F.huber_loss",
    F.binary_cross_entropy: "F.binary_cross_entropy",
    F.binary_cross_entropy_with_logits: "F.binary_cross_entropy_with_logits",
}
_SIGNATURES = {func: inspect.signature(func) for func in (*_INDEXED, *_ELEMENTWISE)}
_NAMES = {  # functions whose every parameter may be passed by position or by name
    func: list(signature.parameters)
    for func, signature in _SIGNATURES.items()
    if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
}
_SCALE = {torch.Tensor.mul, torch.Tensor.multiply, torch.mul, torch.multiply}
_DIVIDE = {torch.Tensor.div, torch.Tensor.divide, torch.Tensor.true_divide, torch.div, torch.divide, torch.true_divide}
_SAME = {
    torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half,
    torch.Tensor.bfloat16, torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.squeeze, torch.Tensor.reshape,
    torch.Tensor.view,
}


@dataclass(frozen=True)
class LossCall:
    """One call of a known loss function in the step.

    Attributes:
        function: its name (``"F.cross_entropy"``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        count: what its reduction averages (or sums) over: counted targets (weighted by class
            weights when given) for cross-entropy and NLL, elements for elementwise losses. A 0-dim
            tensor on the loss's device (no host synchronization per microbatch).
    """

    function: str
    reduction: str
    count: Tensor


@dataclass
class Traced:
    """A tensor that is ``factor`` times the result of loss call ``call`` (its mean or its sum)."""

    call: int
    kind: str  # MEAN or SUM
    factor: float | Tensor = 1.0


@dataclass
class LossRecord:
    """What one microbatch's step computed its loss from (plain data once taken).

    Attributes:
        calls: the loss calls, in order.
        returned: how the returned loss traces back to a call, or None (untraced, or not a training step).
        logged: per ``self.log`` value that traces back to a call, ``id(value) -> Traced``.
    """

    calls: list[LossCall] = field(default_factory=list)
    returned: Traced | None = None
    logged: dict[int, Traced] = field(default_factory=dict)

    def count_of(self, traced: Traced) -> Tensor:
        """The count the traced value averages over."""
        return self.calls[traced.call].count

    def describe(self, traced: Traced | None) -> str:
        """``F.cross_entropy(reduction='mean')`` (how messages name a traced loss)."""
        if traced is None:
            return "an untraced value"
        call = self.calls[traced.call]
        return f"`{call.function}(reduction={call.reduction!r})`"


class LossCounter(TorchFunctionMode):
    """Records loss calls and scalar multiples of their results while the user's step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[LossCall] = []
        self._traced: dict[int, tuple[Tensor, Traced]] = {}  # id -> (tensor kept alive, how it traces back)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Record one operation of the step and its result (what the mode does per operation; the
        stage runner calls it from its placeholder mode instead, one mode dispatch per operation
        rather than two)."""
        if func in _SIGNATURES:
            self._record_call(func, args, kwargs, out)
        elif self._traced and isinstance(out, Tensor):
            self._propagate(func, args, kwargs, out)

    def trace(self, value: Any) -> Traced | None:
        """How ``value`` traces back to a loss call, or None."""
        if not isinstance(value, Tensor):
            return None
        entry = self._traced.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def record(self, returned: Any, logged: list[Any]) -> LossRecord:
        """The microbatch's record: its calls, its returned loss and its logged values traced."""
        record = LossRecord(list(self.calls), self.trace(returned))
        for value in logged:
            traced = self.trace(value)
            if traced is not None:
                record.logged[id(value)] = traced
        self._traced = {}
        return record

    # --- internals -------------------------------------------------------------------------------

    def _record_call(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        arguments = _arguments(func, args, kwargs)
        reduction = arguments.get("reduction", "mean")
        if arguments.get("size_average") is not None or arguments.get("reduce") is not None:
            reduction = legacy_reduction(arguments.get("size_average"), arguments.get("reduce"))
        with torch.no_grad():
            if func in _INDEXED:
                count = _indexed_count(arguments, func)
            else:
                count = torch.tensor(float(torch.broadcast_shapes(args[0].shape, args[1].shape).numel()))
        call = LossCall(_INDEXED.get(func) or _ELEMENTWISE[func], reduction, count)  # made under no_grad
        self.calls.append(call)
        if isinstance(out, Tensor) and reduction in (MEAN, SUM):
            self._keep(out, Traced(len(self.calls) - 1, reduction))

    def _keep(self, tensor: Tensor, traced: Traced) -> None:
        self._traced[id(tensor)] = (tensor, traced)

    def _propagate(self, func, args: tuple, kwargs: dict, out: Tensor) -> None:
        if not args:
            return
        source = self.trace(args[0])
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if source is None and func in _SCALE and other is not None:
            source, other = self.trace(other), args[0]
        if source is None:
            return
        if func in _SAME:
            self._keep(out, source)
        elif func in _SCALE and _is_scalar(other):
            self._keep(out, Traced(source.call, source.kind, _times(source.factor, other)))
        elif func in _DIVIDE and _is_scalar(other) and not kwargs.get("rounding_mode"):
            count = self.calls[source.call].count
            if source.kind == SUM and _equals(other, count):  # a sum divided by its own counted targets: a mean
                self._keep(out, Traced(source.call, MEAN, source.factor))
            else:
                self._keep(out, Traced(source.call, source.kind, _times(source.factor, _reciprocal(other))))
        elif func is torch.Tensor.neg:
            self._keep(out, Traced(source.call, source.kind, _times(source.factor, -1.0)))


def _arguments(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments a loss function was called with, by name (those given; defaults left out), as
    ``inspect.Signature.bind`` gives them, which costs more than the loss call itself (the function
    has run already, so the call was valid)."""
    names = _NAMES.get(func)
    if names is not None and len(args) <= len(names) and all(name in names[len(args):] for name in kwargs):
        return {**dict(zip(names, args)), **kwargs}
    return _SIGNATURES[func].bind(*args, **kwargs).arguments


def _indexed_count(arguments: dict, func) -> Tensor:
    """Counted targets of cross-entropy / NLL: what ``reduction="mean"`` divides by."""
    inputs, target = arguments["input"], arguments["target"]
    if target.is_floating_point():  # class probabilities: the mean is over positions, not weighted
        classes = inputs.shape[1] if inputs.dim() >= 2 else inputs.shape[0]
        return torch.tensor(float(inputs.numel() // max(classes, 1)), device=inputs.device)
    ignore_index = arguments.get("ignore_index", -100)
    counted = target != ignore_index
    weight = arguments.get("weight")
    if weight is None:
        return counted.sum(dtype=torch.float64)
    return weight[target[counted]].sum(dtype=torch.float64)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    return isinstance(value, Tensor) and value.numel() == 1 and not value.requires_grad


def _times(factor: float | Tensor, value: Any) -> float | Tensor:
    if isinstance(value, Tensor):
        value = value.detach().reshape(()).double()
    return factor * value


def _reciprocal(value: Any) -> float | Tensor:
    return 1.0 / (value.detach().reshape(()).double() if isinstance(value, Tensor) else float(value))


def _equals(value: Any, count: Tensor) -> bool:
    """Whether a divisor equals a count (one host synchronization, only for sums divided by a tensor)."""
    return bool(float(value) == float(count))
