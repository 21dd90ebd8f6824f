"""Per-unit cost model: what a microbatch costs in every unit, and what a partition costs per stage.

The model is deliberately small: every unit (``pre``, each block, ``post``) has forward and backward
times that are *linear* in two features of a microbatch, its token count and the sum of its squared
sequence lengths. The second feature makes attention's quadratic part visible, so a batch of one
64k-token sequence and a batch of sixty-four 1k-token sequences (same tokens) cost differently.

A :class:`CostModel` turns a partition (stage boundaries over *blocks*, ``pre`` on the first stage and
``post`` on the last) and a list of microbatch shapes into the stage-level
:class:`~lightning_pipe.schedules.costs.ActionCosts` that :func:`lightning_pipe.schedules.simulate`
charges. It is plain data and round-trips through JSON (the profile format a profiler writes).

Units: seconds for times, bytes for sizes, bytes per second for bandwidth.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from lightning_pipe.planning.boundaries import check_boundaries, unit_ranges
from lightning_pipe.schedules.costs import ActionCosts, SplitBackward

PROFILE_FORMAT = "lightning_pipe.cost_model"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class MicrobatchShape:
    """The features of one microbatch that the cost model prices.

    Attributes:
        num_sequences: sequences (samples) in the microbatch.
        tokens: real tokens in the microbatch (sum of the sequence lengths; padding excluded).
        sum_squared_lengths: sum over sequences of ``length ** 2``; attention work and, without
            flash attention, attention memory grow with it.
    """

    num_sequences: int
    tokens: int
    sum_squared_lengths: float

    def __post_init__(self) -> None:
        for name in ("num_sequences", "tokens", "sum_squared_lengths"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"`MicrobatchShape.{name}` must be >= 0, got {value}.")

    @classmethod
    def from_lengths(cls, lengths: Iterable[int]) -> MicrobatchShape:
        """Shape of a microbatch made of sequences of the given lengths (tokens each).

        Args:
            lengths: one positive length per sequence.

        Raises:
            ValueError: if ``lengths`` is empty or holds a length below 1.
        """
        values = [int(length) for length in lengths]
        if not values:
            raise ValueError("`lengths` is empty: a microbatch needs at least one sequence.")
        if min(values) < 1:
            raise ValueError(f"`lengths` must all be >= 1, got minimum {min(values)}.")
        return cls(len(values), sum(values), float(sum(v * v for v in values)))


@dataclass(frozen=True)
class LinearCost:
    """``constant + per_token * tokens + per_squared_length * sum_squared_lengths``.

    Used for seconds (forward, backward) and for bytes (activations kept for backward).

    Attributes:
        constant: cost of any microbatch, however small (kernel launches, fixed buffers).
        per_token: cost per real token.
        per_squared_length: cost per unit of ``sum_squared_lengths`` (attention's quadratic part).
    """

    constant: float = 0.0
    per_token: float = 0.0
    per_squared_length: float = 0.0

    def __post_init__(self) -> None:
        for name in ("constant", "per_token", "per_squared_length"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"`LinearCost.{name}` must be finite and >= 0, got {value}.")

    def evaluate(self, shape: MicrobatchShape) -> float:
        """Cost of one microbatch of ``shape``."""
        return self.constant + self.per_token * shape.tokens + self.per_squared_length * shape.sum_squared_lengths

    def as_array(self) -> np.ndarray:
        """The three coefficients ``[constant, per_token, per_squared_length]``."""
        return np.array([self.constant, self.per_token, self.per_squared_length], dtype=float)


@dataclass(frozen=True)
class UnitCost:
    """What one unit (``pre``, a block, or ``post``) costs.

    Attributes:
        name: display name (``"pre"``, ``"block.3"``, ``"post"``).
        forward: forward seconds of one microbatch.
        backward: full backward seconds (input and weight gradients) of one microbatch.
        saved_bytes: activation bytes the unit keeps from its forward until its backward.
        output_bytes_per_token: bytes of the unit's output per token; this crosses a stage boundary
            when the unit is the last of a stage (and comes back as a gradient of the same size).
        parameter_bytes: bytes of the unit's parameters.
        gradient_bytes: bytes of the unit's parameter gradients.
        optimizer_bytes: bytes of the unit's optimizer state (for example fp32 master weights and
            Adam moments).
    """

    name: str
    forward: LinearCost
    backward: LinearCost
    saved_bytes: LinearCost = field(default_factory=LinearCost)
    output_bytes_per_token: float = 0.0
    parameter_bytes: float = 0.0
    gradient_bytes: float = 0.0
    optimizer_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("output_bytes_per_token", "parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"`UnitCost.{name}` of unit {self.name!r} must be finite and >= 0, got {value}.")

    @property
    def static_bytes(self) -> float:
        """Parameters, gradients and optimizer state: held for the whole step, whatever the batch."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class UnitTables:
    """Every unit's costs for every microbatch of one batch, as arrays ``[unit, microbatch]``.

    Built by :meth:`CostModel.tables`; the planner sums rows of these arrays to price stages.

    Attributes:
        forward: forward seconds ``[unit, microbatch]``.
        backward: backward seconds ``[unit, microbatch]``.
        saved_bytes: bytes kept for backward ``[unit, microbatch]``.
        output_bytes: bytes of the unit's output ``[unit, microbatch]``.
        static_bytes: parameter, gradient and optimizer bytes ``[unit]``.
    """

    forward: np.ndarray
    backward: np.ndarray
    saved_bytes: np.ndarray
    output_bytes: np.ndarray
    static_bytes: np.ndarray


@dataclass(frozen=True)
class CostModel:
    """Per-unit costs of a model plus the point-to-point link between stages.

    ``units[0]`` is ``pre``, ``units[-1]`` is ``post`` and the units between are the blocks. A
    partition is given as boundaries over *blocks* (``[0, 7, 13, 18, 24]`` for 24 blocks on 4
    stages); ``pre`` always runs on the first stage and ``post`` on the last.

    Attributes:
        units: ``[pre, block_0, ..., block_{n-1}, post]``.
        latency: seconds per point-to-point message.
        bandwidth: bytes per second of a point-to-point link (``inf``: free transfer).
        split_backward: what zero-bubble's ``I`` and ``W`` cost as shares of a stage's backward (measured
            by the strategy, ``StrategyCosts.measure_split_backward``); None: half each.
    """

    units: tuple[UnitCost, ...]
    latency: float = 0.0
    bandwidth: float = math.inf
    split_backward: SplitBackward | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        if len(self.units) < 3:
            raise ValueError(
                f"`units` must hold pre, at least one block and post (3 or more units), got {len(self.units)}."
            )
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"`latency` must be finite and >= 0 seconds, got {self.latency}.")
        if not self.bandwidth > 0:
            raise ValueError(f"`bandwidth` must be > 0 bytes per second, got {self.bandwidth}.")

    @property
    def num_blocks(self) -> int:
        """Number of blocks (units other than ``pre`` and ``post``)."""
        return len(self.units) - 2

    def tables(self, microbatches: Sequence[MicrobatchShape]) -> UnitTables:
        """Every unit's costs for every microbatch, as :class:`UnitTables`.

        Args:
            microbatches: shapes of the microbatches of one batch.

        Raises:
            ValueError: if ``microbatches`` is empty.
        """
        if len(microbatches) == 0:
            raise ValueError("`microbatches` is empty: a step needs at least one microbatch.")
        features = np.array(
            [[1.0, mb.tokens, mb.sum_squared_lengths] for mb in microbatches], dtype=float
        ).T  # [3, microbatch]

        def linear(attribute: str) -> np.ndarray:
            coefficients = np.stack([getattr(unit, attribute).as_array() for unit in self.units])  # [unit, 3]
            return coefficients @ features

        output_per_token = np.array([unit.output_bytes_per_token for unit in self.units])
        return UnitTables(
            forward=linear("forward"),
            backward=linear("backward"),
            saved_bytes=linear("saved_bytes"),
            output_bytes=np.outer(output_per_token, features[1]),
            static_bytes=np.array([unit.static_bytes for unit in self.units]),
        )

    def stage_costs(self, boundaries: Sequence[int], microbatches: Sequence[MicrobatchShape]) -> ActionCosts:
        """Stage-level costs of a partition for one batch, for :func:`lightning_pipe.schedules.simulate`.

        Args:
            boundaries: stage boundaries over blocks, ``0 = b_0 < b_1 < ... < b_S = num_blocks``.
            microbatches: shapes of the batch's microbatches.

        Returns:
            ActionCosts with ``forward``/``backward``/``saved_bytes`` summed over each stage's units,
            ``activation_bytes`` the output of each stage's last unit (0 for the last stage, which
            sends nothing), ``static_bytes`` per stage, and this model's latency and bandwidth.
            ``backward_input``/``backward_weight`` are the backward's shares of ``split_backward``,
            or left to the simulator's default (half each) without one.

        Raises:
            ValueError: if ``boundaries`` is not a valid partition of the blocks.
        """
        bounds = check_boundaries(boundaries, self.num_blocks)
        tables = self.tables(microbatches)
        ranges = unit_ranges(bounds, self.num_blocks)
        last = len(ranges) - 1

        def summed(table: np.ndarray) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(table[start:stop].sum(axis=0).tolist()) for start, stop in ranges)

        sent = tuple(
            tuple(tables.output_bytes[stop - 1].tolist()) if s < last else tuple(0.0 for _ in microbatches)
            for s, (_, stop) in enumerate(ranges)
        )
        backward = summed(tables.backward)
        split = self.split_backward

        def share(which: int) -> tuple[tuple[float, ...], ...] | None:
            if split is None:
                return None
            return tuple(tuple(split.shares(s)[which] * b for b in row) for s, row in enumerate(backward))

        return ActionCosts(
            forward=summed(tables.forward),
            backward=backward,
            backward_input=share(0),
            backward_weight=share(1),
            activation_bytes=sent,
            saved_bytes=summed(tables.saved_bytes),
            static_bytes=tuple(float(tables.static_bytes[start:stop].sum()) for start, stop in ranges),
            latency=self.latency,
            bandwidth=self.bandwidth,
        )

    def stage_static_bytes(self, boundaries: Sequence[int]) -> tuple[float, ...]:
        """Parameter, gradient and optimizer bytes of every stage of a partition.

        Raises:
            ValueError: if ``boundaries`` is not a valid partition of the blocks.
        """
        bounds = check_boundaries(boundaries, self.num_blocks)
        return tuple(
            float(sum(unit.static_bytes for unit in self.units[start:stop]))
            for start, stop in unit_ranges(bounds, self.num_blocks)
        )

    def with_full_recompute(self) -> CostModel:
        """The same model with every block fully recomputed: a block keeps only its input (its
        predecessor's output bytes per token) and its backward runs its forward again first.

        For measured models (a GPU profile), where the analytic ``full_recompute`` option of
        :func:`~lightning_pipe.planning.gpt.gpt_cost_model` does not apply.
        """
        units = list(self.units)
        for i in range(1, len(units) - 1):
            unit = units[i]
            backward = LinearCost(*(float(x) for x in unit.backward.as_array() + unit.forward.as_array()))
            kept = LinearCost(0.0, units[i - 1].output_bytes_per_token, 0.0)
            units[i] = replace(unit, backward=backward, saved_bytes=kept)
        return replace(self, units=tuple(units))

    def to_dict(self) -> dict:
        """JSON-ready dictionary (the profile format); ``bandwidth`` ``inf`` is written as ``null``."""
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "latency": self.latency,
            "bandwidth": None if math.isinf(self.bandwidth) else self.bandwidth,
            "units": [asdict(unit) for unit in self.units],
            "split_backward": None if self.split_backward is None else asdict(self.split_backward),
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: if ``data`` is not a cost-model profile of a known version.
        """
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(
                f"Not a cost-model profile: `format` is {data.get('format')!r}, expected {PROFILE_FORMAT!r}."
            )
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"Unsupported cost-model profile `version` {data.get('version')!r}; this code reads {PROFILE_VERSION}."
            )
        try:
            units = [
                UnitCost(
                    name=str(unit["name"]),
                    forward=LinearCost(**unit["forward"]),
                    backward=LinearCost(**unit["backward"]),
                    saved_bytes=LinearCost(**unit["saved_bytes"]),
                    output_bytes_per_token=float(unit["output_bytes_per_token"]),
                    parameter_bytes=float(unit["parameter_bytes"]),
                    gradient_bytes=float(unit["gradient_bytes"]),
                    optimizer_bytes=float(unit["optimizer_bytes"]),
                )
                for unit in data["units"]
            ]
        except (KeyError, TypeError) as error:
            raise ValueError(f"Malformed cost-model profile: missing or wrong field ({error!r}).") from error
        bandwidth = data.get("bandwidth")
        return cls(
            units=tuple(units),
            latency=float(data.get("latency", 0.0)),
            bandwidth=math.inf if bandwidth is None else float(bandwidth),
            split_backward=None if data.get("split_backward") is None else SplitBackward(**data["split_backward"]),
        )

    def save(self, path: str | Path) -> None:
        """Write the model as a JSON profile to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a JSON profile written by :meth:`save` (or by the profiler callback).

        Raises:
            ValueError: if the file is not valid JSON or not a cost-model profile.
        """
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"Cost-model profile {str(path)!r} is not valid JSON: {error}.") from error
        return cls.from_dict(data)
