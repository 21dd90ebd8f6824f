"""Schedule registry: family names -> generator functions, and the :class:`Schedule` handle.

A *family* is a pure function ``(num_ranks, num_microbatches, **options) -> Program``. Families
register themselves by name (``families/``); users may register their own. :class:`Schedule` is what
the strategy holds: it knows how many stages per rank the model must be cut into
(``num_stages = num_ranks * stages_per_rank``) before any program is built, and builds the program
for a given pipeline size and microbatch count. What a user writes (a name, a DSL spec, a dict)
becomes a :class:`Schedule` in :mod:`lightning_pipe.schedules.resolve`, which knows the DSL; this
module does not, so families and the DSL can both register here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .ir import Program

__all__ = [
    "Schedule",
    "ScheduleFamily",
    "register_schedule",
    "unregister_schedule",
    "available_schedules",
    "get_family",
]

ScheduleFunction = Callable[..., Program]


@dataclass(frozen=True)
class ScheduleFamily:
    """A registered generator and what the registry needs to know about it.

    Attributes:
        name: registry key (lower case).
        function: ``(num_ranks, num_microbatches, **options) -> Program``.
        stages_per_rank: stages per rank when the options do not say otherwise.
        accepts_stages_per_rank: True when ``function`` takes a ``stages_per_rank`` option.
    """

    name: str
    function: ScheduleFunction
    stages_per_rank: int = 1
    accepts_stages_per_rank: bool = False


_FAMILIES: dict[str, ScheduleFamily] = {}
_SPLIT_PLACEMENT = frozenset({"helix", "spipe"})  # built per model by split_schedules.split_program, not registered


def register_schedule(
    name: str,
    fn: ScheduleFunction,
    *,
    stages_per_rank: int = 1,
    overwrite: bool = False,
) -> ScheduleFunction:
    """Register a schedule family under ``name``.

    Args:
        name: lower-case name used in configs (``"1f1b"``).
        fn: pure function ``(num_ranks, num_microbatches, **options) -> Program``. If it has a
            ``stages_per_rank`` parameter, its default there is used as the family's default.
        stages_per_rank: stages per rank for families without that parameter.
        overwrite: replace an existing family of that name.

    Returns:
        ``fn`` unchanged, so this can be used as a decorator helper.

    Raises:
        ValueError: if the name is not lower case or is already taken and ``overwrite`` is False.
    """
    if name != name.lower() or not name:
        raise ValueError(f"schedule names are lower case, got {name!r}")
    if name in _FAMILIES and not overwrite and _FAMILIES[name].function is not fn:
        raise ValueError(f"schedule {name!r} is already registered; pass overwrite=True to replace it")
    parameter = inspect.signature(fn).parameters.get("stages_per_rank")
    accepts = parameter is not None
    if accepts and parameter.default is not inspect.Parameter.empty:
        stages_per_rank = int(parameter.default)
    _FAMILIES[name] = ScheduleFamily(name, fn, stages_per_rank, accepts)
    return fn


def unregister_schedule(name: str) -> None:
    """Forget family ``name`` (tests, notebooks). Unknown names are ignored."""
    _FAMILIES.pop(name, None)


def available_schedules() -> tuple[str, ...]:
    """Names of the registered families, sorted."""
    return tuple(sorted(_FAMILIES))


def get_family(name: str) -> ScheduleFamily:
    """The registered family ``name``.

    Raises:
        ValueError: listing the valid names.
    """
    try:
        return _FAMILIES[name]
    except KeyError:
        if name in _SPLIT_PLACEMENT:
            raise ValueError(
                f"schedule {name!r} puts one stage's actions on several ranks and its stage count follows the model: "
                f"train with ElasticPipelineStrategy(schedule={name!r}), or build its program with "
                "lightning_pipe.schedules.split_program(schedule, num_ranks, num_microbatches, num_blocks)"
            ) from None
        raise ValueError(
            f"unknown schedule {name!r}; valid names: {', '.join(available_schedules())} "
            "(or a DSL spec such as 'placement=circular stages_per_rank=2')"
        ) from None


class _Options(Mapping[str, Any]):
    """Read-only, hashable mapping of family options (so :class:`Schedule` stays hashable)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._data.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __repr__(self) -> str:
        return repr(self._data)


@dataclass(frozen=True)
class Schedule:
    """A schedule family with its options: what the strategy holds and asks for programs.

    Attributes:
        name: registered family name (``"dsl"`` for DSL specs).
        stages_per_rank: stages each rank holds; the strategy partitions the model into
            ``num_ranks * stages_per_rank`` stages. None (the default) takes the family's default.
        options: keyword options passed to the family function (read-only).
    """

    name: str
    stages_per_rank: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _Options(self.options))
        if self.stages_per_rank is None:
            family = _FAMILIES.get(self.name)
            object.__setattr__(self, "stages_per_rank", family.stages_per_rank if family else 1)
        if self.stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be >= 1, got {self.stages_per_rank}")

    def num_stages(self, num_ranks: int) -> int:
        """Number of stages the model is cut into on ``num_ranks`` pipeline ranks."""
        return num_ranks * self.stages_per_rank

    def build(self, num_ranks: int, num_microbatches: int) -> Program:
        """Build the program of this schedule for ``num_ranks`` ranks and ``num_microbatches``.

        Generator families' programs are not validated here (DSL and preset families' are); call
        :func:`lightning_pipe.schedules.validate` before running one.

        Raises:
            ValueError: from the family when the sizes or options do not fit it.
        """
        family = get_family(self.name)
        options = dict(self.options)
        if family.accepts_stages_per_rank:
            options["stages_per_rank"] = self.stages_per_rank
        program = family.function(num_ranks, num_microbatches, **options)
        expected = num_ranks * self.stages_per_rank
        if program.num_stages != expected:
            raise ValueError(
                f"schedule {self.name!r} built {program.num_stages} stages but Schedule.stages_per_rank="
                f"{self.stages_per_rank} promises {expected} on {num_ranks} ranks"
            )
        return program
