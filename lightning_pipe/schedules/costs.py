"""Per-action costs that the simulator charges: plain numbers, no torch.

Times are seconds, sizes are bytes. Tables are indexed ``[stage][microbatch]`` so that every stage
and every microbatch may cost differently (variable-length batches, unbalanced partitions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Table = tuple[tuple[float, ...], ...]


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
