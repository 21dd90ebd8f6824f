"""Memory plans and the memory model: what a plan keeps alive on every rank, as plain numbers.

A :class:`MemoryPlan` says, per (stage, microbatch), how each of the stage's blocks treats the
activations it saves for backward: keep them (``"none"``), keep only the block input and recompute
the rest in backward (``"full"``), keep the input and the attention outputs and recompute the rest
(``"keep_attention"``, HelixPipe's recomputation without attention), or move them to host memory
until backward (``"offload"``). A :class:`MemoryProfile` holds what each unit saves per microbatch
in each mode (bytes, linear in tokens and squared lengths, measured on probe microbatches by
``profiling.memory_profile``). :func:`predict_memory` walks a program's actions with those numbers and
returns every rank's peak (static bytes plus saved activations alive, plus a one-block transient
while a recomputed or reloaded block is rebuilt in backward).

Pure Python and numpy: no torch. Sizes are bytes, times are seconds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_pipe.planning.cost_model import LinearCost, MicrobatchShape
from lightning_pipe.schedules.action_rules import ACTION_RULES
from lightning_pipe.schedules.split_schedules import refuse_split_placement
from lightning_pipe.schedules.ir import Program

if TYPE_CHECKING:
    from lightning_pipe.planning.chunk_memory import ChunkMemory

NONE, FULL, KEEP_ATTENTION, OFFLOAD = "none", "full", "keep_attention", "offload"
BLOCK_MODES = (NONE, FULL, KEEP_ATTENTION, OFFLOAD)
RECOMPUTE_MODES = (NONE, FULL, KEEP_ATTENTION)

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(value: str | int | float) -> int:
    """Bytes from a size such as ``"40GiB"``, ``"1.5 GB"``, ``"512MiB"`` or a plain number of bytes.

    Raises:
        ValueError: for an unknown unit, a malformed text or a negative size.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = float(value)
    else:
        match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"Cannot read the size {value!r}: use a number of bytes or a number with a unit among "
                f"{', '.join(u for u in ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB', 'TB'))} (e.g. '40GiB')."
            )
        size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not (size >= 0 and math.isfinite(size)):
        raise ValueError(f"A size must be finite and not negative, got {value!r}.")
    return int(size)


def format_size(num_bytes: float) -> str:
    """``num_bytes`` as a short text in binary units (``"37.5 GiB"``)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"


# --- plans ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    """How one stage treats its blocks' saved activations for one microbatch.

    Blocks are taken in order of their position ``p`` in the stage (``0 .. num_blocks - 1``). Only
    positions with ``p % every == 0`` may be recomputed: the first ``full`` of them are recomputed
    completely, the next ``keep_attention`` of them keep the attention outputs; then the first
    ``offload`` of the remaining positions offload their saved activations. ``None`` means "as many
    as possible". Counts above what the stage has are clipped, so one value fits any partition.

    Attributes:
        full: blocks under full recomputation.
        keep_attention: blocks recomputed except attention (attention outputs kept).
        offload: blocks whose saved activations go to host memory until backward.
        every: recompute only every ``every``-th block (1: any block).
        mlp_chunk_size: run the blocks' position-wise MLPs in sequence chunks of this many positions
            (None: in one piece).
    """

    full: int | None = 0
    keep_attention: int | None = 0
    offload: int | None = 0
    every: int = 1
    mlp_chunk_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("full", "keep_attention", "offload"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"`StageMemory.{name}` must be None or an integer >= 0, got {value!r}.")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"`StageMemory.every` must be an integer >= 1, got {self.every!r}.")
        if self.mlp_chunk_size is not None and self.mlp_chunk_size < 1:
            raise ValueError(f"`StageMemory.mlp_chunk_size` must be None or >= 1, got {self.mlp_chunk_size}.")

    def block_modes(self, num_blocks: int) -> tuple[str, ...]:
        """The mode of every block of a stage of ``num_blocks`` blocks, by position."""
        modes = [NONE] * num_blocks
        eligible = [p for p in range(num_blocks) if p % self.every == 0]
        for mode, count in ((FULL, self.full), (KEEP_ATTENTION, self.keep_attention)):
            free = [p for p in eligible if modes[p] == NONE]
            for p in free[: len(free) if count is None else count]:
                modes[p] = mode
        free = [p for p in range(num_blocks) if modes[p] == NONE]
        for p in free[: len(free) if self.offload is None else self.offload]:
            modes[p] = OFFLOAD
        return tuple(modes)

    @property
    def is_default(self) -> bool:
        """True when the stage keeps everything (no recompute, offload or chunking)."""
        return self == StageMemory()


def _key(stage: int, microbatch: int | None) -> str:
    return str(stage) if microbatch is None else f"{stage},{microbatch}"


@dataclass(frozen=True)
class MemoryPlan:
    """Recompute / offload choices per stage and microbatch: the ``memory`` part of a pipeline plan.

    Lookup order for (stage, microbatch): ``microbatches[(stage, microbatch)]``, then
    ``stages[stage]``, then ``default``.

    Attributes:
        default: what every stage does unless told otherwise.
        stages: per stage.
        microbatches: per (stage, microbatch).
    """

    default: StageMemory = field(default_factory=StageMemory)
    stages: Mapping[int, StageMemory] = field(default_factory=dict)
    microbatches: Mapping[tuple[int, int], StageMemory] = field(default_factory=dict)

    def choice(self, stage: int, microbatch: int) -> StageMemory:
        """What ``stage`` does for ``microbatch``."""
        found = self.microbatches.get((stage, microbatch))
        if found is None:
            found = self.stages.get(stage, self.default)
        return found

    @property
    def is_empty(self) -> bool:
        """True when the plan keeps every activation (the behaviour without a memory plan)."""
        return (
            self.default.is_default
            and all(c.is_default for c in self.stages.values())
            and all(c.is_default for c in self.microbatches.values())
        )

    def uses(self, mode: str) -> bool:
        """Whether any choice of the plan may put a block in ``mode``."""
        attribute = {FULL: "full", KEEP_ATTENTION: "keep_attention", OFFLOAD: "offload"}[mode]
        choices = [self.default, *self.stages.values(), *self.microbatches.values()]
        return any(getattr(c, attribute) is None or getattr(c, attribute) > 0 for c in choices)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what :attr:`PipelinePlan.memory` holds)."""
        return {
            "default": asdict(self.default),
            "stages": {_key(s, None): asdict(c) for s, c in sorted(self.stages.items())},
            "microbatches": {_key(s, m): asdict(c) for (s, m), c in sorted(self.microbatches.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MemoryPlan:
        """Inverse of :meth:`to_dict`; an empty or missing mapping is the empty plan.

        Raises:
            ValueError: for unknown keys or malformed entries.
        """
        if not data:
            return cls()
        unknown = set(data) - {"default", "stages", "microbatches"}
        if unknown:
            raise ValueError(f"Unknown memory plan keys {sorted(unknown)}; expected 'default', 'stages', 'microbatches'.")
        try:
            default = StageMemory(**data.get("default", {}))
            stages = {int(k): StageMemory(**v) for k, v in data.get("stages", {}).items()}
            microbatches = {}
            for k, v in data.get("microbatches", {}).items():
                stage, microbatch = (int(x) for x in k.split(","))
                microbatches[(stage, microbatch)] = StageMemory(**v)
        except (TypeError, ValueError) as error:
            raise ValueError(f"Malformed memory plan: {error}") from error
        return cls(default, stages, microbatches)

    @classmethod
    def from_options(
        cls, recompute: str | int | StageMemory | None = None, offload: bool | int = False,
        mlp_chunk_size: int | None = None,
    ) -> MemoryPlan:
        """A static plan, the same for every stage and microbatch, from the strategy's arguments.

        Args:
            recompute: ``"none"``, ``"full"``, ``"keep_attention"``, an integer ``k`` (full
                recomputation of every ``k``-th block), or a :class:`StageMemory`.
            offload: True (offload every block that is not recomputed), False, or a number of blocks
                per stage.
            mlp_chunk_size: sequence chunk size for position-wise MLPs, or None.

        Raises:
            ValueError: for an unknown mode.
        """
        if isinstance(recompute, StageMemory):
            return cls(recompute)
        offload_count: int | None = None if offload is True else int(offload)
        if recompute in (None, NONE):
            choice = StageMemory(offload=offload_count, mlp_chunk_size=mlp_chunk_size)
        elif recompute == FULL:
            choice = StageMemory(full=None, offload=offload_count, mlp_chunk_size=mlp_chunk_size)
        elif recompute == KEEP_ATTENTION:
            choice = StageMemory(keep_attention=None, offload=offload_count, mlp_chunk_size=mlp_chunk_size)
        elif isinstance(recompute, int) and not isinstance(recompute, bool) and recompute >= 1:
            choice = StageMemory(full=None, every=recompute, offload=offload_count, mlp_chunk_size=mlp_chunk_size)
        else:
            raise ValueError(
                f"`recompute={recompute!r}`: use 'none', 'full', 'keep_attention', 'auto' (with `memory_budget`), "
                "an integer k >= 1 (recompute every k-th block) or a StageMemory."
            )
        return cls(choice)


# --- what units save ----------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitMemory:
    """Bytes one unit (``pre``, a block, ``post``) keeps for backward, per microbatch, by mode.

    Attributes:
        name: ``"pre"``, ``"block.3"``, ``"post"``.
        saved: bytes kept from forward to backward, per mode (``"none"``, and for blocks
            ``"full"``, ``"keep_attention"``); an offloaded block keeps no device bytes.
        parameter_bytes: bytes of the unit's parameters.
        parameters: number of parameters (for the flop estimate of :meth:`MemoryProfile.forward_seconds`).
        hidden: width of the unit's output (features per position); 0 if unknown.
    """

    name: str
    saved: Mapping[str, LinearCost]
    parameter_bytes: float = 0.0
    parameters: float = 0.0
    hidden: int = 0

    def saved_bytes(self, mode: str, shape: MicrobatchShape) -> float:
        """Device bytes kept for backward by one microbatch in ``mode``."""
        if mode == OFFLOAD:
            return 0.0
        cost = self.saved.get(mode)
        if cost is None:
            cost = self.saved[NONE]
        return cost.evaluate(shape)


@dataclass(frozen=True)
class MemoryProfile:
    """Saved-activation bytes of every unit, plus what static state costs per parameter byte.

    Attributes:
        units: ``[pre, block_0, ..., block_{n-1}, post]``.
        static_bytes_per_parameter_byte: parameters, gradients and optimizer state per parameter
            byte (4 for Adam without a master copy: weight, gradient, two moments).
        length_offset: how many positions per sample the batch has beyond what the blocks process
            (1 when ids ``[B, T + 1]`` feed ``T`` positions); :meth:`shape` removes it.
    """

    units: tuple[UnitMemory, ...]
    static_bytes_per_parameter_byte: float = 4.0
    length_offset: int = 0

    def shape(self, lengths: Sequence[int]) -> MicrobatchShape:
        """The shape the units see for samples of the batch's ``lengths`` (minus ``length_offset``)."""
        return MicrobatchShape.from_lengths([max(1, int(n) - self.length_offset) for n in lengths])

    @property
    def num_blocks(self) -> int:
        """Blocks covered by the profile."""
        return len(self.units) - 2

    def stage_units(self, boundaries: Sequence[int], stage: int) -> tuple[UnitMemory | None, list[UnitMemory], UnitMemory | None]:
        """``(pre or None, blocks, post or None)`` of a stage."""
        first, end = boundaries[stage], boundaries[stage + 1]
        pre = self.units[0] if stage == 0 else None
        post = self.units[-1] if stage == len(boundaries) - 2 else None
        return pre, list(self.units[1 + first : 1 + end]), post

    def static_bytes(self, boundaries: Sequence[int]) -> list[float]:
        """Parameter, gradient and optimizer bytes of every stage."""
        result = []
        for stage in range(len(boundaries) - 1):
            pre, blocks, post = self.stage_units(boundaries, stage)
            units = [u for u in (pre, *blocks, post) if u is not None]
            result.append(sum(u.parameter_bytes for u in units) * self.static_bytes_per_parameter_byte)
        return result

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "static_bytes_per_parameter_byte": self.static_bytes_per_parameter_byte,
            "length_offset": self.length_offset,
            "units": [
                {**asdict(u), "saved": {m: asdict(c) for m, c in u.saved.items()}} for u in self.units
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryProfile:
        """Inverse of :meth:`to_dict`."""
        units = tuple(
            UnitMemory(
                name=u["name"], saved={m: LinearCost(**c) for m, c in u["saved"].items()},
                parameter_bytes=float(u["parameter_bytes"]), parameters=float(u["parameters"]), hidden=int(u["hidden"]),
            )
            for u in data["units"]
        )
        return cls(units, float(data["static_bytes_per_parameter_byte"]), int(data.get("length_offset", 0)))


# --- what a plan keeps alive ---------------------------------------------------------------------


@dataclass(frozen=True)
class StageFootprint:
    """Device bytes of one (stage, microbatch) under a plan.

    Attributes:
        saved: bytes kept from ``F`` until the backward ends (offloaded blocks excluded).
        offloaded: bytes held in host memory meanwhile.
        forward_transient: extra bytes at the end of ``F`` (one offloaded block still being copied out).
        backward_transient: extra bytes during backward (one recomputed block rebuilt, or one
            offloaded block reloaded).
    """

    saved: float
    offloaded: float = 0.0
    forward_transient: float = 0.0
    backward_transient: float = 0.0


def stage_footprints(
    profile: MemoryProfile,
    boundaries: Sequence[int],
    shapes: Sequence[MicrobatchShape],
    plan: MemoryPlan,
    chunks: ChunkMemory | None = None,
) -> list[list[StageFootprint]]:
    """Bytes of every (stage, microbatch) under ``plan``, ``[stage][microbatch]``.

    ``chunks``: what packed and sliced microbatches keep per block beyond the profile
    (``planning/chunk_memory.py``): attention bytes unless the block is recomputed in full or
    offloaded, kept bytes (the key/value store) whatever the mode.
    """
    table = []
    for stage in range(len(boundaries) - 1):
        pre, blocks, post = profile.stage_units(boundaries, stage)
        row = []
        for mb, shape in enumerate(shapes):
            modes = plan.choice(stage, mb).block_modes(len(blocks))
            attention = chunks.attention[mb] if chunks is not None else 0.0
            kept = chunks.kept[mb] if chunks is not None else 0.0
            saved = sum(u.saved_bytes(NONE, shape) for u in (pre, post) if u is not None)
            offloaded = forward_transient = backward_transient = 0.0
            for unit, mode in zip(blocks, modes):
                whole = unit.saved_bytes(NONE, shape) + attention
                own = unit.saved_bytes(mode, shape) + (attention if mode in (NONE, KEEP_ATTENTION) else 0.0)
                saved += own + kept
                if mode == OFFLOAD:
                    offloaded += whole
                    forward_transient = max(forward_transient, whole)
                    backward_transient = max(backward_transient, whole)
                elif mode != NONE:
                    backward_transient = max(backward_transient, whole - own)
            row.append(StageFootprint(saved, offloaded, forward_transient, backward_transient))
        table.append(row)
    return table


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted memory of every pipeline rank for one step.

    Attributes:
        static_bytes: per rank, parameters, gradients and optimizer state.
        saved_peak_bytes: per rank, the peak of saved activations alive on the device (what
            saved-tensor hooks count in a real run).
        peak_bytes: per rank, the peak of static + saved + transient bytes.
        host_peak_bytes: per rank, the peak of offloaded bytes in host memory.
        peak_action: per rank, index into the rank's actions where ``peak_bytes`` is reached.
    """

    static_bytes: tuple[float, ...]
    saved_peak_bytes: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    host_peak_bytes: tuple[float, ...]
    peak_action: tuple[int, ...]

    def fits(self, budget: float) -> bool:
        """Whether every rank's peak is within ``budget`` bytes."""
        return all(p <= budget for p in self.peak_bytes)


def walk_memory(program: Program, rank: int, footprints: Sequence[Sequence[StageFootprint]], static: float):
    """Device bytes of ``rank`` after each of its actions: yields ``(index, saved, total, host)``.

    ``saved`` is the sum of saved bytes alive, ``total`` adds static bytes and the action's
    transient, ``host`` the offloaded bytes held. A pair is alive from its ``F`` through its ``B``
    (through ``W`` with split backward).
    """
    alive: dict[tuple[int, int], StageFootprint] = {}
    saved = host = 0.0
    for index, action in enumerate(program.actions[rank]):
        if action.microbatch is None:
            continue
        key, rule = (action.stage, action.microbatch), ACTION_RULES[action.type]
        transient = 0.0
        if rule.starts_pair:
            fp = footprints[action.stage][action.microbatch]
            if key not in alive:
                alive[key] = fp
                saved += fp.saved
                host += fp.offloaded
            transient = fp.forward_transient
        elif rule.uses_saved and key in alive:
            transient = alive[key].backward_transient
        yield index, saved, static + saved + transient, host
        if rule.frees and key in alive:
            fp = alive.pop(key)
            saved -= fp.saved
            host -= fp.offloaded


def predict_memory(
    program: Program,
    boundaries: Sequence[int],
    shapes: Sequence[MicrobatchShape],
    plan: MemoryPlan,
    profile: MemoryProfile,
    static_bytes: Sequence[float] | None = None,
    chunks: ChunkMemory | None = None,
) -> MemoryPrediction:
    """Peak memory of every rank running ``program`` on microbatches of ``shapes`` under ``plan``.

    Args:
        program: training program (forward and backward actions).
        boundaries: stage boundaries over blocks, ``len == program.num_stages + 1``.
        shapes: one shape per microbatch.
        plan: recompute/offload choices.
        profile: saved bytes per unit and mode.
        static_bytes: per stage; default ``profile.static_bytes(boundaries)``.
        chunks: what packed and sliced microbatches keep beyond the profile (``planning/chunk_memory.py``).

    Returns:
        Per rank: static bytes, saved-activation peak, total peak, host peak, where the peak is.

    Raises:
        ValueError: if the sizes disagree.
    """
    refuse_split_placement(program, "the memory model")
    if len(boundaries) != program.num_stages + 1:
        raise ValueError(f"{len(boundaries)} boundaries for {program.num_stages} stages; expected {program.num_stages + 1}.")
    if len(shapes) != program.num_microbatches:
        raise ValueError(f"{len(shapes)} microbatch shapes for a program of {program.num_microbatches} microbatches.")
    if boundaries[-1] != profile.num_blocks:
        raise ValueError(f"boundaries end at block {boundaries[-1]} but the profile has {profile.num_blocks} blocks.")
    if chunks is not None and chunks.num_microbatches != len(shapes):
        raise ValueError(f"`chunks` describes {chunks.num_microbatches} microbatches, `shapes` {len(shapes)}.")
    stage_static = list(static_bytes) if static_bytes is not None else profile.static_bytes(boundaries)
    footprints = stage_footprints(profile, boundaries, shapes, plan, chunks)
    statics, saved_peaks, peaks, hosts, where = [], [], [], [], []
    for rank in range(program.num_ranks):
        static = sum(stage_static[s] for s in program.stages_of(rank))
        saved_peak = host_peak = 0.0
        peak, at = static, -1
        for index, saved, total, host in walk_memory(program, rank, footprints, static):
            saved_peak = max(saved_peak, saved)
            host_peak = max(host_peak, host)
            if total > peak:
                peak, at = total, index
        statics.append(static)
        saved_peaks.append(saved_peak)
        peaks.append(peak)
        hosts.append(host_peak)
        where.append(at)
    return MemoryPrediction(tuple(statics), tuple(saved_peaks), tuple(peaks), tuple(hosts), tuple(where))


def fit_linear(points: Sequence[tuple[MicrobatchShape, float]]) -> LinearCost:
    """Least-squares :class:`LinearCost` through measured ``(shape, bytes)`` points, coefficients >= 0.

    With points of one sequence length only the token term is fitted (plus a constant when token
    counts differ); the squared-length term needs at least two lengths.
    """
    import numpy as np
    from scipy.optimize import nnls

    if not points:
        raise ValueError("No measured points to fit.")
    rows = np.array([[1.0, p.tokens, p.sum_squared_lengths] for p, _ in points], dtype=float)
    values = np.array([v for _, v in points], dtype=float)
    columns = [1]
    if len({tuple(r[1:]) for r in rows}) > 1:
        columns = [0, 1]
    ratios = {r[2] / max(r[1], 1.0) for r in rows}
    if len(ratios) > 1 and len({tuple(r) for r in rows}) >= 3:
        columns = [0, 1, 2]
    scale = np.maximum(np.abs(rows[:, columns]).max(axis=0), 1.0)
    solution, _ = nnls(rows[:, columns] / scale, values)
    coefficients = [0.0, 0.0, 0.0]
    for c, value in zip(columns, solution / scale):
        coefficients[c] = float(value)
    return LinearCost(*coefficients)
