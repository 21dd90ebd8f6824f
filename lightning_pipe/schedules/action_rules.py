"""One table of what each action kind costs, keeps alive, frees and waits for.

Every reader of a program (the simulator, the validator, the planners' bounds, batch simulation and
memory planner in ``planning/``) asks :data:`ACTION_RULES` instead of repeating
``kind in (FORWARD, RECOMPUTE)``: a new action kind, or a changed rule, is one row here.

Time. An action lasts ``forward_share`` forwards plus ``backward_share`` full backwards of its
``(stage, microbatch)``; ``duration`` names the :class:`~lightning_pipe.schedules.ActionCosts` entry the
simulator charges (``input_gradient`` and ``weight_gradient`` are half a backward unless the costs
give their own tables; the linear models of ``planning/`` use the halves unless given a measured
:class:`~lightning_pipe.schedules.costs.SplitBackward`, through :func:`backward_share`). A registered instruction
(``CUSTOM``) lasts its ``seconds``; communication and the other kinds take no compute time.

Memory, per ``(stage, microbatch)`` pair on its rank. A pair's saved activations are alive from the
action that ``saves`` them (``F`` in a training step, or its ``RECOMPUTE`` when the pair has one) to
the action that ``frees`` them (``B``, or ``W`` with split backward), except between ``OFFLOAD`` and
``RELOAD``. An action that ``uses_saved`` activations reads them (its transient counts on top).

Execution. ``executed`` says whether the runtime (``runtime/executor.py``) runs the kind. The memory
kinds (``RECOMPUTE``, ``OFFLOAD``, ``RELOAD``) are ``from_memory_plan``: the strategy writes them into
the program it runs from the plan's ``MemoryPlan`` (``planning.memory_lowering``), and the executor
runs them as markers, the work itself happening inside the pair's blocks through the wrappers and
saved-tensor hooks armed for that (stage, microbatch) from the same plan. A schedule must not emit
them for the strategy (a marker without its plan would promise a recompute nothing performs).
Registered instructions (``CUSTOM``) run their ``runtime_function`` (``runtime/instructions.py``).
Split placement's checkpoints (``SEND_C``/``RECV_C``) are not run by the executor.
:func:`check_executable` refuses a schedule's program holding those or memory actions before
training starts.

Order. ``requires`` lists what must have run on the rank before the action, as the validator checks
it: the pair's own earlier actions (``stage_offset`` 0) and the neighbouring stage's (``-1`` before a
forward, ``+1`` before a backward), which, when that stage lives on another rank, arrive as the
named receive instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .costs import SplitBackward
from .instructions import get_instruction, is_registered_instruction
from .ir import Action, ActionType, Program

__all__ = [
    "ACTION_RULES",
    "ActionRule",
    "Dependency",
    "check_executable",
    "instruction_seconds",
    "rule_of",
    "saves_again",
]

_F, _B, _I, _W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT


@dataclass(frozen=True)
class Dependency:
    """Something that must run on the same rank before an action (any one of ``kinds``).

    Attributes:
        kinds: action kinds of which one must have run (for ``(stage + stage_offset, microbatch)``).
        stage_offset: 0 for the action's own stage, -1 the previous stage, +1 the next one (skipped
            past the first or last stage).
        reason: what the validator says when it is missing.
        received_as: for a neighbouring stage on another rank, the receive (of the action's own
            stage) that stands for it; None: the neighbour must be on this rank.
        received_reason: the validator's words for a missing ``received_as``.
    """

    kinds: tuple[ActionType, ...]
    stage_offset: int
    reason: str
    received_as: ActionType | None = None
    received_reason: str = ""


@dataclass(frozen=True)
class ActionRule:
    """How one action kind counts in time, in memory and in order (see the module docstring).

    Attributes:
        duration: the :class:`ActionCosts` entry charged: ``"forward"``, ``"backward"``,
            ``"input_gradient"``, ``"weight_gradient"``, ``"instruction"`` or ``"none"``.
        forward_share: forwards of the pair it lasts, in linear cost models.
        backward_share: full backwards of the pair it lasts, in linear cost models.
        starts_pair: the pair's first compute (a microbatch enters the rank's in-flight count).
        saves: makes the pair's saved activations alive.
        uses_saved: reads the pair's saved activations (adds a backward transient).
        frees: drops the pair's saved activations after it (and ends the pair in flight).
        offloads: moves the pair's alive activations to host memory.
        reloads: brings offloaded activations back.
        requires: what must run before it on the rank.
        executed: whether the runtime runs it (False: simulation and planning only).
        from_memory_plan: written into the program from a memory plan (``planning.memory_lowering``),
            never by a schedule the strategy runs.
    """

    duration: str = "none"
    forward_share: float = 0.0
    backward_share: float = 0.0
    starts_pair: bool = False
    saves: bool = False
    uses_saved: bool = False
    frees: bool = False
    offloads: bool = False
    reloads: bool = False
    requires: tuple[Dependency, ...] = ()
    executed: bool = True
    from_memory_plan: bool = False


_OWN_FORWARD = Dependency((_F,), 0, "its own forward")
_BACKWARD_OF_NEXT = Dependency(
    (_B, _I), +1, "backward of the next stage", ActionType.RECV_B, "receive of the next stage's gradient"
)

ACTION_RULES: Mapping[ActionType, ActionRule] = MappingProxyType(
    {
        _F: ActionRule(
            duration="forward",
            forward_share=1.0,
            starts_pair=True,
            saves=True,
            requires=(
                Dependency(
                    (_F,), -1, "forward of the previous stage", ActionType.RECV_F, "receive of the previous stage's output"
                ),
            ),
        ),
        _B: ActionRule(
            duration="backward", backward_share=1.0, uses_saved=True, frees=True, requires=(_OWN_FORWARD, _BACKWARD_OF_NEXT)
        ),
        _I: ActionRule(duration="input_gradient", backward_share=0.5, uses_saved=True, requires=(_OWN_FORWARD, _BACKWARD_OF_NEXT)),
        _W: ActionRule(
            duration="weight_gradient",
            backward_share=0.5,
            uses_saved=True,
            frees=True,
            requires=(Dependency((_I,), 0, "W needs its I first"),),
        ),
        ActionType.SEND_F: ActionRule(requires=(Dependency((_F,), 0, "the forward that produces it"),)),
        ActionType.SEND_B: ActionRule(requires=(Dependency((_B, _I), 0, "the backward that produces it"),)),
        ActionType.RECV_F: ActionRule(),
        ActionType.RECV_B: ActionRule(),
        # Split placement (HelixPipe, SPipe): simulated and validated; run by runtime/split_executor.py,
        # not by the strategy's PipelineExecutor (check_executable refuses them there).
        ActionType.SEND_C: ActionRule(
            executed=False, requires=(Dependency((_F,), 0, "the forward whose input it ships"),)
        ),
        ActionType.RECV_C: ActionRule(executed=False),
        ActionType.RECOMPUTE: ActionRule(
            duration="forward",
            forward_share=1.0,
            saves=True,
            from_memory_plan=True,
            requires=(Dependency((_F,), 0, "recompute after the forward whose activations it handles"),),
        ),
        ActionType.OFFLOAD: ActionRule(
            offloads=True,
            from_memory_plan=True,
            requires=(Dependency((_F,), 0, "offload after the forward whose activations it handles"),),
        ),
        ActionType.RELOAD: ActionRule(
            reloads=True, from_memory_plan=True, requires=(Dependency((ActionType.OFFLOAD,), 0, "reload after offload"),)
        ),
        ActionType.CUSTOM: ActionRule(duration="instruction"),
    }
)


def rule_of(kind: ActionType) -> ActionRule:
    """The rule of ``kind`` (every :class:`ActionType` has one)."""
    return ACTION_RULES[kind]


def check_executable(program: Program) -> Program:
    """Refuse a schedule's program the strategy cannot run: simulation-only kinds, memory actions, split placement.

    Memory actions are accepted by the executor only as the strategy writes them from its memory plan
    (after this check), so a schedule holding one is refused: nothing would perform its recompute.

    Returns:
        ``program`` unchanged.

    Raises:
        ValueError: naming the first such action of each rank and what to do instead.
    """
    found = []
    for rank, actions in enumerate(program.actions):
        action = next(
            (a for a in actions if not ACTION_RULES[a.type].executed or ACTION_RULES[a.type].from_memory_plan), None
        )
        if action is not None:
            found.append(f"rank {rank}: {action} ({action.type.name})")
    if program.pair_ranks is not None and not found:
        found.append("actions of one stage on several ranks (split placement: HelixPipe's attention, SPipe's backward)")
    if found:
        raise ValueError(
            f"Program {program.name!r} holds actions the runtime does not run ({'; '.join(found)}). Memory actions "
            "(RECOMPUTE, OFFLOAD, RELOAD) are written by the strategy from its memory plan: ask for recomputation and "
            "offload with a memory plan (`recompute=`/`offload=` of the strategy, or the `MemoryPlanner` callback); "
            "split placement (SEND_C/RECV_C checkpoints, a stage on several ranks) runs only as the strategy's "
            "`schedule='helix'` or `schedule='spipe'` (runtime/split_executor.py), not inside another schedule. "
            "Remove them from the schedule."
        )
    return program


def backward_share(kind: ActionType, stage: int, split: SplitBackward | None = None) -> float:
    """Full backwards of its ``(stage, microbatch)`` that an action of ``kind`` lasts in the linear
    models: the rule's ``backward_share``, except ``I`` and ``W`` under a measured ``split``."""
    if split is not None and kind is ActionType.BACKWARD_INPUT:
        return split.shares(stage)[0]
    if split is not None and kind is ActionType.BACKWARD_WEIGHT:
        return split.shares(stage)[1]
    return ACTION_RULES[kind].backward_share


def saves_again(kind: ActionType) -> bool:
    """Whether ``kind`` saves a pair's activations after its forward did (``RECOMPUTE``): a forward
    followed by one keeps nothing until then."""
    rule = ACTION_RULES[kind]
    return rule.saves and not rule.starts_pair


def instruction_seconds(action: Action) -> float:
    """Seconds a ``CUSTOM`` action lasts: its registered instruction's ``seconds`` (0 for any other
    action, or an instruction no longer registered)."""
    if ACTION_RULES[action.type].duration != "instruction" or not action.name:
        return 0.0
    return get_instruction(action.name).seconds if is_registered_instruction(action.name) else 0.0
