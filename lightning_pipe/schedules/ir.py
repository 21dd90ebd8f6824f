"""The action IR: the plain data every schedule produces and the runtime executes.

A *program* holds, for every pipeline rank, the ordered list of actions that rank performs for one
optimizer step. Actions are immutable and have a one-token text form compatible with
``torch.distributed.pipelining`` (``0F3`` is "stage 0, forward, microbatch 3"; ``1SEND_F2``).

Stages are *global* stage indices ``0 .. num_stages - 1``; ``Program.stage_to_rank`` places them on
ranks (one-to-one, circular for interleaved schedules, V-shaped for ZB-V). Communication actions name
the stage that sends or receives; the peer stage is implied (``SEND_F`` of stage ``s`` goes to stage
``s + 1``; ``SEND_B`` of stage ``s`` goes to stage ``s - 1``), and so is the peer rank.

Split placement (``Program.pair_ranks``). Two seed schedules put actions of one stage on more than one
rank: HelixPipe runs the parameter-free attention of layer ``l`` for microbatch ``i`` on a rank that
depends on ``i``, and SPipe runs a stage's backward on another rank than its forward. For them a
program carries the forward and backward rank of every ``(stage, microbatch)`` pair, and a stage whose
backward runs elsewhere ships its input (the *checkpoint*) with ``SEND_C``/``RECV_C`` to the rank that
recomputes it. Programs without ``pair_ranks`` (every built-in 1F1B-like family) are unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ActionType(str, enum.Enum):
    """What one action does. The values are the tokens of the text form."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # zero-bubble: gradient w.r.t. the stage input only
    BACKWARD_WEIGHT = "W"  # zero-bubble: gradient w.r.t. the stage parameters, deferred
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    # Split placement only (``Program.pair_ranks``): a stage's input sent from the rank of its forward to
    # the rank of its backward, which recomputes the stage from it (SPipe's boundary checkpoints).
    # Simulated and validated; the runtime does not run them (``executed`` is False).
    SEND_C = "SEND_C"
    RECV_C = "RECV_C"
    # Memory actions: a memory plan written into the program (``planning.memory_lowering``), so the plan
    # can be read off the program and the simulator prices it from the action-rule table. The runtime's
    # executor runs them as markers: the recompute / offload itself happens inside the pair's blocks,
    # through the block wrappers and saved-tensor hooks armed for that (stage, microbatch) from the same
    # plan (runtime/memory.py, runtime/offload.py). Schedules do not emit them for the strategy
    # (``check_executable``); HelixPipe and SPipe emit RECOMPUTE for runtime/split_executor.py.
    RECOMPUTE = "RECOMPUTE"  # memory action: recompute the stage's saved activations
    OFFLOAD = "OFFLOAD"  # memory action: move saved activations to host memory
    RELOAD = "RELOAD"  # memory action: bring offloaded activations back
    CUSTOM = "CUSTOM"  # user-registered instruction; ``Action.name`` says which (see instructions.py)

    @property
    def is_compute(self) -> bool:
        """True for forward and the backward kinds."""
        return self in _COMPUTE

    @property
    def is_communication(self) -> bool:
        """True for the point-to-point kinds (activations, gradients and checkpoints)."""
        return self in _COMMUNICATION

    @property
    def is_backward(self) -> bool:
        """True for ``B`` and ``I``: the actions that produce the gradient sent to the previous stage."""
        return self in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT)


_COMPUTE = frozenset({ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT})
_COMMUNICATION = frozenset(
    {ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B, ActionType.SEND_C, ActionType.RECV_C}
)
#: Kinds that run where the pair's backward runs (``Program.pair_ranks``); every other kind of a pair
#: runs where its forward runs.
BACKWARD_SIDE = frozenset(
    {
        ActionType.BACKWARD,
        ActionType.BACKWARD_INPUT,
        ActionType.BACKWARD_WEIGHT,
        ActionType.SEND_B,
        ActionType.RECV_B,
        ActionType.RECV_C,
        ActionType.RECOMPUTE,
        ActionType.OFFLOAD,
        ActionType.RELOAD,
    }
)


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``type`` applied to global ``stage`` for ``microbatch``.

    Attributes:
        stage: global stage index.
        type: what to do.
        microbatch: microbatch index (None only while building a program; every action of a valid
            program has one).
        name: for ``ActionType.CUSTOM``: the registered instruction's name (its text token); for the
            memory kinds: the pair's memory choice as written by ``planning.memory_lowering`` (not
            part of the text form); None otherwise. Added after the first three fields so that
            existing positional construction and equality of built-in actions are unchanged.
    """

    stage: int
    type: ActionType
    microbatch: int | None = None
    name: str | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        token = self.name if self.type is ActionType.CUSTOM and self.name else self.type.value
        return f"{self.stage}{token}{mb}"


def F(stage: int, microbatch: int) -> Action:
    """Forward of ``stage`` for ``microbatch``."""
    return Action(stage, ActionType.FORWARD, microbatch)


def B(stage: int, microbatch: int) -> Action:
    """Full backward of ``stage`` for ``microbatch``."""
    return Action(stage, ActionType.BACKWARD, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: E743 - the IR's own letter
    """Input-gradient backward of ``stage`` for ``microbatch`` (zero-bubble)."""
    return Action(stage, ActionType.BACKWARD_INPUT, microbatch)


def W(stage: int, microbatch: int) -> Action:
    """Weight-gradient backward of ``stage`` for ``microbatch`` (zero-bubble)."""
    return Action(stage, ActionType.BACKWARD_WEIGHT, microbatch)


@dataclass(frozen=True)
class Program:
    """Per-rank action lists for one optimizer step of a pipeline.

    Attributes:
        name: the family or spec that produced it (for display).
        num_stages: number of global stages.
        num_microbatches: number of microbatches per step.
        stage_to_rank: rank of every global stage; ``len == num_stages``.
        actions: one tuple of actions per rank, in execution order.
        pair_ranks: None when every action of stage ``s`` runs on ``stage_to_rank[s]``. Otherwise
            ``pair_ranks[stage][microbatch] == (forward_rank, backward_rank)``: where the pair's forward
            side (``F``, its sends and receives, ``SEND_C``) and backward side (``BACKWARD_SIDE``)
            run; ``stage_to_rank`` then names the rank that owns the stage's parameters.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    pair_ranks: tuple[tuple[tuple[int, int], ...], ...] | None = field(default=None, repr=False)

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks."""
        return len(self.actions)

    @property
    def splits_backward(self) -> bool:
        """Whether the program runs zero-bubble's split backward (``I`` and ``W`` instead of ``B``)."""
        return any(a.type is ActionType.BACKWARD_INPUT for actions in self.actions for a in actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Global stages placed on ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def rank_of(self, stage: int) -> int:
        """Rank that runs global ``stage`` (owns its parameters, under split placement)."""
        return self.stage_to_rank[stage]

    def forward_rank(self, stage: int, microbatch: int) -> int:
        """Rank of the forward side of ``(stage, microbatch)``."""
        return self.stage_to_rank[stage] if self.pair_ranks is None else self.pair_ranks[stage][microbatch][0]

    def backward_rank(self, stage: int, microbatch: int) -> int:
        """Rank of the backward side of ``(stage, microbatch)`` (``BACKWARD_SIDE`` kinds)."""
        return self.stage_to_rank[stage] if self.pair_ranks is None else self.pair_ranks[stage][microbatch][1]

    def rank_of_action(self, action: Action) -> int:
        """Rank that runs ``action`` (actions without a microbatch: the stage's owner)."""
        if self.pair_ranks is None or action.microbatch is None:
            return self.stage_to_rank[action.stage]
        return self.pair_ranks[action.stage][action.microbatch][action.type in BACKWARD_SIDE]
