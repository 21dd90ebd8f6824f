"""Weight each microbatch's loss so that the step's gradient is the batch loss's gradient, exactly.

A step returns one loss per microbatch; one device returns one loss for the batch. Backward is
linear, so the batch's gradient is ``sum_i w_i * grad(L_i)`` whenever the batch loss is
``sum_i w_i * L_i``. What ``w_i`` is depends on how the loss is normalised:

* a mean over samples (``F.mse_loss`` of per-sample predictions): ``w_i = b_i / B``;
* a mean over counted targets (``F.cross_entropy`` with padding labelled ``ignore_index``, as
  transformers computes it from ``labels``): ``w_i = n_i / N``, with ``n_i`` the microbatch's
  counted targets and ``N`` the batch's.

``loss_weights="auto"`` (the default) reads the normalisation from the step itself
(``model/loss_counting.py``). ``n_i`` is only known once microbatch ``i``'s forward has run on the
last stage, and ``N`` once all have, but 1F1B-like schedules run backward of the first microbatch
before the forward of the last. So each microbatch's loss is multiplied by its raw weight ``r_i``
(``n_i``, or ``b_i`` for a sample mean) and, after the step, every pipeline rank multiplies the
gradient this step added by ``1 / sum_i r_i`` (:class:`DeferredNormalization`): exact, as the
scaling is linear, and gradients of earlier batches of an accumulation window are kept aside
meanwhile. Each data-parallel replica normalises by its own batch's count, as DDP does.

Where the weights can be computed before the step (``"samples"``, ``"sum"``, a callable of a
microbatch, or optimizer offload, whose stage steps run during backward), they are applied
directly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import Tensor

from lightning_pipe.model.loss_counting import MEAN, SUM, LossRecord
from lightning_pipe.runtime._torch_compat import foreach_mul_

log = logging.getLogger(__name__)

LossWeights = Union[Literal["auto", "samples", "sum"], Callable[[Any], float]]
"""``"auto"``: read the loss's normalisation from the step (counted targets of cross-entropy/NLL
means, samples otherwise); ``"samples"``: weight by samples; ``"sum"``: the batch loss is the sum of
the microbatch losses; a callable ``microbatch -> weight``: the batch loss is the weighted mean
``sum_i w_i L_i / sum_i w_i``."""


def check_loss_weights(loss_weights: Any) -> None:
    """Raise ``ValueError`` for an unknown ``loss_weights`` setting."""
    if not callable(loss_weights) and loss_weights not in ("auto", "samples", "sum"):
        raise ValueError(
            f"`loss_weights={loss_weights!r}`: use 'auto', 'samples', 'sum', or a callable returning a microbatch's "
            "weight (for example `lambda mb: (mb['labels'] != -100).sum()`)."
        )


def upfront_weights(loss_weights: LossWeights, microbatches: Sequence[Any], sizes: Sequence[int]) -> list[float]:
    """Per microbatch, the weight known before the step (``"auto"`` falls back to samples).

    Raises:
        ValueError: a callable returned a negative or non-finite weight, or all weights are zero.
    """
    if loss_weights == "sum":
        return [1.0] * len(sizes)
    if callable(loss_weights):
        raw = [float(loss_weights(mb)) for mb in microbatches]
        if any(not math.isfinite(w) or w < 0 for w in raw) or sum(raw) <= 0:
            raise ValueError(f"`loss_weights` returned {raw} for the microbatches: weights must be finite, >= 0, not all 0.")
    else:
        raw = [float(size) for size in sizes]
    return [w / sum(raw) for w in raw]


def raw_weight(record: LossRecord, size: int) -> Tensor | float:
    """``"auto"``: microbatch ``i``'s raw weight ``r_i``, decided when its loss is known.

    Its counted targets when the returned loss is a (scaled) mean of one loss call, else its samples.
    """
    traced = record.returned
    if traced is not None and traced.kind == MEAN:
        return record.count_of(traced)
    return float(size)


@dataclass
class StepWeights:
    """The weights a step used, decided on the last stage after its forwards.

    Attributes:
        weights: per microbatch, its share of the batch loss (sums to 1, or all 1 for ``"sum"``).
        normalizer: what every pipeline rank divides this step's gradient by (1: applied upfront).
        by_tokens: whether the weights are counted targets.
    """

    weights: list[float]
    normalizer: float
    by_tokens: bool


def decide(records: Sequence[LossRecord], sizes: Sequence[int], raw: Sequence[Any], deferred: bool) -> StepWeights:
    """Check the step's ``"auto"`` weighting and return it (on the last stage, after the step).

    Args:
        records: per microbatch, what its loss was computed from.
        sizes: samples per microbatch.
        raw: the raw weight each microbatch's backward used (``raw_weight``), or the upfront weights.
        deferred: whether gradients are normalised after the step (else the weights were upfront
            sample weights, as with optimizer offload).

    Raises:
        ValueError: the loss is not exact with microbatches under these weights; the message says
            which loss call and counts, and which setting to change.
    """
    kinds = [r.returned.kind if r.returned is not None else None for r in records]
    means = [k == MEAN for k in kinds]
    counts = [float(r.count_of(r.returned)) if m else None for r, m in zip(records, means)]
    if any(means) and not all(means):
        raise ValueError(
            "The step's loss is a mean of a loss function in some microbatches but not in others "
            f"(microbatches {[i for i, m in enumerate(means) if m]} of {len(means)}): lightning-pipe cannot weight them "
            "exactly. Return the same kind of loss for every batch, or pass `loss_weights=`."
        )
    if all(means):
        _check_constant_factor(records)
        by_tokens = True
        if not deferred and not _proportional(counts, sizes):
            raise ValueError(
                f"The step's loss is {records[0].describe(records[0].returned)}, a mean over counted targets, and the "
                f"microbatches hold {[int(c) if c.is_integer() else c for c in counts]} of them for {list(sizes)} "
                "samples: weighting by samples is not exact. With `optimizer_offload=True` the stage optimizers step "
                "during backward, before the counts are known: pass `loss_weights=` (a callable of a microbatch that "
                "returns its counted targets, e.g. `lambda mb: (mb['labels'][:, 1:] != -100).sum()`), or turn "
                "optimizer offload off."
            )
    else:
        by_tokens = False
        for i, record in enumerate(records):
            if kinds[i] == SUM and not _per_sample_sum(record, sizes[i]):
                raise ValueError(
                    f"The step's loss is {record.describe(record.returned)} scaled by "
                    f"{float(record.returned.factor):g}: a sum is only exact with microbatches when divided by the "
                    "batch's samples (weights: samples). Pass `loss_weights='sum'` if the batch loss is the plain sum "
                    "(no division), a callable for another normalisation, or use `reduction='mean'`."
                )
        _check_untraced_calls(records, sizes)
    values = [float(w) for w in raw]
    total = sum(values)
    normalizer = total if deferred else 1.0
    weights = [w / total for w in values] if total > 0 else [0.0 for _ in values]
    return StepWeights(weights, normalizer, by_tokens)


def _check_constant_factor(records: Sequence[LossRecord]) -> None:
    factors = [float(r.returned.factor) for r in records]
    if any(not math.isclose(f, factors[0], rel_tol=1e-12) for f in factors):
        raise ValueError(
            f"The step's loss is {records[0].describe(records[0].returned)} times a factor that differs between "
            f"microbatches ({factors}): a factor that depends on the microbatch cannot be weighted exactly. Multiply "
            "by a constant, or pass `loss_weights=`."
        )


def _proportional(counts: Sequence[float], sizes: Sequence[int]) -> bool:
    ratios = [c / s for c, s in zip(counts, sizes)]
    return all(math.isclose(r, ratios[0], rel_tol=1e-12) for r in ratios)


def _per_sample_sum(record: LossRecord, size: int) -> bool:
    factor = float(record.returned.factor)
    return math.isclose(factor * size, 1.0, rel_tol=1e-12)


def _check_untraced_calls(records: Sequence[LossRecord], sizes: Sequence[int]) -> None:
    """Samples are the weights: refuse if a mean loss call in the step counts targets unevenly."""
    for index in range(len(records[0].calls)):
        calls = [r.calls[index] if index < len(r.calls) else None for r in records]
        if any(c is None or c.function != calls[0].function or c.reduction != MEAN for c in calls):
            continue
        counts = [float(c.count) for c in calls]
        if not _proportional(counts, sizes):
            raise ValueError(
                f"The step calls `{calls[0].function}(reduction='mean')`, which averages over {counts} counted "
                f"targets in microbatches of {list(sizes)} samples, but its loss is not that mean alone (it combines "
                "it with other terms), so lightning-pipe weights microbatches by samples, which is not exact here. "
                "Return the mean alone, pass `loss_weights=` with the weighting you want, or `num_microbatches=1`."
            )


class DeferredNormalization:
    """Divide the gradient one step adds by a number known only after the step, on one rank.

    Gradients already held (earlier batches of an accumulation window) are put aside before the
    step and added back after: ``grad = earlier + this_step / normalizer``.

    ``expected``: the normalizer the step's losses were already divided by (the previous step's: with
    fixed shapes the counted targets do not change), so that what remains is ``expected / normalizer``,
    and nothing when the guess was right. A multiplication of every gradient (about 0.6 ms on the
    benchmark GPT's CPU ranks, at the very end of the step) is saved; the gradient differs from
    dividing once at the end by rounding only.

    Args:
        parameters: the rank's real parameters.
        expected: what the losses of the step were divided by already (1.0: nothing).
    """

    def __init__(self, parameters: Sequence[Tensor], expected: float = 1.0) -> None:
        self.parameters = list(parameters)
        self.expected = expected
        self.earlier: list[Tensor | None] = []

    def begin(self) -> None:
        """Put existing gradients aside (before the step's first backward)."""
        self.earlier = []
        for p in self.parameters:
            self.earlier.append(p.grad)
            p.grad = None

    def end(self, normalizer: float) -> None:
        """``grad = earlier + grad * expected / normalizer`` for every parameter."""
        # no counted target in the whole batch: one device's gradient is zero (torch's NLL backward)
        scale = self.expected / normalizer if normalizer else 0.0
        with torch.no_grad():
            if scale != 1.0:
                grads = [p.grad for p in self.parameters if p.grad is not None]
                dense = [g for g in grads if g.layout == torch.strided]
                if dense:  # one call, not one per parameter: the same products, without 2 us of Python each
                    foreach_mul_(dense, scale)
                for grad in grads:
                    if grad.layout != torch.strided:  # sparse gradients: foreach takes dense ones only
                        grad.mul_(scale)
            for p, earlier in zip(self.parameters, self.earlier, strict=True):
                if p.grad is None:
                    p.grad = earlier
                elif earlier is not None:
                    p.grad = earlier.add_(p.grad)
        self.earlier = []
