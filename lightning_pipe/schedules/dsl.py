"""A small schedule language (after FlexPipe, Jiang et al.): describe a schedule, get a validated program.

A :class:`ScheduleSpec` says where stages live and which action a rank prefers when several are
ready; :mod:`lightning_pipe.schedules.dsl_engine` turns that into per-rank orders, communication is
inserted as for every family, and the program goes through :func:`validate`.

Knobs (FlexPipe's names in brackets):

- ``placement`` [stage placement]: ``one_to_one``, ``circular`` or ``v_shape``; ``stages_per_rank``.
- ``priority`` [computation-type traversal priority]: ``backward_first``, ``forward_first`` or
  ``interleaved`` with ``forward_unit``/``backward_unit`` actions per turn.
- ``forward_traversal``/``backward_traversal`` [stage traversal priority]: ``breadth_first`` or
  ``depth_first`` (``traversal`` sets both), with ``forward_interval``/``backward_interval``
  (``interval`` sets both; ``"num_ranks"`` means p microbatches per round, or the balanced groups
  of at least p of ``interleaved_1f1b`` when p does not divide m).
- ``max_in_flight`` [in-flight micro-batches]: microbatches a rank may hold between their first
  forward and last backward there: an int, one int per rank, ``"auto"`` (``p - r`` one-to-one as
  1F1B, Megatron's peak circular, ZB-V's ``2p - r`` V-shape; :func:`auto_in_flight`),
  ``"num_ranks"`` or None (unlimited). Only new microbatches are held back.
- ``split_backward``: zero-bubble ``I`` now, ``W`` deferred to fill bubbles.
- ``rules`` [check functions]: callables ``(RuleContext) -> bool`` or names given to
  :func:`register_rule`; False vetoes an action at that step.
- ``instructions`` [registered instructions]: names of :class:`Instruction` objects.

Text form (one line, ``key=value`` separated by spaces, commas or semicolons; an optional leading
preset name)::

    placement=circular stages_per_rank=2 priority=backward_first traversal=depth_first max_in_flight=4
    1f1b max_in_flight=2

Dict form (YAML): the same keys, e.g. ``{"placement": "circular", "stages_per_rank": 2,
"priority": "backward_first", "traversal": "depth_first", "max_in_flight": 4}`` or
``{"preset": "1f1b", "max_in_flight": 2}``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

from .dsl_engine import EngineSettings, Rule, RuleContext, engine_program
from .instructions import get_instruction
from .ir import Program
from .lowering import PLACEMENTS, place_stages
from .registry import Schedule, register_schedule
from .validate import validate

__all__ = [
    "ScheduleSpec",
    "RuleContext",
    "PRESETS",
    "parse_spec",
    "build_spec",
    "register_rule",
    "auto_in_flight",
    "microbatch_groups",
    "build_preset",
]

PRIORITIES = ("backward_first", "forward_first", "interleaved")
TRAVERSALS = ("breadth_first", "depth_first")

_ALIASES = {
    "one_to_one": "one_to_one",
    "onetoone": "one_to_one",
    "circular": "circular",
    "v_shape": "v_shape",
    "vshape": "v_shape",
    "v": "v_shape",
    "backward_first": "backward_first",
    "bwdfirst": "backward_first",
    "bwd_first": "backward_first",
    "bwdpass_first": "backward_first",
    "bwpass_first": "backward_first",
    "backward": "backward_first",
    "forward_first": "forward_first",
    "fwdfirst": "forward_first",
    "fwd_first": "forward_first",
    "fwdpass_first": "forward_first",
    "forward": "forward_first",
    "interleaved": "interleaved",
    "breadth_first": "breadth_first",
    "bfs": "breadth_first",
    "depth_first": "depth_first",
    "dfs": "depth_first",
}

_RULES: dict[str, Rule] = {}
_SHORTHANDS = {
    "traversal": ("forward_traversal", "backward_traversal"),
    "interval": ("forward_interval", "backward_interval"),
}
_DEFAULTS = {
    "forward_traversal": "breadth_first",
    "backward_traversal": "breadth_first",
    "forward_interval": None,
    "backward_interval": None,
}


def register_rule(name: str, rule: Rule) -> Rule:
    """Register a check function under ``name`` so text and YAML specs can use it (``rules=[name]``).

    Args:
        name: identifier used in specs.
        rule: ``(RuleContext) -> bool``; False vetoes the candidate action at that step.

    Returns:
        ``rule``.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"rule names are identifiers, got {name!r}")
    _RULES[name] = rule
    return rule


def _word(value: Any, choices: tuple[str, ...], argument: str) -> str:
    key = str(value).strip().lower().replace("-", "_").replace(" ", "_")
    word = _ALIASES.get(key, key)
    if word not in choices:
        raise ValueError(f"{argument}={value!r} is not one of {', '.join(choices)}")
    return word


def _interval(value: Any, argument: str) -> int | str | None:
    if value is None or value == "none":
        return None
    if value == "num_ranks":
        return "num_ranks"
    number = int(value)
    if number < 1:
        raise ValueError(f"{argument} must be >= 1, 'num_ranks' or None, got {argument}={value!r}")
    return number


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule written in the DSL (see the module docstring for every knob).

    Attributes:
        placement: ``one_to_one``, ``circular`` or ``v_shape``.
        stages_per_rank: stages each rank holds (1 for one-to-one, 2 for V-shape).
        priority: ``backward_first``, ``forward_first`` or ``interleaved``.
        forward_unit: forwards per turn for ``interleaved``.
        backward_unit: backwards per turn for ``interleaved``.
        forward_traversal: ``breadth_first`` (lowest stage first) or ``depth_first``.
        backward_traversal: same, for backwards.
        forward_interval: consecutive forwards of one stage before moving on (None: free).
        backward_interval: same, for backwards.
        max_in_flight: int, per-rank tuple, ``"auto"``, ``"num_ranks"`` or None (unlimited).
        split_backward: zero-bubble ``I`` + deferred ``W`` instead of ``B``.
        rules: check functions or registered rule names.
        instructions: names of registered instructions to place.
        name: display name of the programs (default: the text form).
        traversal: init-only shorthand for both traversals (applies to those left at the default).
        interval: init-only shorthand for both intervals (same rule).
    """

    placement: str = "one_to_one"
    stages_per_rank: int = 1
    priority: str = "backward_first"
    forward_unit: int = 1
    backward_unit: int = 1
    forward_traversal: str = "breadth_first"
    backward_traversal: str = "breadth_first"
    forward_interval: int | str | None = None
    backward_interval: int | str | None = None
    max_in_flight: int | tuple[int, ...] | str | None = "auto"
    split_backward: bool = False
    rules: tuple[Rule | str, ...] = field(default=())
    instructions: tuple[str, ...] = ()
    name: str | None = None
    traversal: InitVar[str | None] = None
    interval: InitVar[int | str | None] = None

    def __post_init__(self, traversal: str | None, interval: int | str | None) -> None:
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731
        for short, value in (("traversal", traversal), ("interval", interval)):
            for target in _SHORTHANDS[short]:
                if value is not None and getattr(self, target) == _DEFAULTS[target]:
                    set_(target, value)
        set_("placement", _word(self.placement, PLACEMENTS, "placement"))
        set_("priority", _word(self.priority, PRIORITIES, "priority"))
        set_("forward_traversal", _word(self.forward_traversal, TRAVERSALS, "forward_traversal"))
        set_("backward_traversal", _word(self.backward_traversal, TRAVERSALS, "backward_traversal"))
        set_("forward_interval", _interval(self.forward_interval, "forward_interval"))
        set_("backward_interval", _interval(self.backward_interval, "backward_interval"))
        for argument in ("stages_per_rank", "forward_unit", "backward_unit"):
            if int(getattr(self, argument)) < 1:
                raise ValueError(f"{argument} must be >= 1, got {argument}={getattr(self, argument)!r}")
            set_(argument, int(getattr(self, argument)))
        if self.placement == "one_to_one" and self.stages_per_rank != 1:
            raise ValueError(
                f"placement=one_to_one needs stages_per_rank=1, got stages_per_rank={self.stages_per_rank}"
            )
        if self.placement == "v_shape" and self.stages_per_rank != 2:
            raise ValueError(f"placement=v_shape needs stages_per_rank=2, got stages_per_rank={self.stages_per_rank}")
        limit = self.max_in_flight
        if isinstance(limit, (list, tuple)):
            set_("max_in_flight", tuple(int(x) for x in limit))
        elif isinstance(limit, str) and limit not in ("auto", "num_ranks"):
            if limit.lower() in ("none", "unlimited"):
                set_("max_in_flight", None)
            else:
                set_("max_in_flight", int(limit))
        set_("split_backward", _boolean(self.split_backward, "split_backward"))
        set_("rules", tuple(self.rules))
        set_("instructions", tuple(self.instructions))
        for rule in self.rules:
            if isinstance(rule, str) and rule not in _RULES:
                raise ValueError(f"unknown rule {rule!r}; registered rules: {', '.join(sorted(_RULES)) or 'none'}")

    @classmethod
    def preset(cls, preset: str, /, **overrides: Any) -> ScheduleSpec:
        """The spec of a named preset (``PRESETS``), with fields overridden (``name=`` included)."""
        try:
            base = PRESETS[preset.lower()]
        except KeyError:
            if preset.lower() in ("helix", "spipe"):  # split placement: not expressible (docs/schedules.md)
                raise ValueError(
                    f"{preset!r} is not a DSL preset: the DSL places every stage whole on one rank, and {preset!r} runs "
                    "one stage's actions on several ranks (Program.pair_ranks). Use the family itself: "
                    f"schedule={preset.lower()!r} (or a dict with its options, docs/schedules.md)."
                ) from None
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(sorted(PRESETS))}") from None
        return dataclasses.replace(base, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as plain data (YAML-friendly; rules by name)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                if f.name == "rules":
                    value = [r if isinstance(r, str) else getattr(r, "__name__", repr(r)) for r in value]
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_text(self) -> str:
        """One-line text form; :func:`parse_spec` reads it back (for rules given by name)."""

        def show(value: Any) -> str:
            if isinstance(value, list):
                return "[" + ",".join(str(v) for v in value) + "]"
            return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

        return " ".join(f"{key}={show(value)}" for key, value in self.to_dict().items()) or "placement=one_to_one"

    def to_schedule(self) -> Schedule:
        """The :class:`Schedule` that builds this spec (family ``"dsl"``)."""
        options = {k: v for k, v in self.to_dict().items() if k != "stages_per_rank"}
        if self.rules:
            options["rules"] = self.rules  # the callables themselves, not their names
        return Schedule("dsl", self.stages_per_rank, options)

    def build(self, num_ranks: int, num_microbatches: int) -> Program:
        """Generate and validate the program (see :func:`build_spec`)."""
        return build_spec(self, num_ranks, num_microbatches)


def _boolean(value: Any, argument: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off"):
        return False
    raise ValueError(f"{argument} must be true or false, got {argument}={value!r}")


PRESETS: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(priority="forward_first", max_in_flight=None, name="gpipe"),
    "1f1b": ScheduleSpec(priority="backward_first", max_in_flight="auto", name="1f1b"),
    "interleaved_1f1b": ScheduleSpec(
        placement="circular",
        stages_per_rank=2,
        priority="interleaved",
        forward_traversal="breadth_first",
        backward_traversal="depth_first",
        forward_interval="num_ranks",
        backward_interval="num_ranks",
        max_in_flight="auto",
        name="interleaved_1f1b",
    ),
    "looped_bfs": ScheduleSpec(
        placement="circular",
        stages_per_rank=2,
        priority="forward_first",
        forward_traversal="breadth_first",
        backward_traversal="depth_first",
        max_in_flight=None,
        name="looped_bfs",
    ),
    "zb": ScheduleSpec(priority="backward_first", split_backward=True, max_in_flight="num_ranks", name="zb"),
    "v_zb": ScheduleSpec(
        placement="v_shape",
        stages_per_rank=2,
        priority="backward_first",
        forward_traversal="depth_first",
        backward_traversal="depth_first",
        split_backward=True,
        max_in_flight="auto",
        name="v_zb",
    ),
}


def microbatch_groups(num_ranks: int, num_microbatches: int, group_size: int | None = None) -> list[int]:
    """Sizes of the microbatch groups that go through one chunk before the next (circular placement).

    Balanced groups are ``max(1, m // p)`` groups of nearly equal size, each at least ``p`` (larger
    ones first): Megatron's groups of ``p`` when ``p`` divides ``m``, and deadlock free otherwise
    (Megatron-Core's remainder group smaller than ``p`` deadlocks with its warm-up).

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``.
        group_size: fixed group size (must divide ``m`` and be >= ``p``); None: balanced groups.

    Returns:
        Group sizes summing to ``m``.

    Raises:
        ValueError: if ``group_size`` is smaller than ``num_ranks`` or does not divide ``m``.
    """
    if group_size is None:
        count = max(1, num_microbatches // num_ranks)
        return [num_microbatches // count + (1 if i < num_microbatches % count else 0) for i in range(count)]
    if group_size < num_ranks or num_microbatches % group_size:
        raise ValueError(
            f"interleaved_1f1b: microbatch_group_size={group_size} must be >= num_ranks={num_ranks} and divide "
            f"num_microbatches={num_microbatches}; leave it None for balanced groups"
        )
    return [group_size] * (num_microbatches // group_size)


def auto_in_flight(placement: str, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> tuple[int, ...]:
    """The ``"auto"`` in-flight limit per rank, in microbatches (see ``dsl_engine``).

    One-to-one: ``p - r``, which makes ``backward_first`` exactly 1F1B. Circular: Megatron's
    interleaved warm-up plus one, ``2 (p - 1 - r) + (v - 1) g + 1`` (``g`` the first microbatch
    group), at most ``2g``: the peak of microbatches in flight of Megatron's schedule, so the
    interleaved preset is not held back. V-shape: ``2p - r``, ZB-V's peak.
    """
    p, v = num_ranks, stages_per_rank
    if placement == "one_to_one":
        return tuple(p - r for r in range(p))
    if placement == "circular":
        group = microbatch_groups(p, num_microbatches)[0]
        return tuple(min(2 * (p - 1 - r) + (v - 1) * group + 1, 2 * group) for r in range(p))
    return tuple(2 * p - r for r in range(p))


def _resolve_rules(rules: tuple[Rule | str, ...]) -> tuple[Rule, ...]:
    return tuple(_RULES[r] if isinstance(r, str) else r for r in rules)


def build_spec(spec: ScheduleSpec, num_ranks: int, num_microbatches: int, *, check: bool = True) -> Program:
    """Generate the program of ``spec`` for ``num_ranks`` ranks and ``num_microbatches``, validated.

    ``check=False`` skips the final :func:`validate` (the auto-scheduler's inner loop only, which
    builds each spec once). Validated programs are immutable, so those of specs without rules or
    instructions (whose registered names could be re-bound) are kept in a cache of the last 512
    builds: the families defined by presets are built through here, and the planners ask for the
    same (spec, ranks, microbatches) many times.

    Raises:
        ValueError: for sizes or per-rank lists that do not fit.
        ScheduleError: when the spec deadlocks (e.g. ``max_in_flight`` too small for the placement).
    """
    for argument, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dsl: {argument} must be a positive integer, got {argument}={value!r}")
    if spec.rules or spec.instructions or not check:
        return _build(spec, num_ranks, num_microbatches, check)
    return _build_cached(spec, num_ranks, num_microbatches)


@functools.lru_cache(maxsize=512)
def _build_cached(spec: ScheduleSpec, num_ranks: int, num_microbatches: int) -> Program:
    return _build(spec, num_ranks, num_microbatches, True)


def _build(spec: ScheduleSpec, num_ranks: int, num_microbatches: int, check: bool) -> Program:
    placement = place_stages(spec.placement, num_ranks, spec.stages_per_rank)
    limit = spec.max_in_flight
    if limit == "auto":
        limits: tuple[float, ...] = auto_in_flight(spec.placement, num_ranks, spec.stages_per_rank, num_microbatches)
    elif limit == "num_ranks":
        limits = (num_ranks,) * num_ranks
    elif limit is None:
        limits = (float("inf"),) * num_ranks
    elif isinstance(limit, tuple):
        if len(limit) != num_ranks:
            raise ValueError(f"max_in_flight lists {len(limit)} ranks, the pipeline has num_ranks={num_ranks}")
        limits = limit
    else:
        limits = (int(limit),) * num_ranks
    if min(limits) < 1:
        raise ValueError(f"max_in_flight must be >= 1 on every rank, got {limits}")
    for name in spec.instructions:
        get_instruction(name)  # raises for unknown names
    groups = tuple(microbatch_groups(num_ranks, num_microbatches))
    resolve = lambda value: groups if value == "num_ranks" else value  # noqa: E731
    settings = EngineSettings(
        name=spec.name or spec.to_text(),
        num_microbatches=num_microbatches,
        stage_to_rank=placement,
        priority=spec.priority,
        forward_unit=spec.forward_unit,
        backward_unit=spec.backward_unit,
        forward_descending=spec.forward_traversal == "depth_first",
        backward_descending=spec.backward_traversal == "depth_first",
        forward_interval=resolve(spec.forward_interval),
        backward_interval=resolve(spec.backward_interval),
        max_in_flight=limits,
        split_backward=spec.split_backward,
        instructions=spec.instructions,
        rules=_resolve_rules(spec.rules),
    )
    program = engine_program(settings)
    return validate(program) if check else program


_SPEC_FIELDS = {f.name for f in dataclasses.fields(ScheduleSpec)}
#: Keys that make a dict a DSL spec rather than a family with options (see ``resolve_schedule``).
DSL_KEYS = (_SPEC_FIELDS | {"preset", "traversal", "interval"}) - {"name", "stages_per_rank"}
_PAIR = re.compile(r"([A-Za-z_][\w-]*)\s*[=:]\s*(\[[^\]]*\]|[^\s,;]+)")


def _parse_value(text: str) -> Any:
    text = text.strip()
    if text.startswith("["):
        items = [t.strip() for t in re.split(r"[,\s/]+", text.strip("[]")) if t.strip()]
        return [_parse_value(t) for t in items]
    if "/" in text:
        return [_parse_value(t) for t in text.split("/")]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"none": None, "null": None, "true": True, "false": False}.get(text.lower(), text)


def parse_spec(spec: str | Mapping[str, Any] | ScheduleSpec) -> ScheduleSpec:
    """Read a DSL spec from its text form, a dict (YAML) or return a :class:`ScheduleSpec` as is.

    Args:
        spec: ``"placement=circular stages_per_rank=2 ..."`` (optionally starting with a preset
            name), or ``{"placement": "circular", ...}`` (optionally with ``"preset"``).

    Returns:
        The spec.

    Raises:
        ValueError: for unknown keys (listing the valid ones), presets or values.
    """
    if isinstance(spec, ScheduleSpec):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        options: dict[str, Any] = {}
        head = re.match(r"^([A-Za-z0-9_-]+)(?=\s|$|,|;)", text)
        if head and "=" not in head.group(0) and not re.match(r"^\S+\s*[=:]", text):
            options["preset"] = head.group(1)
            text = text[head.end() :]
        consumed = _PAIR.sub("", text)
        if consumed.strip(" ,;\t"):
            raise ValueError(f"cannot read {consumed.strip()!r} in schedule spec {spec!r}; write key=value pairs")
        options.update((k.replace("-", "_"), _parse_value(v)) for k, v in _PAIR.findall(text))
    elif isinstance(spec, Mapping):
        options = {str(k).replace("-", "_"): v for k, v in spec.items()}
    else:
        raise TypeError(f"a DSL spec is text, a dict or a ScheduleSpec, got {type(spec).__name__}")
    preset = options.pop("preset", None)
    for short, targets in _SHORTHANDS.items():
        if short in options:
            value = options.pop(short)
            for target in targets:
                options.setdefault(target, value)
    unknown = sorted(set(options) - _SPEC_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown schedule spec keys {unknown}; valid keys: preset, traversal, interval, "
            f"{', '.join(sorted(_SPEC_FIELDS))}"
        )
    for key in ("rules", "instructions"):
        if key in options and isinstance(options[key], str):
            options[key] = (options[key],)
    if isinstance(options.get("max_in_flight"), list):
        options["max_in_flight"] = tuple(options["max_in_flight"])
    return ScheduleSpec.preset(str(preset), **options) if preset else ScheduleSpec(**options)


def _dsl_family(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1, **fields: Any) -> Program:
    """Registered family ``"dsl"``: the options are :class:`ScheduleSpec` fields."""
    return build_spec(parse_spec({**fields, "stages_per_rank": stages_per_rank}), num_ranks, num_microbatches)


register_schedule("dsl", _dsl_family)


def build_preset(preset: str, num_ranks: int, num_microbatches: int, **overrides: Any) -> Program:
    """The validated program of a preset (``PRESETS``), fields overridden; how families are built from presets.

    ``gpipe``, ``1f1b``, ``interleaved_1f1b`` and ``looped_bfs`` are defined once, as presets; their
    registered families (``families/``) call this. Built programs are cached (see :func:`build_spec`).
    """
    return _build_preset(PRESETS[preset], num_ranks, num_microbatches, tuple(sorted(overrides.items())))


@functools.lru_cache(maxsize=512)
def _build_preset(spec: ScheduleSpec, num_ranks: int, num_microbatches: int, overrides: tuple) -> Program:
    if overrides:
        spec = dataclasses.replace(spec, **dict(overrides))
    return build_spec(spec, num_ranks, num_microbatches)
