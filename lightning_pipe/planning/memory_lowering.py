"""A memory plan written into a program as memory actions, and read back from one.

:func:`lower_memory_plan` turns a :class:`~lightning_pipe.planning.memory_model.MemoryPlan` into the
program's own actions, per (stage, microbatch) pair on the rank that runs it:

* ``OFFLOAD`` right after the pair's ``F`` when some of its blocks offload their saved activations,
  and ``RELOAD`` right before its first backward (``B`` or ``I``);
* ``RECOMPUTE`` right before its first backward when some of its blocks are recomputed (``full`` or
  ``keep_attention``), after the ``RELOAD`` when it has both.

Every memory action carries the pair's whole :class:`StageMemory` as text in ``Action.name`` (how many
blocks of each mode, ``every``, ``mlp_chunk_size``), so :func:`read_memory_plan` gives the plan back.
The text form of a program (``format_table``, CSV) drops the name, as torch's tokens have no room for
it: a parsed program reads back as "every block of the pair" (``full=None`` / ``offload=None``).

What the actions mean where: the simulator and planning's bounds charge them from the action-rule
table (``schedules/action_rules.py``: a ``RECOMPUTE`` lasts one forward of the pair, the upper bound
of recomputing all its blocks, and saves the pair's activations again; ``OFFLOAD``..``RELOAD`` moves
them off the device); the memory planner prices the block-level choices itself, from the plan. The
runtime's executor runs them as markers: the recompute and the offload happen inside the pair's blocks
through the wrappers and saved-tensor hooks armed for that pair from the same plan (``runtime/memory.py``,
``runtime/offload.py``), at the moment the autograd engine needs them.

A choice with no effect on its stage (no block in a recompute or offload mode: only
``mlp_chunk_size``, or counts on a stage without blocks) writes no action; it is not read back. MLP
chunking saves nothing and moves nothing, so it is not an action; the runtime takes it from the plan.

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.planning.memory_model import FULL, KEEP_ATTENTION, OFFLOAD, MemoryPlan, StageMemory
from lightning_pipe.schedules.action_rules import ACTION_RULES
from lightning_pipe.schedules.ir import Action, ActionType, Program

__all__ = ["lower_memory_plan", "read_memory_plan", "has_memory_actions"]

_RECOMPUTE, _OFFLOAD, _RELOAD = ActionType.RECOMPUTE, ActionType.OFFLOAD, ActionType.RELOAD
_FIELDS = ("full", "keep_attention", "offload", "every", "mlp_chunk_size")


def _describe(choice: StageMemory) -> str:
    """``StageMemory`` as the text a memory action carries (``full=1,keep_attention=0,...``)."""
    def show(name: str) -> str:
        value = getattr(choice, name)
        return str(value) if value is not None else "none" if name == "mlp_chunk_size" else "all"

    return ",".join(f"{name}={show(name)}" for name in _FIELDS)


def _parse(text: str) -> StageMemory:
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in _FIELDS:
            raise ValueError(f"memory action name {text!r}: unknown field {name!r}; expected {', '.join(_FIELDS)}")
        values[name] = None if value in ("all", "none") else int(value)
    return StageMemory(**values)


def has_memory_actions(program: Program) -> bool:
    """Whether any rank of ``program`` holds a memory action (``RECOMPUTE``, ``OFFLOAD``, ``RELOAD``)."""
    return any(ACTION_RULES[a.type].from_memory_plan for actions in program.actions for a in actions)


def lower_memory_plan(program: Program, plan: MemoryPlan, boundaries: Sequence[int]) -> Program:
    """``program`` with ``plan`` written into it as memory actions (see the module docstring).

    Args:
        program: a training program without memory actions (one-to-one pairs: no split placement).
        plan: recompute / offload per (stage, microbatch).
        boundaries: block boundaries of the stages, ``len == program.num_stages + 1``: which blocks
            each stage has decides which choices have an effect.

    Returns:
        The program with the memory actions (the same object when the plan writes none).

    Raises:
        ValueError: a program that holds memory actions already or places a stage's actions on several
            ranks, or boundaries of another stage count.
    """
    if len(boundaries) != program.num_stages + 1:
        raise ValueError(
            f"{len(boundaries)} boundaries for a program of {program.num_stages} stages; expected {program.num_stages + 1}."
        )
    if program.pair_ranks is not None:
        raise ValueError(f"program {program.name!r} places a stage on several ranks; memory plans need one rank per stage.")
    if has_memory_actions(program):
        raise ValueError(f"program {program.name!r} holds memory actions already; lower a plan into a program without them.")
    if plan.is_empty:
        return program
    rows, changed = [], False
    for actions in program.actions:
        row: list[Action] = []
        backward_seen: set[tuple[int, int]] = set()
        for action in actions:
            key = (action.stage, action.microbatch)
            if action.type.is_backward and key not in backward_seen:
                backward_seen.add(key)
                row += _before_backward(action.stage, action.microbatch, plan, boundaries)
            row.append(action)
            if action.type is ActionType.FORWARD:
                row += _after_forward(action.stage, action.microbatch, plan, boundaries)
        changed = changed or len(row) != len(actions)
        rows.append(tuple(row))
    if not changed:
        return program
    return Program(program.name, program.num_stages, program.num_microbatches, program.stage_to_rank, tuple(rows))


def _modes(stage: int, microbatch: int, plan: MemoryPlan, boundaries: Sequence[int]) -> tuple[StageMemory, set[str]]:
    choice = plan.choice(stage, microbatch)
    return choice, set(choice.block_modes(boundaries[stage + 1] - boundaries[stage]))


def _after_forward(stage: int, microbatch: int, plan: MemoryPlan, boundaries: Sequence[int]) -> list[Action]:
    choice, modes = _modes(stage, microbatch, plan, boundaries)
    return [Action(stage, _OFFLOAD, microbatch, _describe(choice))] if OFFLOAD in modes else []


def _before_backward(stage: int, microbatch: int, plan: MemoryPlan, boundaries: Sequence[int]) -> list[Action]:
    choice, modes = _modes(stage, microbatch, plan, boundaries)
    name = _describe(choice)
    out = [Action(stage, _RELOAD, microbatch, name)] if OFFLOAD in modes else []
    if modes & {FULL, KEEP_ATTENTION}:
        out.append(Action(stage, _RECOMPUTE, microbatch, name))
    return out


def read_memory_plan(program: Program) -> MemoryPlan:
    """The memory plan written into ``program`` (:func:`lower_memory_plan`'s inverse on the pairs it wrote).

    A stage whose every microbatch has the same choice is read as a per-stage entry, otherwise per
    (stage, microbatch); pairs without memory actions keep everything (the plan's default).
    Actions without a name (a program read from text) stand for every block of the pair.

    Raises:
        ValueError: a memory action whose name is not a memory choice.
    """
    found: dict[tuple[int, int], StageMemory] = {}
    for actions in program.actions:
        for action in actions:
            if not ACTION_RULES[action.type].from_memory_plan:
                continue
            key = (action.stage, action.microbatch)
            if action.name:
                found[key] = _parse(action.name)
                continue
            before = found.get(key, StageMemory())
            if action.type is _RECOMPUTE:
                found[key] = StageMemory(None, before.keep_attention, before.offload, before.every, before.mlp_chunk_size)
            else:
                found[key] = StageMemory(before.full, before.keep_attention, None, before.every, before.mlp_chunk_size)
    stages, microbatches = {}, {}
    for stage in sorted({s for s, _ in found}):
        choices = [found.get((stage, mb)) for mb in range(program.num_microbatches)]
        if None not in choices and len(set(choices)) == 1:
            stages[stage] = choices[0]
        else:
            microbatches.update({(stage, mb): c for mb, c in enumerate(choices) if c is not None})
    return MemoryPlan(stages=stages, microbatches=microbatches)
