"""User-registered instructions: new action kinds a schedule can carry (FlexPipe's ``register_new_inst``).

A registered instruction appears in programs as ``Action(stage, ActionType.CUSTOM, microbatch,
name=...)`` with the text token ``f"{stage}{name}{microbatch}"`` (``3SYNC7``). The simulator charges
``seconds``; the runtime's executor calls ``runtime_function`` (``"package.module:function"``, with a
``runtime.instructions.InstructionCall``) where the action stands in the rank's order. The DSL places
it right after its anchor action (``after``) on the rank of the anchor stage, every ``every``
microbatches.

Example:
    >>> from lightning_pipe.schedules import Instruction, register_instruction
    >>> register_instruction(Instruction("SYNC", "my_pkg.sync:gather_states", stages=(-1,)))  # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .ir import Action, ActionType

__all__ = [
    "Instruction",
    "register_instruction",
    "unregister_instruction",
    "get_instruction",
    "available_instructions",
    "is_registered_instruction",
    "custom_action",
]

_NAME = re.compile(r"^[A-Z][A-Z_]*[A-Z]$|^[A-Z]$")
_RESERVED = frozenset(t.value for t in ActionType) | {"UNSHARD", "RESHARD", "REDUCE_GRAD", "OVERLAP_F_B"}
_ANCHORS = (ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)


@dataclass(frozen=True)
class Instruction:
    """A new action kind: its name, what runs it, where the DSL places it and what it costs.

    Attributes:
        name: upper-case token (letters and ``_``, no digits so the text form stays parseable),
            distinct from the built-in tokens (``F``, ``SEND_F``, ...).
        runtime_function: what the runtime calls to execute it (``"package.module:function"``).
        after: compute kind it follows (``F``, ``B``, ``I`` or ``W``); it runs after that action of
            the same stage and microbatch, on the same rank.
        stages: global stages it is attached to; negative values count from the end
            (``(-1,)``: the last stage). None means every stage.
        every: attach it to one microbatch in ``every`` (the last of each group and the last
            microbatch), FlexPipe's scheduling unit.
        seconds: simulated duration.
        attributes: plain data handed to the runtime function (FlexPipe's ``inst_attr``).
    """

    name: str
    runtime_function: str
    after: ActionType = ActionType.FORWARD
    stages: tuple[int, ...] | None = (-1,)
    every: int = 1
    seconds: float = 0.0
    attributes: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name in _RESERVED:
            raise ValueError(
                f"instruction name {self.name!r} must be upper-case letters and '_' (no digits) and not a "
                f"built-in token ({', '.join(sorted(_RESERVED))})"
            )
        after = ActionType(self.after)
        if after not in _ANCHORS:
            raise ValueError(f"after={self.after!r}: an instruction follows F, B, I or W")
        object.__setattr__(self, "after", after)
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got every={self.every}")
        if self.seconds < 0:
            raise ValueError(f"seconds must be >= 0, got seconds={self.seconds}")
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(int(s) for s in self.stages))

    def applies_to(self, stage: int, microbatch: int, num_stages: int, num_microbatches: int) -> bool:
        """Whether the DSL attaches this instruction to ``stage``/``microbatch``."""
        if self.stages is not None and stage not in {s % num_stages for s in self.stages}:
            return False
        return (microbatch + 1) % self.every == 0 or microbatch == num_microbatches - 1


_REGISTRY: dict[str, Instruction] = {}


def register_instruction(instruction: Instruction, *, overwrite: bool = False) -> Instruction:
    """Register ``instruction`` so programs, the validator, the parser and the runtime know it.

    Args:
        instruction: the new action kind.
        overwrite: replace an instruction already registered under that name.

    Returns:
        ``instruction``.

    Raises:
        ValueError: if the name is taken and ``overwrite`` is False.
    """
    if instruction.name in _REGISTRY and not overwrite and _REGISTRY[instruction.name] != instruction:
        raise ValueError(f"instruction {instruction.name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[instruction.name] = instruction
    return instruction


def unregister_instruction(name: str) -> None:
    """Forget instruction ``name`` (tests, notebooks). Unknown names are ignored."""
    _REGISTRY.pop(name, None)


def get_instruction(name: str) -> Instruction:
    """The registered instruction called ``name``.

    Raises:
        ValueError: listing the registered names when ``name`` is unknown.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ValueError(f"unknown instruction {name!r}; registered: {known}") from None


def available_instructions() -> tuple[str, ...]:
    """Names of the registered instructions, sorted."""
    return tuple(sorted(_REGISTRY))


def is_registered_instruction(name: str) -> bool:
    """True when ``name`` is a registered instruction."""
    return name in _REGISTRY


def custom_action(stage: int, name: str, microbatch: int | None = None) -> Action:
    """The action of instruction ``name`` for ``stage``/``microbatch``."""
    return Action(stage, ActionType.CUSTOM, microbatch, name=name)
