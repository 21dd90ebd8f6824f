"""Running registered instructions (``CUSTOM`` actions, FlexPipe's ``register_new_inst``) on a rank.

A schedule may carry user instructions (``schedules/instructions.py``): the DSL places
``Action(stage, CUSTOM, microbatch, name=...)`` after an anchor action, and the executor calls the
instruction's ``runtime_function`` (``"package.module:function"``) there with an
:class:`InstructionCall`. The function runs between two actions of the rank's program: it may log,
synchronize or prefetch, but must not change what the step computes (a plan changes how, never
what); lightning-pipe cannot check that for an arbitrary function.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_pipe.schedules.instructions import get_instruction
from lightning_pipe.schedules.ir import Action

__all__ = ["InstructionCall", "run_instruction"]


@dataclass(frozen=True)
class InstructionCall:
    """What a registered instruction's runtime function receives.

    Attributes:
        name: the instruction's name.
        stage: the global stage of the action it follows.
        microbatch: the microbatch of that action.
        pipeline_rank: the rank running it.
        attributes: the instruction's ``attributes`` (FlexPipe's ``inst_attr``).
    """

    name: str
    stage: int
    microbatch: int | None
    pipeline_rank: int
    attributes: Mapping[str, Any]


def run_instruction(action: Action, pipeline_rank: int) -> None:
    """Call the runtime function of ``action``'s registered instruction.

    Raises:
        ValueError: the instruction is not registered in this process, or its function cannot be
            imported (the message names the instruction and the path to fix).
    """
    instruction = get_instruction(action.name)
    function = _function(instruction.runtime_function, instruction.name)
    function(InstructionCall(instruction.name, action.stage, action.microbatch, pipeline_rank, instruction.attributes))


@functools.lru_cache(maxsize=64)
def _function(path: str, name: str) -> Callable[[InstructionCall], Any]:
    module_name, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute) if attribute else None
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"Instruction {name!r}: its runtime function {path!r} cannot be imported ({error}); register it with "
            "`runtime_function='package.module:function'` importable on every rank."
        ) from error
    if not callable(function):
        raise ValueError(f"Instruction {name!r}: {path!r} is not 'package.module:function' naming a callable.")
    return function
