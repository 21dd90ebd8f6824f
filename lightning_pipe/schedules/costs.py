"""Per-action costs that the simulator charges: plain numbers, no torch.

Times are seconds, sizes are bytes. Tables are indexed ``[stage][microbatch]`` so that every stage
and every microbatch may cost differently (variable-length batches, unbalanced partitions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Table = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class SplitBackward:
    """What zero-bubble's split backward costs, as shares of the same stage's full backward ``B``.

    ``I`` computes a stage's input gradients and ``W`` its weight gradients. Ideally they split one
    ``B`` (the default, half each: the setting of the zero-bubble paper's formulas). Measured, they
    cost more together (each pass has its own autograd engine calls, and ``I`` keeps the gradients
    ``W`` starts from), and not evenly. The first stage is apart: its inputs (the batch) need no
    gradient, so its ``I`` has nothing to compute and its ``W`` is the whole backward
    (:meth:`measured` says so; the default keeps the halves everywhere).

    Attributes:
        input_share: ``I`` of a stage after the first, in full backwards of that stage.
        weight_share: ``W`` of a stage after the first, likewise.
        first_input_share: ``I`` of the first stage.
        first_weight_share: ``W`` of the first stage.
    """

    input_share: float = 0.5
    weight_share: float = 0.5
    first_input_share: float = 0.5
    first_weight_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("input_share", "weight_share", "first_input_share", "first_weight_share"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"`SplitBackward.{name}` must be finite and >= 0, got {value}.")
        for stage, where in ((1, "a stage"), (0, "the first stage")):
            total = sum(self.shares(stage))
            if total < 1.0 - 1e-9:  # the planners' lower bounds count the work of one B per pair
                raise ValueError(
                    f"`SplitBackward`: I and W of {where} add up to {total:.3g} backwards; a split backward does at "
                    "least the work of one full backward (shares summing to >= 1)."
                )

    @classmethod
    def measured(cls, input_seconds: float, weight_seconds: float, backward_seconds: float) -> SplitBackward:
        """The shares of measured ``I``, ``W`` and ``B`` seconds of stages after the first (summed over
        them), the first stage's being 0 and 1. A measured split that comes out cheaper than ``B`` (timing
        noise) is scaled up to one ``B``, as the linear models assume."""
        total = input_seconds + weight_seconds
        if not (backward_seconds > 0 and total > 0):
            raise ValueError(f"Measured seconds must be > 0: B {backward_seconds}, I + W {total}.")
        scale = max(1.0, backward_seconds / total)
        return cls(scale * input_seconds / backward_seconds, scale * weight_seconds / backward_seconds, 0.0, 1.0)

    def shares(self, stage: int) -> tuple[float, float]:
        """``(I, W)`` of ``stage`` in full backwards of that stage."""
        if stage == 0:
            return self.first_input_share, self.first_weight_share
        return self.input_share, self.weight_share


def _table(value: float, num_stages: int, num_microbatches: int) -> Table:
    return tuple(tuple(float(value) for _ in range(num_microbatches)) for _ in range(num_stages))


@dataclass(frozen=True)
class ActionCosts:
    """What each action of a program costs, for :func:`lightning_pipe.schedules.simulate`.

    Attributes:
        forward: forward time ``[stage][microbatch]`` in seconds.
        backward: full-backward time ``[stage][microbatch]`` in seconds.
        backward_input: input-gradient time (zero-bubble ``I``); None means half of ``backward``.
        backward_weight: weight-gradient time (zero-bubble ``W``); None means half of ``backward``.
        activation_bytes: bytes a stage sends forward (its output) and receives back as gradient,
            ``[stage][microbatch]``.
        saved_bytes: activation bytes a stage keeps from ``F`` until its backward completes,
            ``[stage][microbatch]``.
        static_bytes: parameters, gradients and optimizer state held per stage, ``[stage]``.
        checkpoint_bytes: bytes a pair that is recomputed keeps from its ``F`` until its ``RECOMPUTE``
            (the stashed inputs of recomputation), ``[stage][microbatch]``; None: nothing.
        latency: seconds per point-to-point message.
        bandwidth: bytes per second of a point-to-point link (``inf``: free transfer).
    """

    forward: Table
    backward: Table
    backward_input: Table | None = None
    backward_weight: Table | None = None
    activation_bytes: Table | None = None
    saved_bytes: Table | None = None
    static_bytes: tuple[float, ...] | None = None
    latency: float = 0.0
    bandwidth: float = math.inf
    checkpoint_bytes: Table | None = None

    @property
    def num_stages(self) -> int:
        """Number of stages the tables cover."""
        return len(self.forward)

    @property
    def num_microbatches(self) -> int:
        """Number of microbatches the tables cover."""
        return len(self.forward[0]) if self.forward else 0

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        num_microbatches: int,
        forward: float = 1.0,
        backward: float = 2.0,
        backward_input: float | None = None,
        backward_weight: float | None = None,
        activation_bytes: float = 0.0,
        saved_bytes: float = 1.0,
        static_bytes: float = 0.0,
        latency: float = 0.0,
        bandwidth: float = math.inf,
    ) -> ActionCosts:
        """Same cost for every stage and microbatch: the closed-form setting of the literature."""

        def table(value: float | None) -> Table | None:
            return None if value is None else _table(value, num_stages, num_microbatches)

        return cls(
            forward=_table(forward, num_stages, num_microbatches),
            backward=_table(backward, num_stages, num_microbatches),
            backward_input=table(backward_input),
            backward_weight=table(backward_weight),
            activation_bytes=table(activation_bytes),
            saved_bytes=table(saved_bytes),
            static_bytes=tuple(float(static_bytes) for _ in range(num_stages)),
            latency=latency,
            bandwidth=bandwidth,
        )

    def input_gradient(self, stage: int, microbatch: int) -> float:
        """Seconds of the ``I`` action of ``stage``/``microbatch``."""
        if self.backward_input is not None:
            return self.backward_input[stage][microbatch]
        return self.backward[stage][microbatch] / 2

    def weight_gradient(self, stage: int, microbatch: int) -> float:
        """Seconds of the ``W`` action of ``stage``/``microbatch``."""
        if self.backward_weight is not None:
            return self.backward_weight[stage][microbatch]
        return self.backward[stage][microbatch] / 2

    def transfer(self, stage: int, microbatch: int) -> float:
        """Seconds to move the activation (or its gradient) across a stage boundary."""
        size = 0.0 if self.activation_bytes is None else self.activation_bytes[stage][microbatch]
        return self.latency + (0.0 if math.isinf(self.bandwidth) else size / self.bandwidth)
