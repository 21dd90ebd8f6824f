"""What a user writes as a schedule (a family name, a DSL spec, a dict) -> a :class:`Schedule`.

Apart from :mod:`lightning_pipe.schedules.registry` because it needs the DSL, and the DSL (and the
families it borrows from) register themselves in the registry: one place reads both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import dsl
from .registry import Schedule, available_schedules, get_family
from .split_schedules import check_split_options, is_split_placement

__all__ = ["resolve_schedule"]


def _schedule_for_family(name: str, options: Mapping[str, Any]) -> Schedule:
    if is_split_placement(name):  # built per model (split_schedules.py), not through the registry
        check_split_options(name, options)
        return Schedule(name, 1, dict(options))
    family = get_family(name)
    options = dict(options)
    stages_per_rank = int(options.pop("stages_per_rank", family.stages_per_rank))
    if not family.accepts_stages_per_rank and stages_per_rank != family.stages_per_rank:
        raise ValueError(
            f"schedule {name!r} always uses stages_per_rank={family.stages_per_rank}, "
            f"got stages_per_rank={stages_per_rank}"
        )
    return Schedule(name, stages_per_rank, options)


def resolve_schedule(spec: Any) -> Schedule:
    """Turn what a user wrote into a :class:`Schedule`.

    Args:
        spec: a family name (``"1f1b"``), a :class:`Schedule`, a DSL spec as text
            (``"placement=circular stages_per_rank=2 priority=backward_first"``), a DSL dict
            (``{"placement": "circular", ...}``), a :class:`~lightning_pipe.schedules.dsl.ScheduleSpec`,
            or a family with options as a dict (``{"name": "interleaved_1f1b", "stages_per_rank": 4}``
            or ``{"family": ...}``; a dict with DSL keys is a DSL spec and its ``name`` is a label).

    Returns:
        The schedule; nothing is built yet.

    Raises:
        ValueError: for an unknown name (listing the valid ones) or an invalid DSL spec.
        TypeError: for anything else.
    """
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower() in available_schedules() or is_split_placement(text.lower()):
            return _schedule_for_family(text.lower(), {})
        if "=" not in text:
            get_family(text)  # raises with the valid names
    if isinstance(spec, Mapping):
        options = dict(spec)
        family = options.pop("family", None)
        # "name" names a family unless DSL keys are present (then it is the DSL spec's display name).
        if family is None and "name" in options and not set(options) & dsl.DSL_KEYS:
            family = options.pop("name")
        if family is not None and family != "dsl":
            return _schedule_for_family(str(family).lower(), options)
        spec = options

    if isinstance(spec, (str, Mapping, dsl.ScheduleSpec)):
        return dsl.parse_spec(spec).to_schedule()
    raise TypeError(
        f"schedule must be a family name, a Schedule, a DSL spec string or dict, got {type(spec).__name__}: {spec!r}"
    )
